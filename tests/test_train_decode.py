"""Decoded acceptance while training: the decode callable runs at every snapshot and at the end, metrics.jsonl
carries decoded_al, export/ is the best snapshot by decoded AL and export_last/ the final state; through
`specdraft train`, the real decoder's AL beside the teacher-forced chain estimate on the same prompts."""

from __future__ import annotations

import json

import pytest
from helpers.cli import smoke_cli_train
from helpers.stored_answers import write_tiny_refs

from train.best_export import DECODED_FILE, LAST_DIR, SELECTION_FILE
from train.config import load_train_config
from train.loop import train

SCRIPTED_AL = {2: 1.5, 4: 2.5, 6: 1.25}  # step -> the decoded AL the scripted decoder reports: step 4 is best


def test_the_best_decoded_snapshot_becomes_the_export_and_the_last_stays(tmp_path):
    calls = []

    def scripted(export_dir, base, step):
        assert (export_dir / "model.safetensors").is_file()  # called on a written export
        calls.append(step)
        return {"decoded_al": SCRIPTED_AL[step], "prompts": 2, "texts": []}

    run_dir = tmp_path / "run"
    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run_dir}", "train.max_steps=6", "train.export_every=2",
                             "train.decode_eval_prompts=2"])
    train(cfg, decode_eval=scripted)
    assert calls == [2, 4, 6]
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["decoded_al"] for r in rows if "decoded_al" in r} == SCRIPTED_AL
    selection = json.loads((run_dir / "export" / SELECTION_FILE).read_text())
    assert (selection["step"], selection["decoded_al"]) == (4, 2.5)
    assert (selection["last_step"], selection["last_decoded_al"]) == (6, 1.25)
    assert json.loads((run_dir / "export" / "config.json").read_text())["trained_steps"] == 4
    assert json.loads((run_dir / LAST_DIR / "config.json").read_text())["trained_steps"] == 6
    assert json.loads((run_dir / LAST_DIR / DECODED_FILE).read_text())["step"] == 6
    assert (run_dir / "export" / "model.safetensors").read_bytes() == \
        (run_dir / "exports" / "step00000004" / "model.safetensors").read_bytes()
    assert (run_dir / "heldout.json").is_file()  # the final state's, as without decoding


def test_without_decoding_the_export_is_the_final_state(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run_dir}", "train.max_steps=2", "train.decode_eval_prompts=0"])
    train(cfg, decode_eval=lambda *a: (_ for _ in ()).throw(AssertionError("decoding is off")))
    assert not (run_dir / LAST_DIR).exists() and not (run_dir / "export" / SELECTION_FILE).exists()
    assert json.loads((run_dir / "export" / "config.json").read_text())["trained_steps"] == 2


def test_specdraft_train_decodes_held_out_prompts(tmp_path, clean_env):
    run_dir = tmp_path / "run"
    # the fixture has 33 usable conversations: train on 30, decode the first user turns of the rest
    rows = smoke_cli_train(run_dir, "configs/medusa.yaml",
                           ["data.max_records=30", "train.export_every=3", "train.decode_eval_prompts=2",
                            "train.decode_eval_tokens=12"], clean_env())
    decoded = [r for r in rows if "decoded_al" in r]
    assert [r["step"] for r in decoded] == [3, 6]
    last = json.loads((run_dir / LAST_DIR / DECODED_FILE).read_text())
    assert last["prompts"] == 2 and last["heldout_skip"] == 30
    assert all(i.startswith("sharegpt-") and int(i.split("-")[1]) >= 30 for i in last["prompt_ids"])
    assert last["decoded_al"] >= 1.0
    # fp32, the base's own greedy answers: the chain estimate replays the decoder
    assert abs(last["est_accept_len_chain"] - last["decoded_al"]) < 1e-6
    assert decoded[-1]["decoded/est_accept_len_chain"] == last["est_accept_len_chain"]
    assert json.loads((run_dir / "export" / SELECTION_FILE).read_text())["step"] in (3, 6)


def test_snapshots_scored_on_stored_answers_match_decoding_them(tmp_path):
    """train.snapshot_eval=field: each snapshot's simulated_al (mean over the stored sets of each set's AL) equals
    what decoding the same prompts for the same lengths with the snapshot as a chain gives, and export/ is the
    best snapshot by it."""
    import torch

    from cli.train_decode import make_decode_eval
    from eval.engine.backends.hf import HFBackend
    from eval.engine.decoder import speculative_generate
    from eval.engine.drafters.registry import build_drafter, chain_overrides
    from eval.field.refs import read_refs
    from eval.harness.config import EvalConfig
    from models.export.load import load_export

    refs = write_tiny_refs(tmp_path / "refs")
    run_dir = tmp_path / "run"
    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run_dir}", "train.max_steps=4", "train.export_every=2", "train.lr=5e-3",
                             "train.decode_eval_prompts=2", "train.snapshot_eval=field", f"train.field_refs={refs}",
                             "train.field_eval_sets=set-a,set-b"])
    train(cfg, decode_eval=make_decode_eval(cfg))
    record = json.loads((run_dir / "exports" / "step00000002" / DECODED_FILE).read_text())
    assert record["score_key"] == "simulated_al" and record["prompts"] == 4  # 2 of each set
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "simulated_al" in r] == [2, 4]

    loaded = load_export(run_dir / "exports" / "step00000002")
    _card, stored = read_refs(refs)
    heads = cfg.draft.num_heads
    eval_cfg = EvalConfig(**{k: v for k, v in chain_overrides("medusa", heads).items() if k != "extra"})
    drafter, _ = build_drafter(loaded.draft, loaded.config, eval_cfg)
    per_set = {}
    for r in [r for r in stored if r.id.endswith(("-0", "-1"))]:
        g = speculative_generate(HFBackend(loaded.base.model), drafter, torch.tensor(r.prompt), max_new_tokens=r.n)
        tokens, steps = per_set.get(r.set, (0, 0))
        per_set[r.set] = (tokens + sum(g.accepted_lengths), steps + g.base_steps)
    decoded = sum(t / s for t, s in per_set.values()) / len(per_set)
    assert abs(record["simulated_al"] - decoded) < 1e-9, (record["simulated_al"], decoded)
    assert record["simulated_al"] > 1.0  # the draft accepts something: equality is not 1 == 1
    selection = json.loads((run_dir / "export" / SELECTION_FILE).read_text())
    assert selection["score_key"] == "simulated_al"
    best = max(selection["candidates"], key=lambda c: (c["simulated_al"], c["step"]))
    assert selection["step"] == best["step"]


def test_snapshot_eval_field_without_stored_answers_for_the_base_fails_clearly(tmp_path):
    from cli.train_decode import make_decode_eval
    from eval.field.refs import RefsError

    refs = write_tiny_refs(tmp_path / "refs", fingerprint="0" * 16)  # another base's answers
    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"],
                            [f"run_dir={tmp_path / 'run'}", "train.max_steps=2", "train.export_every=2",
                             "train.decode_eval_prompts=2", "train.snapshot_eval=field", f"train.field_refs={refs}",
                             "train.field_eval_sets=set-a"])
    with pytest.raises(RefsError, match="train.snapshot_eval=field: .*made with base 'tiny'"):
        train(cfg, decode_eval=make_decode_eval(cfg))
