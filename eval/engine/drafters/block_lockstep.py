"""The field benchmark's batched path for the block families (DFlash, DSpark, Domino: models/block_draft.py's
BlockDraft; their models/families/<name>/lockstep.py), on the static-tree families' loop
(eval/engine/drafters/static.py: run_static_lockstep, verify_and_book, near_ties).

Why a block's proposal needs no decoding history: under greedy verification against the stored answer every
committed token is a stored one, so a step whose drafter has seen positions 0..L-1 has the stored sequence's first L
tokens committed and the root seq[L], whatever steps led there. A block drafter's context cache then holds the
context keys / values of positions 0..L-1, and each row is a function of its own position's aux states alone
(hidden_norm(fc(aux)), k_proj / v_proj, k_norm, RoPE at that position); the block [root, M, ..., M] reads that
context and the root, and DSpark's Markov walk and Domino's GRU walk read the block's outputs and its own drafts.
So a prompt's context is computed ONCE, over every stored position in one forward (BlockDraft.commit_context over
the whole sequence, on the prompt's first step), and a step's block reads its first L rows (BlockCache.context).

What is batched: per lockstep step the blocks of every active prompt run in one forward
(BlockDraft.draft_blocks_outputs: the weight-heavy ops over all B·G rows, each block's attention against its own
context, as a block drafted alone attends), and DSpark's / Domino's walks step over the B blocks together
(draft_chains). The drafters' propose() runs the same functions with one block, so the two paths share one
implementation; the family's drafter turns logits into its tree (DFlashDrafter.picks) or cuts a chain
(DSparkDrafter.kept_drafts) in both. Verification and bookkeeping: static.verify_and_book (the ReplayBackend's
lookup, speculative_generate's counts and truncation).

Why the prompts' current blocks and not every position's at once: drafting each prompt's block at every position
(training's block_outputs with every position an anchor) would make the walk pure bookkeeping, but it drafts about
acceptance-length times more blocks than the walk visits, and a batched block costs the same either way (SmolLM2's
DFlash, 5 layers, block 8, 16k draft vocabulary, one EPYC core: 6.5-7 ms a block at 64-256 blocks a call, against
~22 ms for one block alone); B prompts stepped together fill the same matrix products with only the blocks decoding
drafts.

Not bitwise by construction: a row of a B·G-row product, and a context row computed among all of the prompt's rows
instead of among the rows one step committed, may differ from the exact path's in the last bits (MKL sums in other
orders), so a near tie could order two tokens otherwise. Verification compares each depth's drafts with the stored
token only, so the guard looks at that token (stored_ties): a prompt whose stored token lies within static.TIE_EPS
of another logit among the ranks its tree takes is handed to the exact path (`redo`); a tie between two tokens the
answer does not hold misses either way and stays batched. Where a chain's length reads its drafts (DSpark's
confidence cut) every tie among the kept drafts counts, and so does a product of confidences within TIE_EPS of the
cut (dspark/lockstep.py). The agreement stays a measured property (tests/test_field_lockstep_block.py, and every
batched run's own sample: eval/field/simulation.py, measure_agreement).

Shapes: B = active prompts, G = block slots, K = drafted slots, D = drafted depths used, N = draft vocabulary,
H_kv / hd = the draft's key-value heads / head size, L = committed positions a block sees.
"""

from __future__ import annotations

from functools import cache

import torch

from eval.engine.drafters.static import TIE_EPS, StaticSlot, near_ties
from eval.engine.tree import StaticTree, chain_choices


