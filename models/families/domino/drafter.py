"""Domino at inference: one forward of the draft fills the block [root, M, ..., M], then the slots are decoded left
to right, each slot's logits corrected from the GRU's state over the root and the tokens drafted before it
(models/families/domino/model.py): a chain of up to block_size tokens, what SGLang's Domino rollout drafts (greedy).

A slot's distribution depends on every token drafted before it, so a static Medusa-style tree (one top-k per
depth) would give a child a parent its correction was not computed from: Domino drafts chains only here.
(TensorRT-Edge-LLM's Domino decoder grows trees by rerunning the GRU per branch; not done here.)

Own cache (models.block_draft.BlockCache): the context keys / values of every committed position, per layer,
appended from state.new_aux on every propose() (as DFlash's drafter). Drafts are deterministic (argmax), so
rejection sampling treats them as point masses and stays lossless.

No serving engine runs Domino: vLLM 0.32 and llama.cpp have no Domino method (SGLang and TensorRT-Edge-LLM do),
so its export is ours only (`specdraft export` refuses vllm / gguf, naming the formats it has).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.engine.drafters.block import BlockDrafter
from eval.engine.drafters.drafter import DecodeState
from eval.engine.tree import StaticTree, Tree, chain_choices


class DominoDrafter(BlockDrafter):
    name = "domino"

    def __init__(self, draft, num_speculative_tokens: int | None = None):
        """draft: model.py's DominoDraft; num_speculative_tokens: drafts per step (None = block_size, the most one
        block gives)."""
        n = int(draft.block_size if num_speculative_tokens is None else num_speculative_tokens)
        if not 1 <= n <= draft.block_size:
            raise ValueError(f"num_speculative_tokens={n}: a Domino block of {draft.block_size} slots drafts "
                             f"1..{draft.block_size} (leave it unset for all {draft.block_size})")
        super().__init__(draft)
        self.num_speculative_tokens = n
        self.max_nodes = n + 1
        self._tree = StaticTree(chain_choices(n))

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        self._commit(state)
        drafts, _ = self.draft.draft_chain(self._cache, state.root, self.num_speculative_tokens)
        return self._tree.fill(state.root, drafts[:, None].cpu())


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """A chain of num_speculative_tokens corrected drafts (None: the block's block_size, the family's natural
    count)."""

    num_speculative_tokens: int | None = None  # drafts per step = slots of the block run; None = block_size


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    if eval_cfg.tree_choices or eval_cfg.tree != "auto":
        raise ValueError("Domino drafts a chain (each slot's logits depend on the tokens drafted before it, so a "
                         "static tree does not apply): drop tree / tree_choices and set extra.num_speculative_tokens")
    drafter = DominoDrafter(draft, options.num_speculative_tokens)
    return drafter, {"num_speculative_tokens": drafter.num_speculative_tokens, "block_size": draft.block_size}


def chain(depth: int) -> dict:
    return {"tree": "auto", "tree_choices": None, "extra": {"num_speculative_tokens": depth}}


def num_speculative_tokens(info: dict, drafter) -> int:
    return int(info["num_speculative_tokens"])


def shape(info: dict) -> str:
    return f"chain of {info.get('num_speculative_tokens', '?')}"


def max_speculative_tokens(draft) -> int:
    """One block drafts its block_size slots: no chain is deeper."""
    return int(draft.block_size)
