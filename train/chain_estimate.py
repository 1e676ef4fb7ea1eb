"""A teacher-forced acceptance-length estimate that follows the decoder's chain, step by step.

The old estimate (models/draft.py: estimated_acceptance_length) multiplies per-depth top-1 accuracies averaged over
every position: 1 + sum_k prod_{j<=k} a_j. Decoding does not visit every position alike. A greedy chain step at root
r accepts the leading run of right depths L_r and the next step starts at r + 1 + L_r, so the steps land right after
a rejection, on the token the draft just failed to guess: harder positions than the average. On EAGLE-3 that made
the product estimate 0.18-0.40 higher than the decoded chain (docs/lab/results.md, "Teacher-forced estimate vs
decoded acceptance").

Here the estimate is the decoder's own walk, replayed on a text the base wrote itself (teacher forced):

1. per root r and depth k, whether the draft's top-1 is the text's token x_{r+1+k}, read from the family's own
   `loss` (DepthStats.top1), so every family that scores depth k at root r causally is measured the same way;
2. the run L_r = leading right depths of root r;
3. the walk r_0 = P - 1 (the prompt's last position), r_{i+1} = r_i + 1 + L_{r_i}, each step yielding
   1 + L_r tokens: AL = tokens after the prefill's one / steps, as the decoder's report counts it.

On the base's own greedy text this is what greedy chain decoding does, up to rounding between the training
forward and the decoder's. Per-root correctness comes from differences of the loss's top-1 counts over cuts of the
text (`root_runs`): one loss call per answer token, each scoring a window of about K^2 / 2 labels (cheap next to
decoding; the base forward runs once per text).
"""

from __future__ import annotations

import dataclasses

import torch

from models.base import draft_inputs
from models.draft import DraftBatch, estimated_acceptance_length
from models.registry import chain_estimate_families

# Families whose loss scores depth k at root t from positions <= t + k only and without randomness, so a
# truncated text gives the same per-root answers (DFlash samples its block anchors; CTC reports prefix accuracy
# of a collapsed draft: neither can be differenced this way). tests/test_chain_estimate.py checks Medusa and EAGLE-3
# against the decoder; Hydra and ReDrafter declare it by the same causal reading of their losses, untested here.
CHAIN_FAMILIES = chain_estimate_families()  # those declaring FamilyFacts.chain_estimate


@torch.no_grad()
def root_runs(draft, base_model, view, ids: list[int], prompt_len: int, loss_cfg, device,
              dtype) -> tuple[list[int], list[tuple[int, int]], int]:
    """(L_r for every root r in [prompt_len - 1, len(ids) - 2]: how many leading depths 1..K the draft's top-1 gets
    right, teacher forced on `ids`; per depth (top-1 hits, scored roots) over the whole text; how many differences
    fell outside {0, 1}, 0 when the replay is exact). ids: prompt + answer
    token ids (one text, no padding).

    The text cut to L tokens with the loss mask on its last K + 2 answer positions only (a window, so each call
    scores about K^2 / 2 labels, not the whole text) scores depth k at roots lo(L) .. L - 2 - k, lo(L) =
    max(P, L - K - 2) - 1 (data/targets.py: a label needs the mask on t+1 .. t+1+k). Every root but the newest was
    resolved at a shorter L, so the newest's hit is that call's count minus theirs.
    """
    T = len(ids)
    K = int(draft.num_heads)
    x = torch.tensor([ids], device=device)  # [1, T]
    hidden, aux = draft_inputs(base_model, x, torch.ones_like(x), getattr(draft, "aux_layers", None))
    hidden = hidden.to(dtype)  # [1, T, d]
    aux = aux.to(dtype) if aux is not None else None  # [1, T, k*d]
    # No teacher term: top-1 is the student's argmax either way, and the base's [rows, V] logits would dominate.
    loss_cfg = dataclasses.replace(loss_cfg, teacher_weight=0.0)
    right: dict[tuple[int, int], int] = {}  # (root, depth 1..K) -> 1 if the draft's top-1 is the text's token
    inconsistent = [0]
    for L in range(prompt_len + 2, T + 1):  # L = P + 2: the first cut with a label (root P - 1, depth 1)
        start = max(prompt_len, L - K - 2)
        mask = torch.zeros_like(x[:, :L])
        mask[:, start:] = 1
        out = draft.loss(DraftBatch(hidden[:, :L], x[:, :L], mask, aux[:, :L] if aux is not None else None),
                         view, loss_cfg)
        for j, stats in enumerate(out.per_depth):  # depth k = j + 1, label x_{t+1+k}: newest root L - 2 - k
            k = j + 1
            root = L - 2 - k
            if root < prompt_len - 1:
                continue
            known = sum(right[(t, k)] for t in range(start - 1, root))
            hit = int(stats.top1) - known
            # Outside {0, 1} only if a shorter cut changed an earlier root's answer (rounding that depends on the
            # cut's shape, or a loss that is not causal): counted, and kept in {0, 1}, never a crash mid-training.
            if hit not in (0, 1):
                inconsistent[0] += 1
            right[(root, k)] = min(max(hit, 0), 1)
    runs = []
    for r in range(prompt_len - 1, T - 1):
        n = 0
        while n < K and right.get((r, n + 1), 0) == 1:
            n += 1
        runs.append(n)
    marginal = []
    for k in range(1, K + 1):  # every root with a depth-k label in the answer
        hits = [right[(r, k)] for r in range(prompt_len - 1, T - 1 - k)]
        marginal.append((sum(hits), len(hits)))
    return runs, marginal, inconsistent[0]


