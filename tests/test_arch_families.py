"""Every draft family on every non-LLaMA tiny architecture (Qwen2, Qwen3, Mistral, Gemma-3; 8-token
windows): a few training steps lower the loss, and the trained draft decodes losslessly (greedy,
fp32) through both backends where `fast` supports the architecture. (LLaMA: the family test files.)"""

from __future__ import annotations

import pytest
import torch
from conftest import fit_draft
from test_arch_decoding import greedy_reference, make_model

from eval.engine.backends.fast import FastBackend, supports
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter
from eval.harness.config import EvalConfig
from models.base import HiddenStates, last_hidden_and_logits
from models.draft import BaseView, DraftBatch
from models.families.ctc.model import CTCOptions
from models.families.hydra.model import HydraOptions
from models.registry import DRAFT_MODELS
from train.config import DraftSection, LossSection

ARCHS = ["qwen2", "qwen3", "mistral", "gemma3"]
FAMILIES = {  # 4 deep: the default tree16 of Medusa / Hydra
    "medusa": dict(family="medusa", num_heads=4),
    "hydra_pp": dict(family="hydra", num_heads=4, num_layers=1, hydra=HydraOptions(prefix_layer=True)),
    "redrafter": dict(family="redrafter", num_heads=4),
    "ctc": dict(family="ctc", num_heads=4, ctc=CTCOptions(num_frames=5)),
}
NEW = 20


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, busy CPU


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request):
    """(arch, base model with 8-token windows, its greedy batch, two prompts with their references)."""
    model = make_model(request.param, 8)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 320, (2, 40), generator=gen)
    hidden, _ = last_hidden_and_logits(model, ids)
    batch = DraftBatch(hidden, ids, torch.ones_like(ids))
    prompts = [torch.randint(3, 320, (n,), generator=gen) for n in (9, 14)]
    refs = [greedy_reference(model, p) for p in prompts]
    return request.param, model, batch, prompts, refs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_and_decodes_losslessly(arch_setup, family):
    arch, model, batch, prompts, refs = arch_setup
    view = BaseView.from_model(model)
    torch.manual_seed(0)
    draft = DRAFT_MODELS[FAMILIES[family]["family"]].from_config(DraftSection(**FAMILIES[family]), view)
    first, out = fit_draft(draft, [batch], view, LossSection(), steps=4, lr=3e-3)
    assert torch.isfinite(out.loss) and float(out.loss.detach()) < first  # it trains
    draft.eval()
    drafter, _ = build_drafter(draft, {"family": FAMILIES[family]["family"], **draft.export_config()}, EvalConfig())
    backends = [HFBackend(model)]
    if supports(model.config)[0]:
        backends.append(FastBackend(model, max_len=128))
    for backend in backends:
        for prompt, ref in zip(prompts, refs):
            res = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
            assert res.tokens == ref[prompt.numel(): prompt.numel() + NEW], (arch, family, type(backend).__name__)


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_cache_rows_equal_the_base_forward(arch, tmp_path):
    """Batched, right-padded cache rows == an unpadded forward of each row, past the 16-token windows."""
    from data.dataset import build_datasets
    from data.hidden_cache import HiddenCache, build_hidden_cache
    from models.base import load_base

    base = load_base(f"tiny-{arch}")
    ds, _ = build_datasets(base.tokenizer, "tests/fixtures/sharegpt_tiny.json", max_records=None, max_length=96,
                           val_fraction=0.2, seed=0, cache_dir=tmp_path / "data", min_assistant_tokens=1)
    cache = HiddenCache(build_hidden_cache(HiddenStates(base.model), ds, tmp_path / "c", pad_id=0,
                                           device=torch.device("cpu"), micro_batch_size=3, shard_rows=4,
                                           cache_dtype="fp32"))
    lengths = [len(ds[i]["input_ids"]) for i in range(len(ds))]
    assert max(lengths) > 2 * 16 and len(set(lengths[:3])) > 1  # windows crossed, rows really padded
    for i in range(min(len(ds), 6)):
        ids = torch.tensor(ds[i]["input_ids"])[None]
        h, _ = last_hidden_and_logits(base.model, ids)
        torch.testing.assert_close(cache[i]["hidden"], h[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_train_loop_smoke_on_arch(arch, tmp_path, monkeypatch):
    """The real training loop (DeepSpeed, hidden-state cache) on each architecture; Gemma-3 goes on through
    export -> eval (fast backend, lossless) with data.chat_template=gemma recorded in the export."""
    import json

    from conftest import SMOKE_RECIPE

    from eval.harness.config import load_eval_config
    from eval.harness.runner import eval_export
    from train.config import load_train_config
    from train.loop import train

    gemma = arch == "gemma3"
    overrides = [f"run_dir={tmp_path / 'run'}", f"base.path=tiny-{arch}", "train.max_steps=2", "train.log_every=1",
                 "train.val_batches=0", f"data.cache_dir={tmp_path / 'd'}", "data.hidden_cache=auto"]
    if gemma:
        overrides.append("data.chat_template=gemma")
    run = train(load_train_config(SMOKE_RECIPE, overrides))
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 2 and all(v == v for v in losses)
    export_cfg = json.loads((run / "export" / "config.json").read_text())
    assert export_cfg["base_model"] == f"tiny-{arch}"
    if not gemma:
        assert "chat_template" not in export_cfg
        return
    assert "<start_of_turn>" in export_cfg["chat_template"]
    import models.base

    loaded = []  # the bases eval loads: their tokenizer must carry the export's template
    real_load = models.base.load_base
    monkeypatch.setattr(models.base, "load_base", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    report, _ = eval_export(run / "export", load_eval_config(["configs/eval/smoke.yaml"],
                                                             ["backend=fast", "hf_baseline=false"]))
    assert report["lossless"] is True and report["lossless_fraction"] == 1.0
    assert len(loaded) == 1 and loaded[0].tokenizer.chat_template == export_cfg["chat_template"]
