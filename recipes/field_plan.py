"""What recipes/field_families.sh trains and judges, read from the family registry (FamilySpec.field_runs;
models/registry.py: field_runs):

    field_plan.py runs          the default runs, in queue order, on one line
    field_plan.py args RUN      its config file and its recipe's overrides (learning-free: the script that judges it)
    field_plan.py label RUN     its row's name in the table
    field_plan.py shapes RUN    its field shapes, one "name overrides..." a line, chains first

An unknown run fails with one line naming the known ones (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from models.registry import field_runs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("runs", "args", "label", "shapes"))
    p.add_argument("run", nargs="?")
    a = p.parse_args(argv)
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
