"""Layers shared by several draft families."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ResBlock(nn.Module):
    """Medusa's residual block: y = x + SiLU(W x + b), [.., d] -> [.., d].

    W starts at zero so a fresh head is the identity on h_t: with an lm_head copied from the base, an
    untrained head predicts what the base predicts, a far better start than random.
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(F.silu(self.linear(x)))


def stack_resblocks(num: int, hidden_size: int, dropout: float = 0.0) -> list[nn.Module]:
    """`num` DISTINCT ResBlocks. (Multiplying a one-block list by `num` would reuse one block's weights.)"""
    return [ResBlock(hidden_size, dropout) for _ in range(num)]
