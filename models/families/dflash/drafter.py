"""DFlash at inference: one forward of the draft fills a block [root, M, ..., M] and gives, for every depth
k = 1..γ-1, a distribution over x_{t+1+k}; a static tree over the per-depth top-k turns them into a tree.

The slots of a block are predicted jointly but independently of each other's drafted tokens (the mask slots
do not see the drafts, only the mask), so a node's token depends only on (depth, rank), as with Medusa's
heads: the Medusa-style static trees of eval/engine/tree.py apply unchanged (`StaticTree.fill`). The default
is the chain of each slot's top-1, γ-1 drafts: what vLLM runs with method dflash (extra.num_speculative_tokens
drafts a shorter chain). A tree (`tree=tree16`, a
searched one stored in the export, or `tree_choices`) spends more verification on the early, likelier slots.

Own cache (model.py: DFlashCache): the context keys / values of every committed position, per layer. Each
propose() first appends the positions committed since the last call (state.new_aux: the base's aux states of
the accepted path, which is what vLLM re-reads after every verification), then runs one block against the
cache. Children are deterministic picks (top-k), so rejection sampling treats them as point masses and stays
lossless, as with the other top-k families. With a draft vocabulary the draft ids are mapped to base ids (d2t)
before they enter the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.engine.drafters.block import BlockDrafter
from eval.engine.drafters.drafter import DecodeState
from eval.engine.drafters.static import resolve_tree, static_num_speculative_tokens, static_shape, static_tune_shapes
from eval.engine.tree import StaticTree, Tree, chain_choices


class DFlashDrafter(BlockDrafter):
    name = "dflash"

    def __init__(self, draft, tree: StaticTree):
        """draft: models.families.dflash.model.DFlashDraft; tree: at most block_size - 1 deep."""
        if tree.depth > draft.block_size - 1:
            raise ValueError(f"the tree is {tree.depth} deep but a DFlash block of {draft.block_size} slots drafts "
                             f"{draft.block_size - 1} tokens; pick a shallower tree")
        super().__init__(draft)
        self.tree = tree
        self.max_nodes = tree.num_nodes

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        self._commit(state)
        if self.tree.depth == 0:
            return self.tree.fill(state.root, torch.zeros(0, 0, dtype=torch.long))
        logits = self.draft.draft_block(self._cache, state.root)  # [G-1, N]: slot k = depth k
        return self.tree.fill(state.root, self.picks(logits))

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """Block logits [..., G-1, N] (draft ids; row k-1 = depth k) -> the tree's picks [..., D, k] base ids: each
        depth's top-k in rank order, what StaticTree.fill lays out (also the field's batched path, per block)."""
        topk = logits[..., : self.tree.depth, :].topk(self.tree.topk, dim=-1).indices  # draft ids, rank order
        return self.draft.to_base(topk)


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """A chain of num_speculative_tokens top-1 drafts (None: the block's block_size - 1 mask slots, the family's
    natural count), unless a tree is named: the eval config's tree / tree_choices, or the export's stored tree."""

    num_speculative_tokens: int | None = None  # drafts per step; None = block_size - 1 (vLLM's dflash count)


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    """The chain of num_speculative_tokens top-1 drafts (default block_size - 1) unless the eval config names a
    tree (tree / tree_choices) or, when the config sets no chain either, the export stores one (`specdraft
    tree-search`)."""
    n = options.num_speculative_tokens
    named_tree = bool(eval_cfg.tree_choices) or eval_cfg.tree != "auto"
    if named_tree and n is not None:
        raise ValueError("DFlash drafts a tree or a chain: give tree / tree_choices or extra.num_speculative_tokens, "
                         "not both")
    if named_tree or (n is None and export_cfg.get("tree") is not None):
        name, tree = resolve_tree(export_cfg, eval_cfg)
        return DFlashDrafter(draft, tree), {"tree": name, "tree_nodes": tree.num_nodes, "block_size": draft.block_size}
    n = max_speculative_tokens(draft) if n is None else int(n)
    if not 1 <= n <= max_speculative_tokens(draft):
        raise ValueError(f"num_speculative_tokens={n}: a DFlash block of {draft.block_size} slots drafts "
                         f"1..{draft.block_size - 1} (leave it unset for all {draft.block_size - 1})")
    tree = StaticTree(chain_choices(n))
    return DFlashDrafter(draft, tree), {"tree": f"chain{n}", "tree_nodes": tree.num_nodes,
                                        "block_size": draft.block_size, "num_speculative_tokens": n}


def chain(depth: int) -> dict:
    return {"tree": "auto", "tree_choices": None, "extra": {"num_speculative_tokens": depth}}


num_speculative_tokens, shape = static_num_speculative_tokens, static_shape
tune_shapes = static_tune_shapes


def max_speculative_tokens(draft) -> int:
    """One block drafts its γ - 1 mask slots: no chain is deeper."""
    return int(draft.block_size) - 1
