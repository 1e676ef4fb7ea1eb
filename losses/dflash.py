"""DFlash's block loss lives in losses/block.py, shared with DSpark; these names stay importable from here."""

from losses.block import (  # noqa: F401
    POSITION_WEIGHTS,
    block_position_weights,
    block_weighted_loss,
    decay_weights,
    dpace_weights,
    linear_row_losses,
    linear_row_losses_reference,
)
