"""Chunked fused ``Linear → cross-entropy`` that never materializes all ``[N, V]`` logits.

Why: a Medusa/Hydra head ends in an LM head ``Linear(d → V)``; with K heads the plain path keeps
K × N × V fp32 logits alive (plus their log-softmax for backward). For SmolLM2 (V=49152) and
N=1024 tokens that is ~400 MB *per head*. Here each chunk of ``chunk_size`` rows is turned into
logits, loss, and the gradient w.r.t. its logits in one go, and the logits gradient is immediately
contracted into ``grad_hidden`` (``g @ W``) and ``grad_weight`` (``gᵀ @ x``). The logits die with the
chunk; only the (much smaller) input gradients are stashed, and ``backward`` just scales them by
``grad_output``. Same FLOPs as the plain path (no recompute), so speed ≈ plain, while peak memory is
one chunk of logits instead of all of them.

Consequence worth knowing: the forward pass *does the backward work*. Under ``torch.no_grad()`` or
with inputs that do not require grad, no gradient is computed (cheap eval path).

Loss (per valid row n, α = ``soft_weight``, T = ``temperature``)::

    (1 − α) · [−log softmax(z_n)[y_n]]  +  α · [−Σ_v softmax(t_n / T)_v · log softmax(z_n / T)_v]

with ``z = hidden @ weightᵀ`` (student) and ``t = teacher_hidden @ teacher_weightᵀ`` (frozen teacher).
Valid rows are those with ``labels != -100``; the soft term uses the same rows.

The slow twin :func:`linear_cross_entropy_reference` materializes everything with plain autograd and
is what the parity tests compare against (docs/architecture.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from losses.chunk_loop import ChunkedLinearLoss
from losses.chunk_loop import compute_dtype as _compute_dtype
from losses.chunk_loop import matmul_dtype as _matmul_dtype
from losses.soft_ce import soft_cross_entropy_sum
from losses.weighted_ce import IGNORE_INDEX, cross_entropy_sum


class LossStats(NamedTuple):
    """No-grad accuracy counters from the same pass; 0-dim int64 tensors (no host sync).

    Divide ``top1`` / ``topk`` by ``count`` (after an all-reduce, if distributed) for accuracies.
    """

    count: torch.Tensor  # rows with a valid label
    top1: torch.Tensor  # rows whose label is the student's argmax
    topk: torch.Tensor  # rows whose label is among the student's top-k


# ---------------------------------------------------------------------------------------------------
# Fast path
# ---------------------------------------------------------------------------------------------------


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    soft_weight: float = 0.0,
    topk: int = 5,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, LossStats]:
    """Summed (hard + optional soft) CE of ``hidden @ weightᵀ``, chunked over rows.

    Args:
        hidden: ``[N, d]`` student features (usually requires grad); fp32, bf16, fp16 or fp64.
        weight: ``[V, d]`` LM head weight; trainable (per-head head) or frozen (shared base head).
            ``grad_weight`` is only computed when it requires grad.
        labels: ``[N]`` int64 targets, ``-100`` = ignore.
        chunk_size: rows per chunk; peak extra memory ≈ ``chunk_size × V`` compute-dtype floats
            (×2 with a teacher, ×3 with a teacher and ``temperature != 1``). Fixed on top of that:
            the fp32 ``grad_weight`` stash ``[V, d]`` (trainable head only, held until backward,
            plus one scaled copy during backward). bf16/fp16 inputs run the matmuls in their own
            dtype (logits upcast to fp32 per chunk); fp32 inputs with a bf16 weight upcast the weight.
        teacher_hidden: ``[N, d_t]`` frozen teacher features, or None. Never receives a grad.
        teacher_weight: ``[V, d_t]`` frozen teacher LM head, required iff ``teacher_hidden`` is given.
        soft_weight: α in [0, 1]; loss = (1 − α)·hard CE + α·soft CE. With α = 0 the teacher is unused.
        topk: k for the top-k accuracy counter (clamped to V).
        temperature: T > 0 for the soft term only (no T² factor).

    Returns:
        ``(loss_sum, stats)``: ``loss_sum`` 0-dim tensor (fp32, fp64 for fp64 inputs), the sum over
        valid rows, differentiable w.r.t. ``hidden`` and ``weight``; ``stats`` a :class:`LossStats`.
        Gradients come back in each input's own dtype.
    """
    _validate(hidden, weight, labels, chunk_size, teacher_hidden, teacher_weight, soft_weight, topk, temperature)
    grad_on = torch.is_grad_enabled()
    need_grad_hidden = grad_on and hidden.requires_grad
    need_grad_weight = grad_on and weight.requires_grad
    use_teacher = soft_weight > 0
    alpha, temperature = float(soft_weight), float(temperature)

    def chunk_fn(x, w, targets, valid, tx, tw, k):
        return _chunk_forward_backward(x, w, targets, valid, tx, tw, alpha, temperature, k)

    loss_sum, count, top1, topk_hits = ChunkedLinearLoss.apply(
        hidden, weight, labels, teacher_hidden.detach() if use_teacher else None,
        teacher_weight.detach() if use_teacher else None, chunk_fn, int(chunk_size), int(topk), need_grad_hidden,
        need_grad_weight)
    return loss_sum, LossStats(count, top1, topk_hits)


def _chunk_forward_backward(
    x: torch.Tensor,  # [c, d] compute dtype
    w: torch.Tensor,  # [V, d]
    targets: torch.Tensor,  # [c] int64, 0 where invalid
    valid: torch.Tensor,  # [c] bool
    tx: torch.Tensor | None,  # [c, d_t]
    tw: torch.Tensor | None,  # [V, d_t]
    alpha: float,
    temperature: float,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: returns (loss sum, top-1 hits, top-k hits, g = dLoss/dlogits [c, V]).

    Buffers are reused in place so a hard-CE chunk holds a single ``[c, V]`` tensor.
    """
    z = (x @ w.T).to(_compute_dtype(x))  # [c, V] student logits; matmul in x's dtype, softmax in fp32

    # Stats and the target logit first, while z still holds raw logits.
    z_target = z.gather(1, targets[:, None]).squeeze(1)  # [c]
    hits = (z.topk(k, dim=-1).indices == targets[:, None]) & valid[:, None]  # [c, k], sorted best first
    top1 = hits[:, 0].sum()
    topk_hits = hits.any(dim=-1).sum()

    soft_row = q_t = p_teacher = None
    if tw is not None:
        p_teacher = (tx @ tw.T).to(z.dtype)  # [c, V] teacher logits -> probs in place
        if temperature != 1.0:
            p_teacher.div_(temperature)
        _softmax_(p_teacher)
        # Σ_v p_v · z_v / T as a batched dot product: no [c, V] temporary.
        dot = torch.bmm(p_teacher.unsqueeze(1), z.unsqueeze(2)).view(-1) / temperature  # [c]
        if temperature != 1.0:
            q_t = z / temperature  # [c, V] -> student probs at T in place
            lse_t = _softmax_(q_t)
            soft_row = lse_t - dot

    lse = _softmax_(z)  # z now holds p = softmax(z) [c, V]
    hard_row = lse - z_target  # [c]
    if tw is not None and soft_row is None:  # temperature == 1 shares the student log-partition
        soft_row = lse - dot
    row_loss = hard_row if soft_row is None else (1.0 - alpha) * hard_row + alpha * soft_row
    loss = row_loss.masked_fill(~valid, 0).sum()

    # dLoss/dz = (1−α)(p − onehot) + (α/T)(q_T − p_teacher); built in z's buffer.
    g = z
    if p_teacher is not None:
        if q_t is None:  # T == 1: q_T == p, so (1−α)p + α·p = p
            g.sub_(p_teacher, alpha=alpha)
        else:
            a_t = alpha / temperature
            g.mul_(1.0 - alpha).add_(q_t, alpha=a_t).sub_(p_teacher, alpha=a_t)
    g.scatter_add_(1, targets[:, None], g.new_full((g.shape[0], 1), -(1.0 - alpha)))
    g.masked_fill_(~valid[:, None], 0.0)
    return loss, top1, topk_hits, g


