"""Domino's batched field path (eval/field/simulation.py; docs/howto/evaluate.md, "The field benchmark"): every active
prompt's block in one forward and the GRU's walk over all of them at once (DominoDraft.draft_chains;
eval/engine/drafters/block_lockstep.py, why and what is exact): chains of num_speculative_tokens drafts, as
DominoDrafter.propose drafts them."""

from __future__ import annotations

import torch

from eval.engine.drafters.block_lockstep import block_contexts, block_roots, chain_tree_of, stored_drafts, stored_ties
from eval.engine.drafters.static import StaticSlot, static_lockstep


def draft_step(drafter, slots: list[StaticSlot]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's chains of every slot (DominoDraft.draft_chains). Returns (tokens [B, 1 + D] base ids, root first;
    near ties [B] bool: a depth's stored token within TIE_EPS of another corrected logit at the top of its row:
    block_lockstep.stored_ties)."""
    drafts, logits = drafter.draft.draft_chains(block_contexts(drafter, slots), block_roots(drafter, slots),
                                                drafter.num_speculative_tokens)  # [B, D], [B, D, N]
    d = drafts.shape[1]
    near = stored_ties(logits, stored_drafts(drafter, slots, d), torch.ones(d, dtype=torch.long))
    roots = torch.tensor([[s.root] for s in slots])
    return torch.cat([roots, drafts.cpu()], dim=1), near.cpu()


# The declaration eval/engine/drafters/registry.py reads: the shared static-tree loop with this drafting step.
run_lockstep = static_lockstep(draft_step, tree_of=chain_tree_of)