def block_contexts(drafter, slots: list[StaticSlot]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each slot's context for its next block: per layer (k, v) [1, H_kv, L, hd], L = slot.length. A slot's first
    step computes its prompt's whole context (every stored position's aux rows, slot.states [S, k·d], in one
    commit_context) and keeps it as slot.context (a BlockCache of S rows); the aux rows are dropped then (they are
    read once, and a wide batch of long prompts would hold them twice)."""
    draft = drafter.draft
    for s in slots:
        if s.context is None:
            aux = s.states.to(drafter._device, drafter._dtype)  # [S, k·d], as BlockDrafter._commit casts them
            s.context = draft.new_cache(aux.shape[0], drafter._device, drafter._dtype)
            draft.commit_context(s.context, aux)
            s.states = s.states.new_empty((0, s.states.shape[1]))
    return [s.context.context(s.length) for s in slots]


def block_roots(drafter, slots: list[StaticSlot]) -> torch.Tensor:
    """[B] long: each slot's root (the stored token after its committed positions), on the draft's device."""
    return torch.tensor([s.root for s in slots], dtype=torch.long, device=drafter._device)


def stored_drafts(drafter, slots: list[StaticSlot], depth: int) -> torch.Tensor:
    """[B, D] long: per slot the stored tokens a step's drafts of depths 1..D are verified against (seq[L + k]), as
    draft ids (-1: outside the draft vocabulary, or past the stored sequence, which verify_and_book refuses)."""
    rows = [[s.seq[s.length + k] if s.length + k < len(s.seq) else -1 for k in range(1, depth + 1)] for s in slots]
    stored = torch.tensor(rows, dtype=torch.long, device=drafter._device).view(len(slots), depth)
    t2d = drafter.draft.t2d
    if t2d is None:
        return stored
    return torch.where(stored >= 0, t2d.to(stored.device)[stored.clamp(min=0)], stored)


def stored_ties(logits: torch.Tensor, stored: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Near ties that can change what a step books. logits [B, D, N]: row k-1 gives depth k's drafts, its top
    widths[k-1] ranks (a chain: 1, its argmax); stored [B, D]: the stored token of each depth (draft ids, -1 none).

    Verification matches a depth's nodes against that depth's stored token only, so the booked result depends on the
    rows through the rank of the stored token alone (which nodes hold it, given the ranks the tree takes): an order
    among other tokens decides only which of them miss. Its rank can move only if another logit lies within
    static.TIE_EPS of its own, and it matters only if it or that one is among the ranks taken (its logit no more than
    TIE_EPS below the last rank taken). So a row is flagged when both hold; a tie between two tokens the answer does
    not hold stays batched. For a chain whose later rows read its earlier drafts (DSpark's Markov bias, Domino's
    GRU) it still suffices: the first draft that differs between the two paths is a tie the stored token is not in,
    so it misses on both, and the rows after it are never verified. Returns [B] bool."""
    b, d, n = logits.shape
    rows = logits.float()
    own = rows.gather(2, stored.clamp(min=0)[..., None])  # [B, D, 1] the stored token's logit
    crowded = ((rows - own).abs() < TIE_EPS).sum(dim=2) > 1  # [B, D]: another logit within TIE_EPS of it
    k = max(1, int(widths.max()))
    last = rows.topk(k, dim=2).values.gather(2, (widths.to(rows.device) - 1).clamp(min=0).expand(b, d)[..., None])
    taken = own[..., 0] >= last[..., 0] - TIE_EPS  # [B, D]: it or a token within TIE_EPS of it is among the ranks
    live = (stored >= 0) & (widths.to(rows.device) > 0)[None]
    return (crowded & taken & live).any(dim=1)


def chain_ties(logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """logits [B, D, N] of chains whose draft k is the argmax of row k, kept [B] long: the drafts each chain keeps
    -> [B] bool: a near tie (static.near_ties, top two) in a row whose argmax decides a kept draft (rows k < kept),
    whatever tokens tie: where a chain's length depends on its drafts (DSpark's confidence cut), a tie between two
    tokens the answer does not hold can still change it."""
    b, d, n = logits.shape
    rows = near_ties(logits.reshape(b * d, n), torch.ones(b * d, dtype=torch.long)).view(b, d)
    decides = torch.arange(d, device=rows.device)[None] < kept.to(rows.device)[:, None]  # [B, D]
    return (rows & decides).any(dim=1)


@cache
def chain_tree(depth: int) -> StaticTree:
    """The chain of `depth` drafts as a static tree (what the chain drafters fill)."""
    return StaticTree(chain_choices(depth))


def chain_tree_of(tokens: list[int]) -> StaticTree:
    """run_static_lockstep's tree_of for a chain family: the chain of a slot's drafted tokens (root first)."""
    return chain_tree(len(tokens) - 1)
