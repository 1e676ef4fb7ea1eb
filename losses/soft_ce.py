"""Soft cross-entropy to a frozen teacher distribution (Hydra++ teacher loss, optional KD elsewhere).

``H(p_teacher, q_student) = −Σ_v p_v · log q_v``. It differs from KL(p‖q) only by the teacher's
entropy, a constant for the student, so gradients are identical; CE is cheaper (no log p term).
No ``T²`` factor is applied: with ``temperature != 1`` multiply by ``T**2`` yourself if you want
Hinton-style gradient magnitudes.
"""

from __future__ import annotations

import torch


def soft_cross_entropy_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy over valid rows, computed in fp32 (the plain reference).

    Args:
        student_logits: ``[N, V]`` any float dtype (receives grad).
        teacher_logits: ``[N, V]`` any float dtype; detached here, the teacher never gets a grad.
        mask: ``[N]`` bool, True = row counts.
        temperature: ``T > 0``; both distributions are ``softmax(logits / T)``.

    Returns:
        ``(loss_sum, count)``: ``loss_sum`` 0-dim fp32 tensor
        ``Σ_{valid n} −Σ_v softmax(teacher_n/T)_v · log_softmax(student_n/T)_v`` (0 if nothing valid);
        ``count`` 0-dim int64, number of valid rows.
    """
    if student_logits.dim() != 2 or teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"student and teacher logits must both be [N, V] with equal shapes, got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if mask.shape != student_logits.shape[:1] or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor of shape [N]={tuple(student_logits.shape[:1])}, got "
            f"{mask.dtype} {tuple(mask.shape)}; e.g. mask = labels != -100"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    log_q = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)  # [N, V]
    p = torch.softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)  # [N, V]
    per_row = -(p * log_q).sum(dim=-1)  # [N]
    # where (not multiply) so a garbage masked row cannot leak NaN into the sum.
    loss_sum = torch.where(mask, per_row, per_row.new_zeros(())).sum()
    return loss_sum, mask.sum()
