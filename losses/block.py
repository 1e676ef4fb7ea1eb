"""The block loss of block-parallel drafts (DFlash, DSpark): per-row losses of the draft's LM head, the per-position
weights inside a block, and the per-position acceptance BCE of a confidence head (docs/families/dflash.md,
docs/families/dspark.md).

A DFlash draft fills a block of γ slots in one forward: slot 0 holds the last committed token, slots k = 1..γ-1
predict depth k (x_{t+1+k}). Acceptance stops at the first miss, so early slots matter more; two weightings of
the rows of a block exist (both from speculators' DFlash trainer, `losses/utils.py` of speculators 0.9.0):

    decay   w_k = λ0 · decay^(k-1)                              fixed (speculators' "fixed-exp-decay" is
                                                                 exp(-(k-1)/4): decay = e^(-1/4) ≈ 0.7788)
    dpace   w_k = Σ_{j >= k, valid} Π_{i <= j} s_i,   s_i = (1-α)·exp(-ℓ_i) + α   (no gradient through w)

D-PACE (speculators' DFlash default, α = 0.5): with q_i = exp(-ℓ_i) the draft's confidence at slot i, the
expected accepted run of a block is Σ_j Π_{i<=j} q_i, and w_k is its derivative with respect to log q_k
(smoothed by α): a slot is weighted by how much accepted length hangs on it. Invalid slots (no target) have
s = 1 and weight 0.

Loss = Σ w·ℓ / (number of valid rows), speculators' normalisation (the mean over rows, not over weights).

Rows: the draft's LM head over the draft vocabulary, (1-α)·hard CE + α·soft CE to the base's distribution
(the same row loss as losses/fused_linear_ce.py). D-PACE needs each row's own loss, so the fast path returns
per-row losses: chunks of rows, each chunk's [c, V] logits recomputed in backward (activation checkpointing)
instead of kept, so peak memory is one chunk of logits. `linear_row_losses_reference` materialises all [N, V]
logits with plain autograd: its slow twin (parity test in tests/test_dflash.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from losses.weighted_ce import IGNORE_INDEX

POSITION_WEIGHTS = ("dpace", "decay")


def decay_weights(k: int, lambda0: float = 1.0, decay: float = math.exp(-0.25)) -> torch.Tensor:
    """[k] weights λ0 · decay^(j-1) of block slots j = 1..k (slot 1 = depth 1 gets λ0)."""
    if k < 1:
        raise ValueError(f"k={k}: a DFlash block predicts at least one slot")
    if lambda0 <= 0 or decay <= 0:
        raise ValueError(f"lambda0={lambda0}, decay={decay}: weights must be > 0")
    return lambda0 * decay ** torch.arange(k, dtype=torch.float64)


@torch.no_grad()
def dpace_weights(row_loss: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE weights of the slots of each block.

    row_loss [M, K] float (per-row loss of slots 1..K of M blocks; detached here), valid [M, K] bool.
    Returns w [M, K] in row_loss' dtype, 0 at invalid slots: w[m, k] = Σ_{j >= k, valid} Π_{i <= j} s[m, i],
    s = (1-α)·exp(-ℓ) + α on valid slots and 1 on invalid ones.
    """
    if row_loss.shape != valid.shape or row_loss.dim() != 2:
        raise ValueError(f"row_loss {tuple(row_loss.shape)} and valid {tuple(valid.shape)} must both be [M, K]")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace alpha={alpha}: use a smoothing constant in (0, 1] (speculators: 0.5)")
    q = torch.exp(-row_loss.detach().float())
    m = valid.to(q.dtype)
    smooth = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(smooth, dim=-1)  # [M, K]
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, dims=[-1]), dim=-1), dims=[-1])
    return (suffix * m).to(row_loss.dtype)


