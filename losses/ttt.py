"""Training-time-test (TTT) step weighting for EAGLE-3 (docs/families/eagle3.md).

EAGLE-3 unrolls its one decoder layer T times per position; step j (0-based) predicts depth j+1. Later
steps are harder and matter less (acceptance stops at the first miss), so step j's mean loss is weighted
λ0 · decay^j: step 0 gets λ0 (speculators' `exp_loss_decay`, γ^j; EAGLE-3 uses 0.8). Each step's loss
itself is the chunked fused Linear -> (hard + soft) CE of losses/fused_linear_ce.py over the draft
vocabulary, whose reference twin and parity tests live there.
"""

from __future__ import annotations

import torch


def ttt_step_weights(steps: int, lambda0: float = 1.0, decay: float = 0.8) -> list[float]:
    """[steps] weights λ0 · decay^j for j = 0 .. steps-1 (step 0 = depth 1 gets λ0)."""
    if steps < 1:
        raise ValueError(f"steps={steps}: a TTT unroll has at least one step")
    if lambda0 <= 0 or decay <= 0:
        raise ValueError(f"lambda0={lambda0}, decay={decay}: step weights must be > 0 (EAGLE-3 uses 1.0 and 0.8)")
    return [lambda0 * decay ** j for j in range(steps)]


def ttt_weighted_loss(loss_sums: torch.Tensor, counts: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Σ_j w_j · loss_sums[j] / counts[j] over the steps that have targets.

    loss_sums [T] float (summed per-row losses of each step), counts [T] int (rows per step), weights [T].
    A step without targets contributes 0 · loss_sums[j] (keeps its graph alive, never NaN). Returns a 0-dim
    tensor in loss_sums' dtype.
    """
    if loss_sums.shape != counts.shape or loss_sums.dim() != 1 or len(weights) != loss_sums.shape[0]:
        raise ValueError(f"loss_sums {tuple(loss_sums.shape)}, counts {tuple(counts.shape)} and {len(weights)} "
                         "weights must all be [T]")
    w = torch.tensor(weights, dtype=loss_sums.dtype, device=loss_sums.device)
    safe = counts.clamp(min=1).to(loss_sums.dtype)
    return torch.where(counts > 0, w * loss_sums / safe, 0.0 * loss_sums).sum()
