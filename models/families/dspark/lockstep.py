"""DSpark's batched field path (eval/field/simulation.py; docs/howto/evaluate.md, "The field benchmark"): every active
prompt's block in one forward and the Markov walk over all of them at once (DSparkDraft.draft_chains;
eval/engine/drafters/block_lockstep.py, why and what is exact), each chain cut as DSparkDrafter.propose cuts it."""

from __future__ import annotations

import torch

from eval.engine.drafters.block_lockstep import (
    block_contexts,
    block_roots,
    chain_ties,
    chain_tree_of,
    stored_drafts,
    stored_ties,
)
from eval.engine.drafters.static import TIE_EPS, StaticSlot, static_lockstep


def draft_step(drafter, slots: list[StaticSlot]) -> tuple[list[list[int]], torch.Tensor]:
    """One step's chains of every slot: DSparkDraft.draft_chains, then each chain's length by
    DSparkDrafter.kept_drafts (all num_speculative_tokens drafts, or fewer under a confidence cut). Returns (per
    slot [root, drafts...] base ids, near ties [B] bool)."""
    drafts, conf, logits = drafter.draft.draft_chains(block_contexts(drafter, slots), block_roots(drafter, slots),
                                                      drafter.num_speculative_tokens)  # [B, D], [B, D], [B, D, N]
    d = conf.shape[1]
    kept = torch.tensor([drafter.kept_drafts(c) for c in conf])  # [B]
    if drafter.confidence_cut <= 0:  # fixed length: only ties the stored token is in can change the booking
        near = stored_ties(logits, stored_drafts(drafter, slots, d), torch.ones(d, dtype=torch.long)).cpu()
    else:  # the length reads the confidences, which read every kept draft: any tie among them, and the cut itself
        near = chain_ties(logits, kept).cpu()
        close = (torch.cumprod(conf.float(), dim=1) - drafter.confidence_cut).abs().cpu() < TIE_EPS  # [B, D]
        # the products that decided the length: those of the kept drafts and the first one below τ
        near |= (close & (torch.arange(d)[None] <= kept[:, None])).any(dim=1)
    rows = drafts.cpu().tolist()
    return [[s.root] + row[:n] for s, row, n in zip(slots, rows, kept.tolist())], near


# The declaration eval/engine/drafters/registry.py reads: the shared static-tree loop with this drafting step, each
# slot's chain as long as its cut left it.
run_lockstep = static_lockstep(draft_step, tree_of=chain_tree_of)
