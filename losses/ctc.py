"""CTC loss for the CTC drafter (the CTC drafter paper §3.2, docs/families/ctc.md).

A start position t owns M frames, each a distribution over V+1 classes (class V = the blank). Its label
is y = (y_1..y_N), N <= M (the base's greedy tokens x_{t+2}..x_{t+1+N}). The CTC loss is
-log P(y) = -log sum_{a in B^-1(y)} prod_m p_m(a_m), where B collapses a frame sequence a (merge adjacent
repeats, then drop blanks); `torch.nn.functional.ctc_loss` computes it with the forward DP, in fp32.

Infeasible labels: two equal adjacent labels need a blank between them, so y fits in M frames only if
N + #{i : y_i == y_{i+1}} <= M (e.g. "a a a a" needs 7 frames). Such a label is CLAMPED to its longest
feasible prefix (`feasible_label_lengths`), so the start still teaches its first tokens instead of being
dropped (or silently zeroed by zero_infinity); `CTCStats.truncated` counts them.

Draft vocabulary (`max_lengths`): a label token outside the drafter's map cannot be a class, so the
caller truncates each label before its first out-of-map token and passes that length as `max_lengths`
[n] (>= 1; rows with none left are not passed at all). The CTC target becomes min(feasible, max_length)
tokens, the token term and the prefix statistics skip depths >= max_length (those are misses), and
label columns from max_length on may hold any real class (they are never read).

Optional token-level term (weight `token_weight`): frame j (j = 1..N) CE to label j. It anchors the
alignment "label j on frame j, spare frames at the end", which the greedy collapse then reads in order;
CTC alone has to discover an alignment from scratch, which is slow on a small CPU budget.
Per start: loss = ctc_nll + token_weight * mean_j CE_j.

Per-depth statistics (what the training loop logs as top1/top5 of "head" j):
- top1[j]: starts whose greedy collapse (argmax per frame, then B) begins with y_1..y_j (prefix accuracy:
  depth j correct with every earlier depth correct, which is what greedy verification accepts);
- topk[j]: starts for which SOME frame sequence with each frame's class in that frame's top-k collapses
  to a sequence beginning with y_1..y_j (what a full top-k candidate tree could accept);
- token_ce[j]: the frame-j CE above (logged as the loss of depth j; the CTC loss itself is one number).
Note the loop's est_accept_len multiplies per-depth accuracies as if they were conditional; with prefix
accuracies it underestimates (the exact greedy estimate is 1 + sum_j top1[j] / count).

`fused_linear_ctc` never holds more than `chunk_size` rows of [rows, V+1] logits: per chunk of starts
it computes the logits, gathers the log-probs of the 2N+1 CTC states (+ the N token-term columns), runs
its own log-space DP there (`ctc_nll_extended`, a tiny autograd graph), and turns the gathered gradient
into dLoss/dlogits = scatter(G) - softmax * sum(G) in the logits' own buffer; then the frame and
projection grads are contracted and the chunk's buffers die. Only [n, M, d] frame grads and the
trainable projection's grad are stashed; backward scales them. `linear_ctc_reference` is the
plain-autograd twin on torch's ctc_loss; `ctc_loss_bruteforce` enumerates every alignment (tiny
vocabularies only) to check the DP itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


class CTCStats(NamedTuple):
    """No-grad counters of one call; tensors (no host sync)."""

    count: torch.Tensor  # 0-dim long: starts (rows of labels)
    truncated: torch.Tensor  # 0-dim long: starts whose label was clamped to a feasible prefix
    token_ce: torch.Tensor  # [N] fp32: sum over starts of -log p_j(y_j) (frame j vs label j)
    top1: torch.Tensor  # [N] long: starts whose greedy collapse begins with y_1..y_j
    topk: torch.Tensor  # [N] long: starts where some top-k frame path collapses to a prefix y_1..y_j


# ---------------------------------------------------------------------------------------------------
# Collapse, feasibility, prefix reachability
# ---------------------------------------------------------------------------------------------------


def collapse_reference(frames: Sequence[int], blank: int) -> list[int]:
    """The CTC map B on one frame sequence: merge adjacent repeats, then drop blanks (plain Python).
    A token repeated with a blank between ("a _ a") survives twice."""
    out, prev = [], None
    for a in frames:
        if a != blank and a != prev:
            out.append(int(a))
        prev = a
    return out


def feasible_label_lengths(labels: torch.Tensor, num_frames: int) -> torch.Tensor:
    """labels [n, N] long -> [n] long: the longest prefix length L whose CTC alignment fits in num_frames,
    i.e. L + #{i < L-1 : y_i == y_{i+1}} <= num_frames (a repeat needs a blank in between)."""
    n, length = labels.shape
    repeats = torch.zeros(n, length, dtype=torch.long, device=labels.device)  # repeats[:, L-1] = within y[:L]
    if length > 1:
        repeats[:, 1:] = (labels[:, 1:] == labels[:, :-1]).long().cumsum(1)
    need = torch.arange(1, length + 1, device=labels.device) + repeats  # [n, N], nondecreasing in L
    return (need <= num_frames).sum(1)


