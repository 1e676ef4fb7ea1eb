"""What recipes/field_families.sh trains and judges, read from the family registry (FamilySpec.field_runs;
models/registry.py: field_runs):

    field_plan.py dump          everything below, once, tab-separated: "RUN<TAB>KEY<TAB>VALUE" a line ("-" for the
                                experiment's own keys `runs` and `reference`; one `shape` line per shape); the recipe
                                reads this file, so a run costs one start of Python, not one per question
    field_plan.py runs          the default runs, in queue order, on one line
    field_plan.py args RUN      its config file and its recipe's overrides (learning-free: the script that judges it)
    field_plan.py label RUN     its row's name in the table
    field_plan.py shapes RUN    its field shapes, one "name overrides..." a line, chains first

Per run `dump` also says `batched` (1: its family declares a batched field path, its `lockstep` role module, so no
one-prompt probe is needed before judging), `diagnostics` (a script run once on its trained draft, or nothing) and,
per shape, `against:<shape>` = "<reference run> <its shape>" (the reference's first shape for the run's first, its
second for the later ones; nothing for the reference itself).

An unknown run fails with one line naming the known ones (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def shape_name(line: str) -> str:
    return line.split()[0]


def against(runs: dict, name: str, shape_index: int) -> str:
    """"<reference run> <its shape>" a run's shape is paired with, or "" (no reference, or the reference itself)."""
    ref = next((r for r in runs.values() if r.reference), None)
    if ref is None or ref.name == name:
        return ""
    ref_shapes = [shape_name(line) for line in ref.shapes]
    return f"{ref.name} {ref_shapes[min(shape_index, 1, len(ref_shapes) - 1)]}"


def dump_lines() -> list[str]:
    from models.registry import field_run_packages, field_runs

    runs, packages = field_runs(), field_run_packages()
    ref = next((r.name for r in runs.values() if r.reference), "")
    lines = [f"-\truns\t{' '.join(name for name, run in runs.items() if run.default)}", f"-\treference\t{ref}"]
    for name, run in runs.items():
        batched = importlib.util.find_spec(f"{packages[name]}.lockstep") is not None
        lines += [f"{name}\targs\t{run.args}", f"{name}\tlabel\t{run.label}", f"{name}\tbatched\t{int(batched)}",
                  f"{name}\tdiagnostics\t{run.diagnostics}"]
        for i, line in enumerate(run.shapes):
            lines += [f"{name}\tshape\t{line}", f"{name}\tagainst:{shape_name(line)}\t{against(runs, name, i)}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    from models.registry import field_runs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("dump", "runs", "args", "label", "shapes"))
    p.add_argument("run", nargs="?")
    a = p.parse_args(argv)
    if a.what == "dump":
        print("\n".join(dump_lines()))
        return 0
    runs = field_runs()
    if a.what == "runs":
        print(" ".join(name for name, run in runs.items() if run.default))
        return 0
    if a.run not in runs:
        what = f"unknown run {a.run}" if a.run else f"{a.what} needs a run"
        print(f"field_plan: {what} (known: {' '.join(runs)})", file=sys.stderr)
        return 2
    run = runs[a.run]
    print(run.args if a.what == "args" else run.label if a.what == "label" else "\n".join(run.shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
