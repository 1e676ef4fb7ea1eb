"""Lockstep simulation of a Hydra / Hydra++ draft on the stored answers: the field benchmark's batched path
(eval/field/simulation.py; docs/howto/evaluate.md, "The field benchmark").

Why: the per-prompt simulation (field.simulate: the unchanged decoder loop against a ReplayBackend) pays the draft's
cost one prompt at a time, and for Hydra that cost is a few-row matrix product per depth (the heads' input block,
ResBlocks and above all each head's LM head over the draft vocabulary), bound by memory bandwidth: the weights are
read once per call whatever its rows. Every prompt's next step is independent of every other prompt's, so here B
prompts advance together: per lockstep step head k runs ONCE over the depth-(k-1) rows of every active prompt (a
matrix product that reads its weights once for all of them). Only Hydra++'s prefix layer stays per prompt (each prompt
has its own prefix KV cache, of its own length). A prompt that ends hands its slot to the next one.

What it reproduces, per prompt and step (field.simulate's GenerationResult, i.e. eval/engine/decoder.py's
speculative_generate with drafter.py's HydraDrafter.propose against the ReplayBackend):
  context  z_t: the base's h_t, or (Hydra++) the prefix layer's output after the rows committed since the last step
           are appended to the prompt's prefix cache: the drafter's own context_step, per prompt
  draft    the static tree (chain or tree), level by level: the drafter's own fill_trees, which propose runs with
           one prompt, here with every active prompt's rows
  verify   the ReplayBackend's lookup + greedy_accept: the deepest node on the stored path (the smallest index among
           equals) ends the accepted path, the bonus is the stored token after it (static.verify_and_book)
  book     speculative_generate's: accepted lengths before end-of-turn / length truncation, accept / proposed counts
           per depth, tree nodes (root counted), tokens cut after end-of-turn or at max_new_tokens

Not bitwise by construction: a row of a B·P-row product and the same row of the P-row product may differ in the last
bits (MKL's kernels sum in different orders), so a near tie between two candidates could order them otherwise. A
static tree's node is the rank-r pick of its parent's row, so every comparison among the ranks a row's children take,
and the one after the last of them, decides a token: where two such logits lie within static.TIE_EPS (near_ties),
the prompt is handed to the exact path (`redo`: one prompt at a time through the decoder loop) from the start. The
agreement with the exact path stays a measured property (tests/test_field_lockstep_static.py on the tiny base, and
every batched run's own sample: eval/field/simulation.py, measure_agreement).
"""

from __future__ import annotations

import torch

from eval.engine.drafters.static import StaticSlot, static_lockstep


def draft_step(drafter, slots: list[StaticSlot]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's trees of every slot: each prompt's z_t from its new rows (HydraDrafter.context_step, the prefix
    cache kept in slot.context), then HydraDrafter.fill_trees over all of them. Returns (tokens [B, N] base ids,
    near ties [B] bool)."""
    zs = []
    for s in slots:
        s.context, z = drafter.context_step(s.context, s.new_rows())
        zs.append(z)
    roots = torch.tensor([s.root for s in slots], dtype=torch.long, device=drafter._device)
    tokens, near = drafter.fill_trees(torch.stack(zs), roots, ties=True)
    return tokens.cpu(), near.cpu()


# The declaration eval/engine/drafters/registry.py reads: the shared static-tree loop with this drafting step.
run_lockstep = static_lockstep(draft_step)