def _softmax_(buf: torch.Tensor) -> torch.Tensor:
    """Turn ``buf [c, V]`` into ``softmax(buf)`` in place; return its log-partition ``[c]``."""
    row_max = buf.amax(dim=-1, keepdim=True)  # [c, 1]
    buf.sub_(row_max).exp_()
    row_sum = buf.sum(dim=-1, keepdim=True)  # [c, 1]
    buf.div_(row_sum)
    return (row_sum.log() + row_max).squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# Slow reference twin
# ---------------------------------------------------------------------------------------------------


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    soft_weight: float = 0.0,
    topk: int = 5,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, LossStats]:
    """Same contract as :func:`fused_linear_cross_entropy`, with all ``[N, V]`` logits materialized.

    Plain autograd; ``chunk_size`` is accepted (and validated) only so the two are drop-in swappable.
    """
    _validate(hidden, weight, labels, chunk_size, teacher_hidden, teacher_weight, soft_weight, topk, temperature)
    cdtype, mdtype = _compute_dtype(hidden), _matmul_dtype(hidden)
    logits = F.linear(hidden.to(mdtype), weight.to(mdtype)).to(cdtype)  # [N, V]
    loss_sum, count = cross_entropy_sum(logits, labels)
    if soft_weight > 0:
        teacher_logits = F.linear(teacher_hidden.detach().to(mdtype), teacher_weight.detach().to(mdtype)).to(cdtype)
        soft_sum, _ = soft_cross_entropy_sum(logits, teacher_logits, labels != IGNORE_INDEX, temperature)
        loss_sum = (1.0 - soft_weight) * loss_sum + soft_weight * soft_sum
    with torch.no_grad():
        valid = labels != IGNORE_INDEX
        k = min(topk, weight.shape[0])
        hits = (logits.topk(k, dim=-1).indices == labels[:, None]) & valid[:, None]  # [N, k]
        stats = LossStats(count, hits[:, 0].sum(), hits.any(dim=-1).sum())
    return loss_sum, stats


