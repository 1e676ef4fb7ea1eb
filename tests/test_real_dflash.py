"""DFlash on the real SmolLM2 + ShareGPT (slow): a few steps from a hidden-state cache that holds the aux layers
[2, 15, 27], the held-out table by slot, then fp32 greedy decoding on MT-bench (the chain of γ-1 and a static
tree) must equal plain greedy decoding token for token, and the vLLM export must load back into the same draft."""

import json

import pytest
import torch

from eval.harness.config import load_eval_config
from eval.harness.runner import eval_export
from train.config import load_train_config

pytestmark = pytest.mark.slow


def test_dflash_trains_from_the_cache_and_decodes_losslessly(tmp_path):
    from models.base import load_base
    from models.draft import BaseView
    from models.export.formats import export_vllm
    from models.export.specdraft import load_draft
    from models.families.dflash.export_speculators import load_dflash_speculators
    from train.loop import train

    run_dir = tmp_path / "dflash"
    cfg = load_train_config(["configs/dflash.yaml", "configs/cpu_budget.yaml"], [
        f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_records=120", "data.max_length=256",
        "train.max_steps=2", "train.global_batch_size=4", "train.save_every=0", "train.val_batches=1",
        "draft.dflash.num_anchors=32", "wandb.enabled=false"])
    train(cfg)
    export_cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert export_cfg["hidden_cache"] is True and export_cfg["aux_layers"] == [2, 15, 27]
    assert export_cfg["block_size"] == 16 and export_cfg["num_layers"] == 5
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == list(range(1, 16))

    for name, extra in (("chain", []), ("tree", ["tree=tree16"])):
        eval_cfg = load_eval_config(["configs/eval/mtbench.yaml"], [
            "num_prompts=1", "max_new_tokens=24", "warmup_tokens=2", "hf_baseline=false", f"name=real-{name}",
            "dtype=fp32", *extra])
        report, _ = eval_export(run_dir / "export", eval_cfg)
        assert report["lossless_fraction"] == 1.0  # fp32 greedy: exactly plain greedy decoding
        assert report["acceptance_length"] >= 1.0

    base = load_base("smollm2")
    view = BaseView.from_model(base.model)
    draft, config = load_draft(run_dir / "export", view, base.fingerprint)
    out = export_vllm(draft, tmp_path / "vllm", config, view)
    spec = json.loads((out / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"].endswith("smollm2-135m-instruct-q4_1")
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 5 and spec["mask_token_id"] == 2
    back = load_dflash_speculators(out, view)
    ids = torch.randint(3, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    from models.base import last_hidden_and_aux

    _, aux = last_hidden_and_aux(base.model, ids, None, draft.aux_layers)
    anchors = torch.tensor([[3, 17, 30]])
    with torch.no_grad():
        a = draft.logits(draft.block_outputs(aux.to(draft.fc.weight.dtype), ids, anchors))
        b = back.logits(back.block_outputs(aux.to(back.fc.weight.dtype), ids, anchors))
        # the export sorts a draft vocabulary by base id: compare each base id's logit
        torch.testing.assert_close(a[..., torch.argsort(draft.d2t)] if draft.d2t is not None else a,
                                   b[..., torch.argsort(back.d2t)] if back.d2t is not None else b)
