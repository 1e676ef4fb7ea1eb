"""The demo's tree sweep (cli/demo_tune.py) on a one-head Hydra export of the tiny base: the three trees are each
timed against own AR, decode exactly what AR decodes, and the choice lands in the export's tuning.json; a tree
the user sets is not tuned."""

from __future__ import annotations

import json

import torch

from cli.demo import _sets_tree
from cli.demo_tune import DEMO_SHAPES, describe, tune_demo_tree

SMOKE_EVAL = "configs/eval/smoke.yaml"
PROMPTS = "tests/fixtures/eval_prompts.jsonl"


def test_the_sweep_times_the_three_trees_and_writes_the_choice(tmp_path):
    from models.base import load_base
    from models.draft import BaseView
    from models.export.specdraft import export_specdraft
    from models.families.hydra.model import HydraDraft

    base = load_base("tiny")
    torch.manual_seed(0)
    draft = HydraDraft(1, 1, BaseView.from_model(base.model), share_lm_head=True).eval()
    export = export_specdraft(draft, tmp_path / "run" / "export", base.name, base.fingerprint)
    choice = tune_demo_tree(export, ["dtype=fp32"], config=SMOKE_EVAL, dataset=PROMPTS)

    rec = json.loads((export / "tuning.json").read_text())["engines"]["ours"]
    assert [p["label"] for p in rec["points"]] == [label for label, _ in DEMO_SHAPES]
    ok = [p for p in rec["points"] if p["status"] == "ok"]
    assert len(ok) == 3 and all(p["same_tokens_as_ar"] == 1.0 and len(p["ratios"]) == 2 for p in ok)
    from eval.choice.record import RUN_ID

    # 2 repeats, under tune's rule of 3: a quick choice, applied only in this run (tests/test_quick_choice.py)
    assert rec["quick"] is True and rec["repeats"] == 2 and rec["run"] == RUN_ID
    assert rec["choice"]["label"] == choice["label"] and choice["reason"]
    wanted = {str(k["tree_choices"]) for _, k in DEMO_SHAPES}
    assert str(choice["tree_choices"]) in wanted  # AR chosen -> the cheapest tree, top-1
    assert choice["speculate"] or choice["tree_choices"] == [[0]]
    line = describe(choice)
    assert all(label in line for label, _ in DEMO_SHAPES) and "x AR" in line


def test_a_tree_the_user_sets_is_not_tuned():
    assert _sets_tree(["tree_choices=[[0],[1]]"]) and _sets_tree(["tree=chain2"])
    assert not _sets_tree(["num_prompts=4", "dtype=fp32"])