def block_position_weights(row_loss: torch.Tensor, valid: torch.Tensor, scheme: str, *, lambda0: float = 1.0,
                           decay: float = math.exp(-0.25), alpha: float = 0.5) -> torch.Tensor:
    """[M, K] weights of the rows of M blocks by `scheme` (dpace | decay); 0 where not valid."""
    if scheme == "dpace":
        return dpace_weights(row_loss, valid, alpha)
    if scheme == "decay":
        w = decay_weights(row_loss.shape[-1], lambda0, decay).to(row_loss.device, row_loss.dtype)
        return w.expand_as(row_loss) * valid.to(row_loss.dtype)
    raise ValueError(f"loss.position_weights={scheme!r}: use one of {POSITION_WEIGHTS}")


def block_weighted_loss(row_loss: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Σ w·ℓ over valid rows / their number (0·Σℓ when none: keeps the graph, never NaN). Any equal shapes."""
    count = valid.sum()
    total = (weights.detach() * row_loss.masked_fill(~valid, 0.0)).sum()
    return total / count.clamp(min=1).to(total.dtype) if int(count) else 0.0 * row_loss.sum()


# ---------------------------------------------------------------------------------------------------
# Per-row losses: fast path (chunked, recomputed in backward) and its reference twin
# ---------------------------------------------------------------------------------------------------


def _rows(x, w, labels, tx, tw, alpha: float, k: int):
    """One chunk: x [c, d], w [V, d], labels [c] (-100 = none), tx [c, d_t] / tw [V, d_t] or None.
    Returns (row loss [c] fp32, 0 where invalid; top-1 hit [c] bool; top-k hit [c] bool)."""
    z = (x @ w.to(x.dtype).T).float()  # [c, V]: the matmul in the input dtype, softmax and loss in fp32
    logp = F.log_softmax(z, dim=-1)
    valid = labels != IGNORE_INDEX
    target = labels.clamp(min=0)
    row = -logp.gather(1, target[:, None]).squeeze(1)  # hard CE [c]
    if tx is not None and alpha > 0:
        p_teacher = torch.softmax((tx.to(x.dtype) @ tw.to(x.dtype).T).float(), dim=-1)  # [c, V], frozen teacher
        row = (1.0 - alpha) * row + alpha * -(p_teacher * logp).sum(-1)
    with torch.no_grad():
        hits = (z.topk(min(k, z.shape[-1]), dim=-1).indices == target[:, None]) & valid[:, None]  # [c, k]
    return row.masked_fill(~valid, 0.0), hits[:, 0], hits.any(dim=-1)


def _check(hidden, weight, labels, teacher_hidden, teacher_weight, soft_weight, chunk_size) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, d] and weight [V, d], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1] or labels.dtype != torch.long:
        raise ValueError(f"labels must be int64 [N]={tuple(hidden.shape[:1])}, got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if not 0.0 <= soft_weight <= 1.0:
        raise ValueError(f"soft_weight must be in [0, 1], got {soft_weight}")
    if soft_weight > 0 and (teacher_hidden is None or teacher_weight is None):
        raise ValueError(f"soft_weight={soft_weight} needs teacher_hidden [N, d_t] and teacher_weight [V, d_t]")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def linear_row_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                      teacher_hidden: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None,
                      soft_weight: float = 0.0, chunk_size: int = 1024, topk: int = 5
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (1-α)·hard CE + α·soft CE of `hidden @ weightᵀ`, `chunk_size` rows at a time.

    hidden [N, d] (student features), weight [V, d] (LM head), labels [N] int64 (-100 = no target),
    teacher_hidden [N, d_t] / teacher_weight [V, d_t] (frozen; used when soft_weight α > 0).
    Returns (rows [N] fp32, differentiable, 0 at invalid rows; top1 [N] bool; topk [N] bool). Under grad,
    each chunk's logits are recomputed in backward (torch.utils.checkpoint) rather than kept alive.
    """
    _check(hidden, weight, labels, teacher_hidden, teacher_weight, soft_weight, chunk_size)
    use_teacher = soft_weight > 0
    tw = teacher_weight.detach() if use_teacher else None
    rows, top1, topk_hit = [], [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        tx = teacher_hidden[sl].detach() if use_teacher else None
        args = (hidden[sl], weight, labels[sl], tx, tw, float(soft_weight), int(topk))
        r, h1, hk = checkpoint(_rows, *args, use_reentrant=False) if grad else _rows(*args)
        rows.append(r), top1.append(h1), topk_hit.append(hk)
    if not rows:
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * weight.sum()
        none = torch.zeros(0, dtype=torch.bool, device=hidden.device)
        return empty, none, none
    return torch.cat(rows), torch.cat(top1), torch.cat(topk_hit)


def linear_row_losses_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                teacher_hidden: torch.Tensor | None = None,
                                teacher_weight: torch.Tensor | None = None, soft_weight: float = 0.0,
                                chunk_size: int = 1024, topk: int = 5
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slow twin of `linear_row_losses`: all [N, V] logits at once, F.cross_entropy, plain autograd.
    (chunk_size is accepted and checked so the two are drop-in swappable.)"""
    _check(hidden, weight, labels, teacher_hidden, teacher_weight, soft_weight, chunk_size)
    logits = F.linear(hidden, weight.to(hidden.dtype)).float()  # [N, V]
    valid = labels != IGNORE_INDEX
    rows = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 at ignored rows
    if soft_weight > 0:
        teacher = F.linear(teacher_hidden.detach().to(hidden.dtype), teacher_weight.detach().to(hidden.dtype)).float()
        soft = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1)
        rows = (1.0 - soft_weight) * rows + soft_weight * soft.masked_fill(~valid, 0.0)
    with torch.no_grad():
        hits = (logits.topk(min(topk, logits.shape[-1]), dim=-1).indices == labels[:, None]) & valid[:, None]
    return rows, hits[:, 0], hits.any(dim=-1)


# ---------------------------------------------------------------------------------------------------
# Confidence head (DSpark): per-position acceptance
# ---------------------------------------------------------------------------------------------------

def acceptance_bce(conf_logits: torch.Tensor, hits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean BCE of a confidence head's logits against whether each drafted slot is accepted given that every
    earlier slot of its block was.

    conf_logits [M, K] float (logit of slot k's acceptance), hits [M, K] bool (slot k's top-1 equals its target,
    teacher-forced: the slots before it hold the true tokens), valid [M, K] bool. Under teacher forcing the
    prefix of slot k is the true one, so hits[:, k] is the event "accepted, given slots < k were": the
    conditional probability vLLM's adaptive verification multiplies (survival to slot k = Π_{j<=k} c_j).
    Returns a scalar: Σ over valid rows / their number (0·Σ when none).
    """
    if conf_logits.shape != hits.shape or hits.shape != valid.shape:
        raise ValueError(f"conf_logits {tuple(conf_logits.shape)}, hits {tuple(hits.shape)} and valid "
                         f"{tuple(valid.shape)} must have one shape")
    rows = F.binary_cross_entropy_with_logits(conf_logits.float(), hits.float(), reduction="none")
    count = valid.sum()
    if not int(count):
        return 0.0 * conf_logits.sum()
    return rows.masked_fill(~valid, 0.0).sum() / count.to(rows.dtype)


def acceptance_bce_reference(conf_logits: torch.Tensor, hits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Slow twin of `acceptance_bce`: -[y log σ(z) + (1-y) log(1-σ(z))] row by row in float64."""
    total, n = torch.zeros((), dtype=torch.float64), 0
    for z, y, ok in zip(conf_logits.flatten().tolist(), hits.flatten().tolist(), valid.flatten().tolist()):
        if ok:
            p = 1.0 / (1.0 + math.exp(-z))
            total = total - (math.log(p) if y else math.log(1.0 - p))
            n += 1
    return (total / max(n, 1)).to(conf_logits.dtype)