def walk(runs: list[int], answer_len: int) -> tuple[int, int]:
    """(tokens, steps) of greedy chain decoding over an answer of `answer_len` tokens, given L_r per root
    (runs[0] = the prompt's last position). The prefill's token (the answer's first) is not a step's."""
    tokens = steps = 0
    i = 0  # root = prompt_len - 1 + i; the answer's token x_{root+1} is known (prefill's or the last bonus)
    while i + 1 < answer_len:
        left = answer_len - 1 - (i + 1)  # answer tokens after x_{root+1}, less the step's own bonus token
        take = min(runs[i], left) + 1
        tokens += take
        steps += 1
        i += take
    return tokens, steps


def chain_estimates(draft, base_model, view, texts: list[tuple[list[int], int]], loss_cfg, device,
                    dtype) -> dict:
    """Estimates over `texts` = [(prompt + answer ids, prompt length)], each summed over texts the way the
    decoder's report sums: `est_accept_len_chain` (the walk above), `est_accept_len_product` (the old product of
    per-depth accuracies, over every root of the same texts) and `est_accept_len_joint` (1 + the mean leading
    run over every root: the chain's joint acceptance without the walk's choice of roots)."""
    was_training = draft.training
    draft.eval()
    tokens = steps = 0
    all_runs: list[int] = []
    inconsistent = 0
    hits: list[list[int]] = []  # per depth: [top-1 hits, scored roots]
    try:
        for ids, prompt_len in texts:
            answer_len = len(ids) - prompt_len
            if answer_len < 2:
                continue
            runs, marginal, bad = root_runs(draft, base_model, view, ids, prompt_len, loss_cfg, device, dtype)
            inconsistent += bad
            t, s = walk(runs, answer_len)
            tokens, steps = tokens + t, steps + s
            all_runs += runs
            hits += [[0, 0] for _ in range(len(marginal) - len(hits))]
            for acc, (h, n) in zip(hits, marginal):
                acc[0], acc[1] = acc[0] + h, acc[1] + n
    finally:
        draft.train(was_training)
    if not steps:
        return {}
    product = estimated_acceptance_length([h / max(n, 1) for h, n in hits], getattr(draft, "prefix_accuracy", False))
    return {"est_accept_len_chain": tokens / steps, "est_accept_len_product": product,
            "est_accept_len_joint": 1.0 + sum(all_runs) / max(len(all_runs), 1), "texts": len(texts),
            "roots": len(all_runs), "inconsistent_roots": inconsistent}
