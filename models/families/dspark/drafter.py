"""DSpark at inference: one forward of the draft fills the block [root, M, ..., M], then the slots are decoded left
to right, each slot's logits biased by the Markov head from the token drafted just before it (model.py):
a chain of up to block_size tokens, what vLLM 0.32's DSparkSpeculator drafts with method dspark (greedy).

Because a slot's distribution depends on the token before it, DSpark's slots are not independent heads: a static
Medusa-style tree (one top-k per depth) would give a child a parent it was not biased on, so DSpark drafts chains
only. The confidence head's per-slot acceptance estimates c_k can cut the chain early: with extra.confidence_cut
= τ > 0 the drafter keeps depth k while Π_{j<=k} c_j >= τ (vLLM's adaptive verification ranks requests by the same
product); τ = 0 (the default) always drafts num_speculative_tokens tokens.

Own cache (models.block_draft.BlockCache): the context keys / values of every committed position, per layer,
appended from state.new_aux on every propose() (as DFlash's drafter). Drafts are deterministic (argmax), so
rejection sampling treats them as point masses and stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.engine.drafters.block import BlockDrafter
from eval.engine.drafters.drafter import DecodeState
from eval.engine.tree import StaticTree, Tree, chain_choices


class DSparkDrafter(BlockDrafter):
    name = "dspark"

    def __init__(self, draft, num_speculative_tokens: int | None = None, confidence_cut: float = 0.0):
        """draft: model.py's DSparkDraft; num_speculative_tokens: drafts per step (None = block_size, the most one
        block gives); confidence_cut: stop where the product of the confidences falls below it (0 = never)."""
        n = int(draft.block_size if num_speculative_tokens is None else num_speculative_tokens)
        if not 1 <= n <= draft.block_size:
            raise ValueError(f"num_speculative_tokens={n}: a DSpark block of {draft.block_size} slots drafts "
                             f"1..{draft.block_size} (leave it unset for all {draft.block_size})")
        if not 0.0 <= confidence_cut < 1.0:
            raise ValueError(f"confidence_cut={confidence_cut} must be in [0, 1)")
        super().__init__(draft)
        self.num_speculative_tokens, self.confidence_cut = n, float(confidence_cut)
        self.max_nodes = n + 1
        self._trees = {k: StaticTree(chain_choices(k)) for k in range(n + 1)}
        self.last_confidence: torch.Tensor | None = None  # c_k of the last proposal (tests, reports)

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        self._commit(state)
        drafts, conf = self.draft.draft_chain(self._cache, state.root, self.num_speculative_tokens)
        self.last_confidence = conf.cpu()
        n = self.kept_drafts(conf)
        return self._trees[n].fill(state.root, drafts[:n, None].cpu())

    def kept_drafts(self, conf: torch.Tensor) -> int:
        """Drafts kept of a chain whose confidences are conf [D]: all D, or with confidence_cut τ > 0 the leading
        depths whose product of confidences stays >= τ (also the field's batched path, per chain)."""
        if self.confidence_cut <= 0:
            return int(conf.shape[0])
        survive = torch.cumprod(conf.float(), dim=0) >= self.confidence_cut
        return int(survive.long().cumprod(dim=0).sum())


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """A chain of num_speculative_tokens Markov-decoded drafts (None: the block's block_size, the family's natural
    count), cut early by confidence_cut."""

    num_speculative_tokens: int | None = None  # drafts per step = slots of the block run; None = block_size (vLLM's)
    confidence_cut: float = 0.0  # > 0: keep depth k while the product of the confidences c_1..c_k stays >= it


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    if eval_cfg.tree_choices or eval_cfg.tree != "auto":
        raise ValueError("DSpark drafts a chain (each slot's logits depend on the token before it, so a static tree "
                         "does not apply): drop tree / tree_choices and set extra.num_speculative_tokens")
    drafter = DSparkDrafter(draft, options.num_speculative_tokens, options.confidence_cut)
    return drafter, {"num_speculative_tokens": drafter.num_speculative_tokens, "confidence_cut": drafter.confidence_cut,
                     "block_size": draft.block_size}


def chain(depth: int) -> dict:
    return {"tree": "auto", "tree_choices": None, "extra": {"num_speculative_tokens": depth, "confidence_cut": 0.0}}


def num_speculative_tokens(info: dict, drafter) -> int:
    if info.get("confidence_cut"):
        raise ValueError("a serving engine drafts a fixed chain: give this row extra.confidence_cut: 0")
    return int(info["num_speculative_tokens"])


def shape(info: dict) -> str:
    cut = info.get("confidence_cut")
    return f"chain of {info.get('num_speculative_tokens', '?')}" + (f", cut at confidence {cut}" if cut else "")


def max_speculative_tokens(draft) -> int:
    """One block drafts its block_size slots: no chain is deeper."""
    return int(draft.block_size)
