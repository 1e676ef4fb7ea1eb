"""Multi-offset labels: the one offset rule (docs/concepts.md#the-offset-rule) as a pure tensor function.

The base predicts x_{t+1} from h_t (offset 1); a draft at depth k predicts x_{t+1+k} (offset 1+k).
A target is only valid when every token between the input position and the target, t+1 .. t+offset,
lies in the same assistant run (loss_mask == 1 on all of them). Requiring the whole window, not just
the target, keeps a multi-token target from jumping over a user turn, a chat header or a packed
document boundary (all of which have loss_mask 0).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def offset_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, offset: int,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels [B, T] long: labels[b, t] = input_ids[b, t + offset] if loss_mask[b, t+1 .. t+offset] are all
    nonzero, else ignore_index (also when t + offset >= T).

    input_ids: [B, T] integer token ids. loss_mask: [B, T] (bool/int/float; nonzero = supervised).
    offset: >= 1 (1 = the base's next token, 1 + k = draft depth k).
    """
    if input_ids.dim() != 2 or input_ids.shape != loss_mask.shape:
        raise ValueError(f"offset_labels: input_ids {tuple(input_ids.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must both be [B, T]; add a batch dimension with "
                         ".unsqueeze(0)")
    if offset < 1:
        raise ValueError(f"offset_labels: offset={offset}; use 1 for the next token or 1 + k for draft "
                         "depth k")
    batch, length = input_ids.shape
    labels = torch.full((batch, length), ignore_index, dtype=torch.long, device=input_ids.device)
    if offset >= length:
        return labels  # no position has a target inside the sequence
    # csum[:, j] = number of supervised tokens among positions 0 .. j-1 (csum[:, 0] = 0), [B, T+1].
    supervised = (loss_mask != 0).to(torch.int32)
    csum = torch.nn.functional.pad(supervised.cumsum(dim=1), (1, 0))
    # Supervised count in the window t+1 .. t+offset, for t = 0 .. T-offset-1: csum[t+offset+1] - csum[t+1].
    window = csum[:, offset + 1:] - csum[:, 1:length - offset + 1]  # [B, T-offset]
    valid = window == offset
    labels[:, :length - offset] = input_ids[:, offset:].long().masked_fill(~valid, ignore_index)
    return labels
