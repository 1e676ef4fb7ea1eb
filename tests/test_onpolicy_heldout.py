"""The on-policy held-out set: training scores the draft on the base's own answers to the prompts after the
training conversations, next to the data's own answers, and the acceptance estimate uses the on-policy numbers."""

import json

import pytest
from conftest import SMOKE_RECIPE

from data.self_distill import sidecar
from data.sharegpt import read_sharegpt
from train.config import load_train_config
from train.onpolicy import heldout_prompt_slice

FIXTURE = "tests/fixtures/sharegpt_tiny.json"


def test_the_held_out_prompts_start_after_the_training_slice(tmp_path):
    assert heldout_prompt_slice(FIXTURE, 30) == (FIXTURE, 30)
    regenerated = tmp_path / "regen.jsonl"  # a regenerated training file names the slice its prompts came from
    regenerated.write_text(json.dumps({"id": "x-0", "conversations": [{"from": "human", "value": "hi"},
                                                                      {"from": "gpt", "value": "hello"}]}) + "\n")
    sidecar(regenerated).write_text(json.dumps({"derived_from": {"source": "sharegpt", "max_records": 800}}))
    assert heldout_prompt_slice(str(regenerated), None) == ("sharegpt", 800)
    with pytest.raises(ValueError, match="set data.max_records"):
        heldout_prompt_slice(FIXTURE, None)


def test_training_reports_both_held_out_sets_and_estimates_from_the_on_policy_one(tmp_path, monkeypatch):
    import copy

    from models import tiny
    from train.loop import train

    # the default tiny base answers with whitespace (its greedy decode echoes one token); these weights answer
    diverse = tiny.diverse_tiny_llama(0)
    monkeypatch.setattr(tiny, "tiny_llama", lambda seed=0: copy.deepcopy(diverse))

    cache = tmp_path / "cache"
    cfg = load_train_config(SMOKE_RECIPE, [f"run_dir={tmp_path / 'run'}", "data.max_records=28",
                                           "data.onpolicy_heldout=4", "data.self_distill_max_new_tokens=12",
                                           f"data.cache_dir={cache}", "train.max_steps=2"])
    run_dir = train(cfg)
    result = json.loads((run_dir / "heldout.json").read_text())
    onpolicy = result["onpolicy"]
    assert onpolicy["conversations"] == 4 and len(onpolicy["depths"]) == cfg.draft.num_heads
    assert onpolicy["depths"][0]["tokens"] > 0
    summary = result["summary"]
    assert summary["est_accept_len"] == onpolicy["summary"]["est_accept_len"]
    assert summary["est_accept_len_sharegpt"] != summary["est_accept_len"]
    assert summary["top1_onpolicy/head1"] == onpolicy["depths"][0]["top1"]
    from train.heldout import format_heldout_table

    estimates = [line.rsplit(" ", 1)[1] for line in format_heldout_table(result).splitlines() if "estimate:" in line]
    assert estimates == [f"{summary['est_accept_len_sharegpt']:.2f}", f"{summary['est_accept_len']:.2f}"]
    # the slice: conversations 28..31 of the fixture, their prompts kept and their answers the base's own
    made = list((cache / "selfdistill").glob("*.jsonl"))
    assert len(made) == 1
    meta = json.loads(sidecar(made[0]).read_text())
    assert meta["derived_from"] == {"source": FIXTURE, "max_records": 32, "skip": 28}
    regenerated, _ = read_sharegpt(str(made[0]))
    original, _ = read_sharegpt(FIXTURE, 32)
    first_user = [next(m for m in c if m["role"] == "user") for c in original[28:]]
    assert [next(m for m in c if m["role"] == "user") for c in regenerated] == first_user
    assert all(r[-1]["content"] != o[-1]["content"] for r, o in zip(regenerated, original[28:]))
