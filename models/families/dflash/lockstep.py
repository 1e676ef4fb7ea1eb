"""DFlash's batched field path (eval/field/simulation.py; docs/howto/evaluate.md, "The field benchmark"): every active
prompt's block in one forward (eval/engine/drafters/block_lockstep.py, why and what is exact), each block's picks
laid into the drafter's static tree (chain or tree) as DFlashDrafter.propose lays them."""

from __future__ import annotations

import torch

from eval.engine.drafters.block_lockstep import block_contexts, block_roots, stored_drafts, stored_ties
from eval.engine.drafters.static import StaticSlot, depth_widths, static_lockstep


def draft_step(drafter, slots: list[StaticSlot]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's trees of every slot: the blocks' logits (BlockDraft.draft_blocks), each depth's top-k
    (DFlashDrafter.picks), StaticTree.fill. Returns (tokens [B, nodes] base ids, near ties [B] bool: a depth's stored
    token within TIE_EPS of another logit, among the ranks the tree takes from its row: block_lockstep.stored_ties)."""
    tree = drafter.tree
    if tree.depth == 0:
        return torch.tensor([[s.root] for s in slots]), torch.zeros(len(slots), dtype=torch.bool)
    logits = drafter.draft.draft_blocks(block_contexts(drafter, slots), block_roots(drafter, slots))  # [B, K, N]
    near = stored_ties(logits[:, : tree.depth], stored_drafts(drafter, slots, tree.depth), depth_widths(tree))
    picks = drafter.picks(logits).cpu()  # [B, D, k] base ids
    return torch.stack([tree.fill(s.root, p).tokens for s, p in zip(slots, picks)]), near.cpu()


# The declaration eval/engine/drafters/registry.py reads: the shared static-tree loop with this drafting step.
run_lockstep = static_lockstep(draft_step)
