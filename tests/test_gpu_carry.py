"""What every GPU call carries (docs/howto/gpu_kit.md) fits the device tool's 64 MiB less the plan's margin, sized
without building anything: the tree as the device tool copies it (tracked and untracked-not-ignored files, less
the `leave_aside` paths) plus the carried pieces' sizes that `make gpu-bundle` / `make gpu-data` recorded in
launch/gpu_carry_sizes.json. So a tree that grows past a call's room fails here, on any clone, not first on a
GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
import carry_sizes  # noqa: E402
import gpu_rehearse as gr  # noqa: E402

MIB = 2 ** 20


def test_every_call_fits_with_margin_from_the_recorded_sizes():
    plan = gr.load_plan()
    assert plan["carry_limit_mib"] == 64 and plan["carry_margin_mib"] >= 1
    recorded = carry_sizes.load()
    problems, sizes = [], {}
    for window in plan["windows"]:
        found, mib = gr.check_carry(plan, window, ROOT, recorded=recorded)
        problems += found
        sizes.update({f"{window}/{k}": round(v, 1) for k, v in mib.items()})
    assert not problems, "\n".join(problems)
    assert all(v <= 64 - plan["carry_margin_mib"] for v in sizes.values()), sizes


def test_every_carried_piece_has_a_recorded_size():
    plan, recorded = gr.load_plan(), carry_sizes.load()
    carried = {rel for calls in plan["windows"].values() for c in calls for rel in c.carry}
    assert carried and carried <= set(recorded), sorted(carried - set(recorded))
    # what the gguf halves weigh is no guess: the GGUF is 98 MB, half of it in each
    assert 45 * MIB < recorded[".gpudata/gguf0"] < 48 * MIB


def _repo(tmp_path: Path, tree_mib: float) -> Path:
    repo = tmp_path / "repo"
    (repo / "docs" / "img").mkdir(parents=True)
    (repo / ".gitignore").write_text(".gpudata/\n")
    with open(repo / "docs" / "img" / "plot.png", "wb") as f:
        f.truncate(int(tree_mib * MIB))  # sparse: its size is what counts
    (repo / "code.py").write_text("x = 1\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def _plan(margin: float, **extra) -> dict:
    call = {"name": "c1", "timeout_s": 300, "carry": [".whl", ".gpudata/gguf0"],
            "budget_s": {"tests": 200, "collect": 10},
            "command": "GPU_CHECK_DEADLINE=280 launch/gpu_check.sh $OUT/c1 tests"}
    return {"window_seconds": 900, "cold_start_seconds": 120, "carry_limit_mib": 64, "carry_margin_mib": margin,
            "image_lacks": {}, "windows": {"w": [gr.Call.parse(call)]}, **extra}


def test_a_call_inside_the_limit_but_not_its_margin_is_named_with_its_biggest_parts(tmp_path):
    repo = _repo(tmp_path, 3.0)
    recorded = {".whl": 6 * MIB, ".gpudata/gguf0": 54.5 * MIB}  # 3 + 6 + 54.5 = 63.5: under 64, over 63
    assert gr.check_carry(_plan(0), "w", repo, recorded=recorded)[0] == []
    problems, sizes = gr.check_carry(_plan(1), "w", repo, recorded=recorded)
    assert 63.4 < sizes["c1"] < 63.6
    assert len(problems) == 1 and problems[0].startswith("w/c1: carries 63.5 MiB"), problems
    assert "over 64 MiB less the 1 MiB margin" in problems[0]
    assert "biggest (MiB): .gpudata/gguf0 54.5, .whl 6.0, the tree 3.0" in problems[0]
    assert "the tree's biggest folders: docs/img 3.0" in problems[0]
    # leaving the plots aside (launch/gpu_aside.sh moves them out for the calls) makes it fit
    assert gr.check_carry(_plan(1, leave_aside=["docs/img"]), "w", repo, recorded=recorded)[0] == []


def test_a_carried_piece_without_a_record_is_named(tmp_path):
    problems, _ = gr.check_carry(_plan(1), "w", _repo(tmp_path, 0.1), recorded={".whl": MIB})
    assert problems == ["w/c1: carries .gpudata/gguf0, whose size is not recorded in launch/gpu_carry_sizes.json: "
                        "run `make gpu-data` (it records it)"]


def test_recording_measures_the_piece_and_keeps_the_others(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".whl").mkdir(parents=True)
    (repo / ".whl" / "a.whl").write_bytes(b"x" * 1000)
    (repo / ".whl" / "b.tar.gz").write_bytes(b"y" * 24)
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"about": "", "bytes": {".gpudata/meta": 7}}))
    assert carry_sizes.record([".whl/"], repo=repo, path=sizes) == {".whl": 1024}
    assert carry_sizes.load(sizes) == {".gpudata/meta": 7, ".whl": 1024}
    with pytest.raises(FileNotFoundError, match="build it first"):
        carry_sizes.record([".gpudata/gguf0"], repo=repo, path=sizes)
    # the rehearsal says when a piece on disk has moved away from its record
    plan = _plan(1)
    assert gr.stale_records(plan, repo, recorded={".whl": 1024}) == []
    (repo / ".whl" / "c.whl").write_bytes(b"z" * 100_000)
    notes = gr.stale_records(plan, repo, recorded={".whl": 1024})
    assert len(notes) == 1 and notes[0].startswith(".whl is 0.10 MiB on disk"), notes


def test_gpu_aside_moves_the_nested_plot_folder_out_and_back(tmp_path):
    """launch/gpu_aside.sh with the plan's leave_aside (docs/lab/img sits two folders down)."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    for name in ("gpu_aside.sh", "gpu_calls.json"):
        (repo / "launch" / name).write_bytes((ROOT / "launch" / name).read_bytes())
    (repo / "docs" / "lab" / "img").mkdir(parents=True)
    (repo / "docs" / "lab" / "img" / "plot.png").write_bytes(b"png")
    (repo / "docs" / "lab" / "notes.md").write_text("notes\n")
    (repo / "drafts" / "d").mkdir(parents=True)
    (repo / "drafts" / "d" / "model.safetensors").write_bytes(b"w")
    aside = ["bash", "launch/gpu_aside.sh"]
    assert "docs/lab/img" in gr.load_plan(repo / "launch" / "gpu_calls.json")["leave_aside"]
    subprocess.run([*aside, "aside"], cwd=repo, check=True, capture_output=True)
    assert not (repo / "docs" / "lab" / "img").exists() and not (repo / "drafts").exists()
    assert (repo / ".gpu-aside" / "docs" / "lab" / "img" / "plot.png").read_bytes() == b"png"
    assert (repo / "docs" / "lab" / "notes.md").exists()  # only the plots leave
    subprocess.run([*aside, "back"], cwd=repo, check=True, capture_output=True)
    assert (repo / "docs" / "lab" / "img" / "plot.png").read_bytes() == b"png"
    assert (repo / "drafts" / "d" / "model.safetensors").read_bytes() == b"w"