# ---------------------------------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------------------------------


def _validate(
    hidden, weight, labels, chunk_size, teacher_hidden, teacher_weight, soft_weight, topk, temperature
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, d] and weight [V, d] with the same d, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}; flatten batch×time into N and pass lm_head.weight (not its transpose)"
        )
    if labels.shape != hidden.shape[:1] or labels.dtype != torch.long:
        raise ValueError(
            f"labels must be int64 of shape [N]={tuple(hidden.shape[:1])}, got {labels.dtype} "
            f"{tuple(labels.shape)}; use labels.reshape(-1).long() with -100 for ignored positions"
        )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}; e.g. 1024")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not 0.0 <= soft_weight <= 1.0:
        raise ValueError(f"soft_weight must be in [0, 1], got {soft_weight}; 0 = hard CE only, 1 = teacher only")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if (teacher_hidden is None) != (teacher_weight is None):
        raise ValueError("pass both teacher_hidden and teacher_weight, or neither")
    if soft_weight > 0:
        if teacher_hidden is None:
            raise ValueError(
                f"soft_weight={soft_weight} needs a teacher: pass teacher_hidden [N, d_t] and teacher_weight "
                "[V, d_t] (e.g. the frozen base hidden states and base lm_head.weight), or set soft_weight=0"
            )
        if (
            teacher_hidden.dim() != 2
            or teacher_hidden.shape[0] != hidden.shape[0]
            or teacher_weight.dim() != 2
            or teacher_weight.shape != (weight.shape[0], teacher_hidden.shape[1])
        ):
            raise ValueError(
                f"teacher_hidden must be [N={hidden.shape[0]}, d_t] and teacher_weight "
                f"[V={weight.shape[0]}, d_t], "
                f"got {tuple(teacher_hidden.shape)} and {tuple(teacher_weight.shape)}"
            )
