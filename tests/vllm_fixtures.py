"""A tiny base that vLLM's CPU build can serve, saved as an HF directory, and a Medusa export on it.

vLLM's CPU attention has no kernel for head_dim 16 (the default tiny LLaMA's 64 / 4 heads): this base has 2
heads of 32. Its matrices are redrawn at std 0.15 so greedy continuations vary (the default init repeats one
token, which every draft predicts), and the Medusa weights are perturbed so each head accepts a different share.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.base import load_base
from models.draft import BaseView
from models.export.specdraft import export_specdraft
from models.families.medusa.model import MedusaDraft
from models.tiny import tiny_llama, tiny_tokenizer


def servable_tiny_base(out: Path, std: float = 0.15, seed: int = 0, num_layers: int = 2) -> Path:
    """num_layers=8: an EAGLE-3 on it reads layers 2 / 4 / 5, the three distinct layers vLLM's eagle3 expects."""
    model = tiny_llama(seed=seed, num_heads=2, num_kv_heads=1, num_layers=num_layers)  # head_dim 32
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def tiny_medusa(view: BaseView, num_heads: int = 3, share_lm_head: bool = True, seed: int = 0) -> MedusaDraft:
    torch.manual_seed(seed)
    draft = MedusaDraft(num_heads, 1, view, share_lm_head=share_lm_head)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return draft.eval()


def medusa_export_on_servable_base(root: Path, num_heads: int = 3, draft_vocab: int = 0) -> Path:
    """root/base (HF dir) + root/run/export (specdraft format, base_model = that dir). Returns the export dir.
    draft_vocab=N: the heads predict over N of the base's tokens (a random draft vocabulary, its d2t exported)."""
    from dataclasses import replace

    base_dir = servable_tiny_base(root / "base")
    base = load_base(str(base_dir), dtype="fp32")
    view = BaseView.from_model(base.model)
    if draft_vocab:
        gen = torch.Generator().manual_seed(5)
        view = replace(view, draft_vocab=torch.randperm(view.vocab_size, generator=gen)[:draft_vocab].sort().values)
    draft = tiny_medusa(view, num_heads)
    extra = {"draft_vocab_size": draft_vocab} if draft_vocab else None
    return export_specdraft(draft, root / "run" / "export", base.name, base.fingerprint, extra)


def hydra_export_on_servable_base(root: Path, num_heads: int = 2) -> Path:
    """Like medusa_export_on_servable_base, with a Hydra draft: a family vLLM has no method for."""
    from models.families.hydra.model import HydraDraft

    base_dir = servable_tiny_base(root / "base")
    base = load_base(str(base_dir), dtype="fp32")
    torch.manual_seed(1)
    draft = HydraDraft(num_heads, 1, BaseView.from_model(base.model), share_lm_head=True)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return export_specdraft(draft.eval(), root / "run" / "export", base.name, base.fingerprint)


def memorise_answers(draft, base, loss: object, steps: int) -> None:
    """Fit `draft` (lr 1e-2) to the base's own greedy answers (160 tokens) to the 3 smoke eval prompts, so both
    engines accept its drafts at every depth. One thread: many tiny ops run far faster on a busy CPU with one."""
    from conftest import fit_draft
    from helpers.drafts import greedy_continuation_batch

    from eval.harness.prompts import load_eval_prompts

    prompts = load_eval_prompts("tests/fixtures/eval_prompts.jsonl", base.tokenizer, num_prompts=3)
    batch = greedy_continuation_batch(base.model, [torch.tensor(p.input_ids) for p in prompts], draft.aux_layers, 160)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_draft(draft, [batch], BaseView.from_model(base.model), loss, steps=steps, lr=1e-2)
    finally:
        torch.set_num_threads(threads)


def eagle3_export_on_servable_base(root: Path, steps: int = 80, **draft_kw) -> Path:
    """root/base (the servable tiny base, 8 layers: aux layers 2 / 4 / 5) + root/run/export: an EAGLE-3 draft
    (ttt_steps 3; draft_kw: P-EAGLE's or the normalisation variants' options) fitted for `steps` steps to the base's
    own greedy answers (80: memorised; fewer: part way, so acceptance falls with depth), so both engines accept real
    drafts at every position and the per-position check compares non-zero numbers."""
    from models.families.eagle3.model import Eagle3Draft
    from train.config import LossSection

    base = load_base(str(servable_tiny_base(root / "base", num_layers=8)), dtype="fp32")
    torch.manual_seed(0)
    draft = Eagle3Draft(BaseView.from_model(base.model), ttt_steps=3, **draft_kw)
    assert draft.aux_layers == [2, 4, 5]
    memorise_answers(draft, base, LossSection(chunk_size=256), steps)
    return export_specdraft(draft.eval(), root / "run" / "export", base.name, base.fingerprint,
                            draft.export_config())


def dflash_export_on_servable_base(root: Path, block_size: int = 4, steps: int = 60) -> Path:
    """root/base + root/run/export: a DFlash draft that memorised the base's own greedy answers to the smoke eval
    prompts (so both engines accept real drafts and the per-position check compares non-zero numbers)."""
    from models.families.dflash.model import DFlashDraft, DFlashLossOptions
    from train.config import LossSection

    base = load_base(str(servable_tiny_base(root / "base")), dtype="fp32")
    torch.manual_seed(0)
    draft = DFlashDraft(BaseView.from_model(base.model), num_layers=2, block_size=block_size, num_anchors=256)
    memorise_answers(draft, base, LossSection(chunk_size=256, dflash=DFlashLossOptions(position_weights="decay")),
                     steps)
    with torch.no_grad():
        # vLLM 0.32's CPU rms_norm ignores the per-layer weights of its grouped context-key norm and applies
        # layer 0's k_norm to every layer's context keys (docs/families/dflash.md#export): with equal k_norm
        # weights the engines compute the same draft, which is what this check compares.
        for layer in draft.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(draft.layers[0].self_attn.k_norm.weight)
    return export_specdraft(draft.eval(), root / "run" / "export", base.name, base.fingerprint)
