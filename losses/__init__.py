"""Pure loss functions (no deepspeed, no torch.distributed): sums + counts, shapes in docstrings.

- ``weighted_ce``: hard CE reference and the Medusa weighting ``Σ_k λ_k · CE_k``.
- ``soft_ce``: soft CE to a frozen teacher distribution.
- ``fused_linear_ce``: chunked fused ``Linear → CE (+ soft CE)`` fast path and its slow twin.
- ``ctc``: CTC loss of the CTC drafter (torch DP, brute-force twin) and chunked fused ``Linear → CTC``.
- ``dflash``: DFlash's per-row chunked ``Linear → CE (+ soft CE)`` and its twin, D-PACE / decay slot weights.
- ``distill``: chunked fused ``Linear → divergence`` (hard / soft CE, reverse KL, TV, LK losses, weighted sums) and
  its twin: EAGLE-3's ``loss.eagle3.divergence``.
"""

from losses.ctc import CTCStats, ctc_draft_loss, fused_linear_ctc, linear_ctc_reference
from losses.dflash import (
    block_position_weights,
    block_weighted_loss,
    dpace_weights,
    linear_row_losses,
    linear_row_losses_reference,
)
from losses.distill import fused_linear_distill, linear_distill_reference, parse_divergence
from losses.fused_linear_ce import LossStats, fused_linear_cross_entropy, linear_cross_entropy_reference
from losses.soft_ce import soft_cross_entropy_sum
from losses.weighted_ce import (
    IGNORE_INDEX,
    cross_entropy_sum,
    head_weights,
    weighted_head_means,
    weighted_multi_head_ce,
)

__all__ = [
    "CTCStats",
    "IGNORE_INDEX",
    "LossStats",
    "block_position_weights",
    "block_weighted_loss",
    "dpace_weights",
    "linear_row_losses",
    "linear_row_losses_reference",
    "cross_entropy_sum",
    "ctc_draft_loss",
    "fused_linear_ctc",
    "fused_linear_cross_entropy",
    "fused_linear_distill",
    "head_weights",
    "linear_ctc_reference",
    "linear_cross_entropy_reference",
    "linear_distill_reference",
    "parse_divergence",
    "soft_cross_entropy_sum",
    "weighted_head_means",
    "weighted_multi_head_ce",
]
