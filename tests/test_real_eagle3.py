"""EAGLE-3 on the real SmolLM2 + ShareGPT (slow): a few steps from a hidden-state cache that holds the aux
layers [2, 15, 27], then fp32 greedy decoding on MT-bench (chain and tree) must equal plain greedy decoding
token for token, and the speculators export must load back into the same draft."""

import json

import pytest
import torch

from eval.harness.config import load_eval_config
from eval.harness.runner import eval_export
from train.config import load_train_config

pytestmark = pytest.mark.slow


def test_eagle3_trains_from_the_cache_and_decodes_losslessly(tmp_path):
    from models.base import load_base
    from models.draft import BaseView
    from models.export.specdraft import load_draft
    from models.families.eagle3.export_speculators import export_speculators, load_speculators
    from train.loop import train

    run_dir = tmp_path / "eagle3"
    cfg = load_train_config(["configs/eagle3.yaml", "configs/cpu_budget.yaml"], [
        f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_records=120", "data.max_length=256",
        "train.max_steps=2", "train.global_batch_size=4", "train.save_every=0", "train.val_batches=1",
        "wandb.enabled=false"])
    train(cfg)
    export_cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert export_cfg["hidden_cache"] is True and export_cfg["aux_layers"] == [2, 15, 27]
    manifest = json.loads(next((tmp_path / "cache" / "hidden").glob("*/manifest.json")).read_text())
    assert manifest["aux_layers"] == [2, 15, 27]

    for mode in ("chain", "tree"):
        eval_cfg = load_eval_config(["configs/eval/mtbench.yaml"], [
            "num_prompts=1", "max_new_tokens=24", "warmup_tokens=2", "hf_baseline=false", f"name=real-{mode}",
            f"extra.eagle3_mode={mode}"])
        report, _ = eval_export(run_dir / "export", eval_cfg)
        assert report["lossless_fraction"] == 1.0  # fp32 greedy: exactly plain greedy decoding
        assert report["acceptance_length"] >= 1.0

    base = load_base("smollm2")
    view = BaseView.from_model(base.model)
    draft, _ = load_draft(run_dir / "export", view, base.fingerprint)
    out = export_speculators(draft, tmp_path / "spec", "smollm2")
    spec = json.loads((out / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"].endswith("smollm2-135m-instruct-q4_1")
    back = load_speculators(out, view)
    ours, theirs = draft.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    # The speculators format lists the draft vocabulary sorted by base id (cpu_budget.yaml sets
    # draft.vocab_size): the same map and the same LM-head row for every base id, in another draft-id order.
    if "d2t" in ours:
        order_ours, order_back = torch.argsort(ours["d2t"]), torch.argsort(theirs["d2t"])
        assert torch.equal(ours["d2t"][order_ours], theirs["d2t"][order_back])
        torch.testing.assert_close(theirs["lm_head.weight"][order_back], ours["lm_head.weight"][order_ours])
    for name, value in ours.items():
        if name not in ("d2t", "lm_head.weight") or "d2t" not in ours:
            torch.testing.assert_close(theirs[name], value)
