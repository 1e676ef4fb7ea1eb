"""Lockstep simulation of a Medusa draft on the stored answers: the field benchmark's batched path
(eval/field/simulation.py; docs/howto/evaluate.md, "The field benchmark").

Why: the per-prompt simulation (field.simulate: the unchanged decoder loop against a ReplayBackend) pays the draft's
cost one prompt at a time, and for Medusa that cost is one-row matrix-vector products (each head's ResBlocks and LM
head over the draft vocabulary), bound by memory bandwidth: the weights are read once per row. Every prompt's next
step is independent of every other prompt's, so here B prompts advance together: per lockstep step the heads run
ONCE over the h_t of every active prompt (a matrix product that reads the weights once for all of them). A prompt
that ends hands its slot to the next one.

What it reproduces, per prompt and step (field.simulate's GenerationResult, i.e. eval/engine/decoder.py's
speculative_generate with drafter.py's MedusaDrafter.propose against the ReplayBackend):
  draft    every head's top-k at h_t (the drafter's own topk_rows, which propose runs with one prompt, here with
           every active prompt's row), laid into the static tree by StaticTree.fill, as propose does
  verify   the ReplayBackend's lookup + greedy_accept: the deepest node on the stored path (the smallest index among
           equals) ends the accepted path, the bonus is the stored token after it (static.verify_and_book)
  book     speculative_generate's: accepted lengths before end-of-turn / length truncation, accept / proposed counts
           per depth, tree nodes (root counted), tokens cut after end-of-turn or at max_new_tokens

Not bitwise by construction: a row of a B-row product and the 1-row product may differ in the last bits (MKL's
kernels sum in different orders), so a near tie between two candidates could order them otherwise. A static tree's
depth-k node is head k's rank-r pick, so every comparison among the ranks depth k takes, and the one after the last
of them, decides a token: where two such logits lie within static.TIE_EPS (near_ties), the prompt is handed to the
exact path (`redo`: one prompt at a time through the decoder loop) from the start. The agreement with the exact path
stays a measured property (tests/test_field_lockstep_static.py on the tiny base, and every batched run's own sample:
eval/field/simulation.py, measure_agreement).
"""

from __future__ import annotations

import torch

from eval.engine.drafters.static import StaticSlot, static_lockstep
from models.vocab_map import to_base_ids


def draft_step(drafter, slots: list[StaticSlot]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's trees of every slot: MedusaDrafter.topk_rows over each prompt's h_t (the last of its new rows),
    each prompt's picks laid into the tree by StaticTree.fill. Returns (tokens [B, N] base ids, near ties [B])."""
    tree = drafter.tree
    h = torch.stack([s.new_rows()[-1] for s in slots])  # [B, d]
    if tree.depth == 0:
        return torch.tensor([[s.root] for s in slots]), torch.zeros(len(slots), dtype=torch.bool)
    topk, near = drafter.topk_rows(h, ties=True)
    picks = to_base_ids(topk, getattr(drafter.heads, "d2t", None))  # [B, D, k] base ids
    return torch.stack([tree.fill(s.root, p).tokens for s, p in zip(slots, picks)]), near.cpu()


# The declaration eval/engine/drafters/registry.py reads: the shared static-tree loop with this drafting step.
run_lockstep = static_lockstep(draft_step)