def extended_labels(labels: torch.Tensor, blank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [n, N] -> (ext [n, S], skip_ok [n, S] bool), S = 2N+1: ext = (blank, y_1, blank, ..., y_N,
    blank), the CTC state sequence; skip_ok[s] = the DP may jump s-2 -> s (s is a label that differs from
    the previous label; equal neighbours need the blank between them)."""
    n, length = labels.shape
    s = 2 * length + 1
    ext = torch.full((n, s), blank, dtype=torch.long, device=labels.device)
    ext[:, 1::2] = labels
    skip_ok = torch.zeros(n, s, dtype=torch.bool, device=labels.device)
    skip_ok[:, 3::2] = labels[:, 1:] != labels[:, :-1]
    return ext, skip_ok


def prefix_hits(cands: torch.Tensor, labels: torch.Tensor, blank: int) -> torch.Tensor:
    """Which label prefixes some frame path can produce.

    cands [n, M, k] long: the allowed classes of each frame (e.g. its top-k); labels [n, N] long.
    Returns [n, N] bool: [i, j-1] = some a with a_m in cands[i, m] for every m has a collapse B(a) that
    begins with labels[i, :j]. With k = 1 that is "the greedy collapse begins with y_1..y_j".

    Boolean CTC forward over the extended label (blank, y_1, blank, ..., y_N, blank) = S = 2N+1 states:
    alpha[s] = frames 0..m can be aligned to ext[:s+1] ending in state s. A prefix y_1..y_j is produced as
    soon as some frame ends in state 2j-1 (on y_j) or 2j (the blank after it): later frames may emit
    anything, a collapse of a longer sequence keeps the prefix.
    """
    n, num_frames, _ = cands.shape
    ext, skip_ok = extended_labels(labels, blank)  # [n, S]
    member = (cands[:, :, :, None] == ext[:, None, None, :]).any(2)  # [n, M, S]
    alpha = torch.zeros_like(skip_ok)
    alpha[:, :2] = member[:, 0, :2]
    reached = alpha.clone()
    for m in range(1, num_frames):
        prev1 = F.pad(alpha[:, :-1], (1, 0))
        prev2 = F.pad(alpha[:, :-2], (2, 0)) & skip_ok
        alpha = member[:, m] & (alpha | prev1 | prev2)
        reached |= alpha
    return reached[:, 1::2] | reached[:, 2::2]  # [n, N]: on y_j or on the blank after it


# ---------------------------------------------------------------------------------------------------
# The loss on materialized logits, and its brute-force twin
# ---------------------------------------------------------------------------------------------------


def _check(logits: torch.Tensor, labels: torch.Tensor, blank: int) -> None:
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[0] != labels.shape[0]:
        raise ValueError(f"expected logits [n, M, V+1] and labels [n, N], got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}; select the valid starts first (one row each)")
    if labels.shape[1] > logits.shape[1]:
        raise ValueError(f"label length N={labels.shape[1]} exceeds the {logits.shape[1]} frames; CTC needs "
                         "N <= M (set draft.num_heads <= draft.ctc.num_frames)")
    if not 0 <= blank < logits.shape[2]:
        raise ValueError(f"blank={blank} is not a class of logits with {logits.shape[2]} classes; the "
                         "drafter's blank is the extra last class V")
    _check_label_values(labels, logits.shape[2], blank)


def _check_label_values(labels: torch.Tensor, classes: int, blank: int) -> None:
    # torch's ctc_loss silently returns garbage for a blank or out-of-range target: fail loudly instead.
    if labels.numel() and bool(((labels == blank) | (labels < 0) | (labels >= classes)).any()):
        raise ValueError(f"labels must be real token ids in [0, {classes}) other than the blank {blank}; "
                         "select valid starts before calling (no -100 rows)")


def ctc_draft_loss(logits: torch.Tensor, labels: torch.Tensor, blank: int,
                   target_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed CTC negative log-likelihood, fp32.

    logits [n, M, V+1] (any float dtype; log_softmax in fp32, fp64 stays fp64); labels [n, N] long, real
    tokens only; blank: the blank class index; target_lengths [n] long (default: each label clamped to
    its longest feasible prefix, see `feasible_label_lengths`).
    Returns (loss_sum 0-dim, count 0-dim long = n). loss_sum is differentiable w.r.t. logits.
    """
    _check(logits, labels, blank)
    n, num_frames, _ = logits.shape
    if target_lengths is None:
        target_lengths = feasible_label_lengths(labels, num_frames)
    count = torch.tensor(n, dtype=torch.long, device=logits.device)
    log_probs = torch.log_softmax(logits.to(_compute_dtype(logits)), dim=-1)
    return _ctc_nll_sum(log_probs, labels, target_lengths, blank), count


def _ctc_nll_sum(log_probs: torch.Tensor, labels: torch.Tensor, target_lengths: torch.Tensor,
                 blank: int) -> torch.Tensor:
    """log_probs [n, M, C] (normalized), labels [n, N], target_lengths [n] -> sum of -log P(y_:L)."""
    n, num_frames, _ = log_probs.shape
    if n == 0:
        return log_probs.sum() * 0.0
    input_lengths = torch.full((n,), num_frames, dtype=torch.long, device=log_probs.device)
    # zero_infinity only guards against -inf log-probs; clamped targets are always feasible.
    return F.ctc_loss(log_probs.transpose(0, 1), labels, input_lengths, target_lengths, blank=blank,
                      reduction="sum", zero_infinity=True)  # ctc_loss wants time-major [M, n, C]


def ctc_nll_extended(lp_ext: torch.Tensor, skip_ok: torch.Tensor, target_lengths: torch.Tensor) -> torch.Tensor:
    """CTC negative log-likelihood from the log-probs of the extended label's states only.

    lp_ext [n, M, S] = log p_m(ext[s]) (normalized over ALL V+1 classes, then gathered at
    `extended_labels`); skip_ok [n, S]; target_lengths [n] in 1..N. Returns nll [n], differentiable.
    The forward (alpha) recursion in log space, vectorized over rows; M steps of [n, S] ops. Only these
    S = 2N+1 columns matter to the loss, so the fused path never runs a DP over the V+1 classes.
    """
    n, num_frames, s = lp_ext.shape
    neg = torch.finfo(lp_ext.dtype).min / 4  # "log 0" that keeps logsumexp and its gradient finite
    pad = lp_ext.new_full((n, 2), neg)
    skip_mask = torch.zeros_like(lp_ext[:, 0]).masked_fill(~skip_ok, neg)  # [n, S]: 0 where a skip is allowed
    alpha = torch.full_like(lp_ext[:, 0], neg)
    alpha = torch.cat([lp_ext[:, 0, :2], alpha[:, 2:]], dim=1)  # start on the first blank or on y_1
    for m in range(1, num_frames):
        shifted = torch.cat([pad, alpha], dim=1)  # [n, S+2]: shifted[:, s+2] = alpha[s]
        stay, step, skip = alpha, shifted[:, 1:-1], shifted[:, :-2] + skip_mask
        alpha = lp_ext[:, m] + torch.logsumexp(torch.stack([stay, step, skip]), dim=0)
    # End on y_L (state 2L-1) or on the blank after it (2L).
    ends = torch.stack([2 * target_lengths - 1, 2 * target_lengths], dim=1)  # [n, 2]
    return -torch.logsumexp(alpha.gather(1, ends), dim=1)


def ctc_loss_bruteforce(logits: torch.Tensor, labels: torch.Tensor, blank: int,
                        target_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Slow twin of `ctc_draft_loss`: enumerate all (V+1)^M frame sequences, keep those collapsing to the
    label, logsumexp their scores. Tiny class counts only (C^M sequences). Returns loss_sum (0-dim)."""
    n, num_frames, classes = logits.shape
    if classes**num_frames > 200_000:
        raise ValueError(f"{classes}^{num_frames} alignments is too many to enumerate; use a tiny vocabulary")
    if target_lengths is None:
        target_lengths = feasible_label_lengths(labels, num_frames)
    log_probs = torch.log_softmax(logits.double(), dim=-1)  # [n, M, C]
    total = logits.new_zeros((), dtype=torch.float64)
    for i in range(n):
        want = labels[i, : int(target_lengths[i])].tolist()
        scores = [sum(log_probs[i, m, a] for m, a in enumerate(seq))
                  for seq in itertools.product(range(classes), repeat=num_frames)
                  if collapse_reference(seq, blank) == want]
        total = total - (torch.logsumexp(torch.stack(scores), 0) if scores else math.inf)
    return total


def _depth_mask(labels: torch.Tensor, max_lengths: torch.Tensor | None) -> torch.Tensor | None:
    """[n, N] bool: depth j is scored (j < max_lengths[i]); None = every depth (no draft vocabulary)."""
    if max_lengths is None:
        return None
    return torch.arange(labels.shape[1], device=labels.device)[None, :] < max_lengths[:, None]


def _token_ce(log_probs: torch.Tensor, labels: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """log_probs [n, M, C] fp32, labels [n, N] -> [N]: sum over rows of -log p_j(y_j) for frames j < N
    (only the scored [n, N] entries when given)."""
    length = labels.shape[1]
    ce = -log_probs[:, :length].gather(2, labels[:, :, None]).squeeze(2)  # [n, N]
    return (ce if scored is None else ce * scored).sum(0)


def _stats_from_log_probs(log_probs: torch.Tensor, labels: torch.Tensor, blank: int, topk: int,
                          scored: torch.Tensor | None = None):
    """(token_ce [N], top1 [N], topk [N]) from log_probs [n, M, C]; no grad."""
    with torch.no_grad():
        k = min(topk, log_probs.shape[2])
        cands = log_probs.topk(k, dim=-1).indices  # [n, M, k], best first
        top1, topk_hits = prefix_hits(cands[:, :, :1], labels, blank), prefix_hits(cands, labels, blank)
        if scored is not None:  # depths past an out-of-map label are misses
            top1, topk_hits = top1 & scored, topk_hits & scored
        return _token_ce(log_probs, labels, scored).detach(), top1.sum(0), topk_hits.sum(0)


# ---------------------------------------------------------------------------------------------------
# Linear -> CTC: reference (materializes [n, M, V+1]) and the chunked fused fast path
# ---------------------------------------------------------------------------------------------------


def _as_blocks(weight) -> list[torch.Tensor]:
    return list(weight) if isinstance(weight, (list, tuple)) else [weight]


def _check_linear(frames, blocks, labels, blank, chunk_size, token_weight, topk) -> None:
    if frames.dim() != 3 or not blocks or any(b.dim() != 2 or b.shape[1] != frames.shape[2] for b in blocks):
        raise ValueError(f"expected frames [n, M, d] and weight [V+1, d] (or row blocks [r_i, d]) with the same "
                         f"d, got {tuple(frames.shape)} and {[tuple(b.shape) for b in blocks]}")
    if labels.dim() != 2 or labels.shape[0] != frames.shape[0] or labels.dtype != torch.long:
        raise ValueError(f"labels must be int64 [n={frames.shape[0]}, N], got {labels.dtype} {tuple(labels.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (rows of [rows, V+1] logits), got {chunk_size!r}")
    if token_weight < 0:
        raise ValueError(f"token_weight must be >= 0, got {token_weight}; 0 = CTC only")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    classes = sum(b.shape[0] for b in blocks)
    if not 0 <= blank < classes:
        raise ValueError(f"blank={blank} is not a row of the [{classes}, d] projection; the drafter's blank is "
                         "the extra last class V")
    if labels.shape[1] > frames.shape[1]:
        raise ValueError(f"label length N={labels.shape[1]} exceeds the {frames.shape[1]} frames; CTC needs "
                         "N <= M (set draft.num_heads <= draft.ctc.num_frames)")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    # Projection matmuls in the frames' dtype (bf16 units on bf16 runs); softmax / DP in fp32.
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else _compute_dtype(x)


def _chunk_loss(x, blocks, labels, lengths, blank, token_weight, scored=None):
    """x [c, M, d], blocks of rows [r_i, d] (matmul dtype; together [V+1, d]) ->
    (loss_sum, log_probs [c, M, V+1] in compute dtype). scored [c, N] bool or None: token-term depths."""
    classes = sum(b.shape[0] for b in blocks)
    _check_label_values(labels, classes, blank)
    # One matmul per block: a frozen block (the shared base lm_head) then gets no weight-gradient matmul.
    logits = torch.cat([x @ b.T for b in blocks], dim=-1) if len(blocks) > 1 else x @ blocks[0].T
    log_probs = torch.log_softmax(logits.to(_compute_dtype(x)), dim=-1)  # [c, M, V+1]
    del logits
    loss = _ctc_nll_sum(log_probs, labels, lengths, blank)
    if token_weight > 0:
        loss = loss + token_weight * _token_ce(log_probs, labels, scored).sum() / labels.shape[1]
    return loss, log_probs


def linear_ctc_reference(frames: torch.Tensor, weight, labels: torch.Tensor, *, blank: int,
                         chunk_size: int = 1024, token_weight: float = 0.0, topk: int = 5,
                         max_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, CTCStats]:
    """Plain-autograd twin of `fused_linear_ctc` (all [n, M, V+1] logits at once; chunk_size unused).

    frames [n, M, d] frame features; weight [V+1, d] projection (row V = blank), or a list of row blocks
    concatenated in order (e.g. [frozen lm_head [V, d], trainable blank row [1, d]]); labels [n, N] long.
    max_lengths [n] long >= 1 or None: usable label length per start (draft vocabulary, module docstring).
    Returns (loss_sum, stats): loss_sum = sum over starts of ctc_nll + token_weight * mean_j CE_j.
    """
    blocks = _as_blocks(weight)
    _check_linear(frames, blocks, labels, blank, chunk_size, token_weight, topk)
    _check_max_lengths(max_lengths, labels)
    mdtype = _matmul_dtype(frames)
    lengths = _target_lengths(labels, frames.shape[1], max_lengths)
    scored = _depth_mask(labels, max_lengths)
    loss, log_probs = _chunk_loss(frames.to(mdtype), [b.to(mdtype) for b in blocks], labels, lengths, blank,
                                  token_weight, scored)
    token_ce, top1, topk_hits = _stats_from_log_probs(log_probs, labels, blank, topk, scored)
    truncated = (lengths < labels.shape[1]).sum()
    count = torch.tensor(labels.shape[0], dtype=torch.long, device=labels.device)
    return loss, CTCStats(count, truncated, token_ce, top1, topk_hits)


def _target_lengths(labels: torch.Tensor, num_frames: int, max_lengths: torch.Tensor | None) -> torch.Tensor:
    """[n] CTC target lengths: the longest feasible prefix, cut at max_lengths when given."""
    lengths = feasible_label_lengths(labels, num_frames)
    return lengths if max_lengths is None else torch.minimum(lengths, max_lengths.to(lengths))


def _check_max_lengths(max_lengths: torch.Tensor | None, labels: torch.Tensor) -> None:
    if max_lengths is None:
        return
    if max_lengths.shape != labels.shape[:1] or (labels.shape[0] and bool((max_lengths < 1).any())):
        raise ValueError(f"max_lengths must be [n={labels.shape[0]}] with every entry >= 1 (drop starts whose first "
                         f"label is outside the draft vocabulary before the call), got {tuple(max_lengths.shape)}")


def fused_linear_ctc(frames: torch.Tensor, weight, labels: torch.Tensor, *, blank: int,
                     chunk_size: int = 1024, token_weight: float = 0.0, topk: int = 5,
                     max_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, CTCStats]:
    """Same contract as `linear_ctc_reference`, chunked over starts: peak extra memory is a few
    [chunk_size, V+1] fp32 buffers (log-probs, the CTC gradient, the logits gradient), chunk_size = rows
    = starts x M (at least one start per chunk). The forward computes the input grads (like
    fused_linear_ce), so under no_grad / without requires_grad it only computes the loss; a block that
    does not require grad costs no weight-gradient matmul."""
    blocks = _as_blocks(weight)
    _check_linear(frames, blocks, labels, blank, chunk_size, token_weight, topk)
    _check_max_lengths(max_lengths, labels)
    grad_on = torch.is_grad_enabled()
    need_gx = grad_on and frames.requires_grad
    need_gw = tuple(grad_on and b.requires_grad for b in blocks)
    loss, count, truncated, token_ce, top1, topk_hits = _FusedLinearCTC.apply(
        frames, labels, max_lengths, int(blank), int(chunk_size), float(token_weight), int(topk), need_gx, need_gw,
        *blocks)
    return loss, CTCStats(count, truncated, token_ce, top1, topk_hits)


class _FusedLinearCTC(torch.autograd.Function):
    """Forward: loss, stats and input grads chunk by chunk; backward only scales the stash."""

    @staticmethod
    def forward(ctx, frames, labels, max_lengths, blank, chunk_size, token_weight, topk, need_gx, need_gw, *blocks):
        n, num_frames, _ = frames.shape
        length = labels.shape[1]
        cdtype, mdtype = _compute_dtype(frames), _matmul_dtype(frames)
        ws = [b.detach().to(mdtype) for b in blocks]  # cast once per call, not per chunk
        bounds = [0]
        for w in ws:
            bounds.append(bounds[-1] + w.shape[0])  # block i = classes bounds[i] .. bounds[i+1]-1
        _check_label_values(labels, bounds[-1], blank)
        lengths = _target_lengths(labels, num_frames, max_lengths)
        scored = _depth_mask(labels, max_lengths)  # [n, N] bool or None
        ext, skip_ok = extended_labels(labels, blank)  # [n, S]
        # Gathered columns per start: the S CTC states, then y_1..y_N for the token term. [n, S+N]
        cols = torch.cat([ext, labels], dim=1)
        starts = max(1, chunk_size // num_frames)  # starts per chunk
        loss_sum = torch.zeros((), dtype=cdtype, device=frames.device)
        token_ce = torch.zeros(length, dtype=cdtype, device=frames.device)
        top1 = torch.zeros(length, dtype=torch.long, device=frames.device)
        topk_hits = torch.zeros(length, dtype=torch.long, device=frames.device)
        grad_x = torch.empty_like(frames) if need_gx else None  # [n, M, d], input dtype
        # fp32 accumulation across chunks for trainable blocks only, [r_i, d].
        grad_ws = [torch.zeros(b.shape, dtype=cdtype, device=b.device) if need else None
                   for b, need in zip(blocks, need_gw)]
        need_g = need_gx or any(need_gw)
        for lo in range(0, n, starts):
            hi = min(lo + starts, n)
            x = frames[lo:hi].detach().to(mdtype)  # [c, M, d]
            loss, ce, t1, tk, g = _fused_chunk(x, ws, labels[lo:hi], lengths[lo:hi], cols[lo:hi], skip_ok[lo:hi],
                                               blank, token_weight, topk, need_g,
                                               None if scored is None else scored[lo:hi])
            loss_sum += loss
            token_ce += ce
            top1 += t1
            topk_hits += tk
            if g is None:
                continue
            g = g.to(mdtype)  # [c, M, V+1] dLoss/dlogits, cast for the low-precision matmuls
            if need_gx:
                grad_x[lo:hi] = sum(g[..., a:b] @ w for a, b, w in zip(bounds, bounds[1:], ws))  # [c, M, d]
            for acc, a, b in zip(grad_ws, bounds, bounds[1:]):
                if acc is not None:  # [r_i, c*M] @ [c*M, d]; a frozen block skips this matmul entirely
                    acc += (g[..., a:b].reshape(-1, b - a).T @ x.reshape(-1, x.shape[-1])).to(cdtype)
            del g
        ctx.save_for_backward(grad_x, *[g.to(b.dtype) if g is not None else None for g, b in zip(grad_ws, blocks)])
        count = torch.tensor(n, dtype=torch.long, device=frames.device)
        truncated = (lengths < length).sum()
        ctx.mark_non_differentiable(count, truncated, token_ce, top1, topk_hits)
        return loss_sum, count, truncated, token_ce, top1, topk_hits

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_unused):
        grad_x, *grad_ws = ctx.saved_tensors
        # Out of place so a second backward (retain_graph) still finds the unscaled stash.
        scale = [None if g is None else g * grad_loss.to(g.dtype) for g in (grad_x, *grad_ws)]
        return scale[0], None, None, None, None, None, None, None, None, *scale[1:]


def _fused_chunk(x, ws, labels, lengths, cols, skip_ok, blank, token_weight, topk, need_g, scored=None):
    """One chunk of starts: x [c, M, d] and the blocks ws (matmul dtype); labels [c, N]; cols [c, S+N]
    (extended label, then labels); skip_ok [c, S]; scored [c, N] bool or None (depths inside the draft
    vocabulary). Returns (loss_sum, token_ce [N], top1 [N], topk [N],
    g = dLoss/dlogits [c, M, V+1] compute dtype, or None).

    The loss depends on the [c, M, V+1] log-probs only through the gathered columns `cols`, so: one
    [c, M, V+1] buffer holds the logits, then exp(logits - max); the DP and the token term run (with a
    tiny autograd graph) on the gathered [c, M, S+N] log-probs, giving G = dLoss/dlp_gathered; and
    dLoss/dlogits = scatter_add(G) - softmax * sum(G), built in the same buffer.
    """
    c, num_frames, _ = x.shape
    length, s = labels.shape[1], skip_ok.shape[1]
    cdtype = _compute_dtype(x)
    buf = torch.cat([x @ w.T for w in ws], dim=-1) if len(ws) > 1 else x @ ws[0].T  # [c, M, V+1] logits
    buf = buf.to(cdtype)  # a no-op for fp32 inputs: then buf IS the logits, overwritten below
    with torch.no_grad():
        k = min(topk, buf.shape[-1])
        cands = buf.topk(k, dim=-1).indices  # [c, M, k]: log_softmax keeps the order of the logits
        t1, tk = prefix_hits(cands[:, :, :1], labels, blank), prefix_hits(cands, labels, blank)  # [c, N]
        if scored is not None:  # depths past an out-of-map label are misses
            t1, tk = t1 & scored, tk & scored
        t1, tk = t1.sum(0), tk.sum(0)
    idx = cols[:, None, :].expand(c, num_frames, cols.shape[1])  # [c, M, S+N]
    picked = buf.gather(2, idx)  # logits at the gathered columns
    row_max = buf.amax(dim=-1, keepdim=True)  # [c, M, 1]
    buf.sub_(row_max).exp_()
    row_sum = buf.sum(dim=-1, keepdim=True)  # [c, M, 1]; buf = softmax * row_sum
    lp = (picked - row_max - row_sum.log()).requires_grad_(need_g)  # [c, M, S+N] log-probs
    with torch.enable_grad():
        nll = ctc_nll_extended(lp[:, :, :s], skip_ok, lengths).sum()
        # Token term: frame j (< N) vs label j, i.e. column S + j of frame j.
        diag = torch.arange(length, device=x.device)
        ce = -lp[:, diag, s + diag]  # [c, N]
        if scored is not None:
            ce = ce * scored  # no token term past an out-of-map label
        loss = nll + (token_weight / length) * ce.sum() if token_weight > 0 else nll
        grad = torch.autograd.grad(loss, lp)[0] if need_g else None  # [c, M, S+N]
    token_ce = ce.detach().sum(0)
    if grad is None:
        return loss.detach(), token_ce, t1, tk, None
    # dLoss/dlogits = scatter_add(G) - softmax * sum_cols(G); softmax = buf / row_sum.
    buf.mul_(-grad.sum(-1, keepdim=True) / row_sum)
    buf.scatter_add_(2, idx, grad)
    return loss.detach(), token_ce, t1, tk, buf
