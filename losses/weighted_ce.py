"""Hard cross-entropy and the Medusa-style weighted sum over K draft heads (docs/families/medusa.md, Medusa).

Every function here returns *sums and counts* (or means built from them) rather than a pre-averaged
loss, so the training loop can all-reduce sums and counts across ranks before dividing. Nothing is
moved to the host: counts stay 0-dim tensors, so no GPU sync happens inside a loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label value that marks a position without a target (prompt, padding, doc edge)


def head_weights(num_heads: int, lambda0: float = 1.0, decay: float = 0.8) -> list[float]:
    """Per-head loss weights ``λ_k = λ0 · decay**k`` for heads ``k = 1..num_heads``.

    The exponent starts at **1**, not 0: head k=1 (which predicts ``x_{t+2}``) gets ``λ0·decay``,
    head k=2 gets ``λ0·decay²``, and so on. ``λ0`` therefore weights the base's own next token
    (depth 0), which no draft head predicts. Returned list index ``i`` holds the weight of head
    ``k = i + 1``.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}; a draft needs at least one head")
    if decay <= 0:
        raise ValueError(f"decay must be > 0, got {decay}; use e.g. 0.8 (Medusa default)")
    return [lambda0 * decay**k for k in range(1, num_heads + 1)]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed hard cross-entropy, computed in fp32 (the plain reference).

    Args:
        logits: ``[N, V]`` any float dtype; upcast to fp32 before the softmax.
        labels: ``[N]`` int64 class ids, ``IGNORE_INDEX`` (-100) = no target.

    Returns:
        ``(loss_sum, count)``: ``loss_sum`` is a 0-dim fp32 tensor ``Σ_valid −log softmax(logits)[label]``
        (0 when no label is valid, never NaN); ``count`` is a 0-dim int64 tensor, the number of valid rows.
    """
    _check_logits_labels(logits, labels)
    # float64 stays float64 (gradcheck); everything narrower is computed in fp32.
    compute = logits if logits.dtype == torch.float64 else logits.float()
    loss_sum = F.cross_entropy(compute, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (labels != IGNORE_INDEX).sum()
    return loss_sum, count


def weighted_head_means(
    loss_sums: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], weights: Sequence[float]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Combine per-head ``(loss_sum, count)`` into ``Σ_k λ_k · mean_k`` (the one weighting rule).

    Shared by the plain path (:func:`weighted_multi_head_ce`) and the fused path (callers of
    ``fused_linear_cross_entropy``), so both weight heads identically.

    Args:
        loss_sums: K 0-dim float tensors (may carry grad).
        counts: K 0-dim integer tensors, valid rows per head.
        weights: K floats, e.g. from :func:`head_weights`.

    Returns:
        ``(total, per_head_mean)``: ``total`` 0-dim tensor with grad; ``per_head_mean`` K detached
        0-dim tensors for logging. A head with ``count == 0`` has mean 0 (not NaN) and adds nothing.
    """
    if not (len(loss_sums) == len(counts) == len(weights)):
        raise ValueError(
            f"got {len(loss_sums)} loss sums, {len(counts)} counts and {len(weights)} weights; "
            "pass one of each per head (weights from head_weights(num_heads))"
        )
    if len(loss_sums) == 0:
        raise ValueError("no heads given; pass at least one head's loss")
    total = loss_sums[0].new_zeros(())
    per_head_mean = []
    for loss_sum, count, weight in zip(loss_sums, counts, weights):
        # clamp(min=1): an all-ignored head has loss_sum == 0, so 0 / 1 = 0 and its grad is 0.
        mean = loss_sum / count.clamp(min=1).to(loss_sum.dtype)
        total = total + weight * mean
        per_head_mean.append(mean.detach())
    return total, per_head_mean


def weighted_multi_head_ce(
    logits_per_head: Sequence[torch.Tensor],
    labels_per_head: Sequence[torch.Tensor],
    weights: Sequence[float],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Medusa loss ``Σ_k λ_k · CE_k`` with each ``CE_k`` the mean over that head's valid tokens.

    Args:
        logits_per_head: K tensors ``[N, V]`` (head k's logits for ``x_{t+1+k}``; N may differ per head).
        labels_per_head: K tensors ``[N]`` int64, ``-100`` = ignore.
        weights: K floats ``λ_k`` (see :func:`head_weights`).

    Returns:
        ``(total, per_head_mean)`` as in :func:`weighted_head_means`.
    """
    if len(logits_per_head) != len(labels_per_head):
        raise ValueError(
            f"got logits for {len(logits_per_head)} heads but labels for {len(labels_per_head)}; "
            "pass one labels tensor per head"
        )
    sums, counts = [], []
    for logits, labels in zip(logits_per_head, labels_per_head):
        loss_sum, count = cross_entropy_sum(logits, labels)
        sums.append(loss_sum)
        counts.append(count)
    return weighted_head_means(sums, counts, weights)


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}; flatten batch and time first")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must be [N]={tuple(logits.shape[:1])} to match logits, got {tuple(labels.shape)}")
    if labels.dtype != torch.long:
        raise TypeError(f"labels must be int64 (torch.long), got {labels.dtype}; use labels.long()")
