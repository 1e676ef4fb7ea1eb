"""The base's top-2 logit gap and runner-up token at each committed position, and the other tokens close to the
top: what the losslessness verdict (eval/harness/lossless.py) needs to tell a bf16 rounding tie from a real
mismatch. The decoder records them outside its timings when asked (record_top2)."""

from __future__ import annotations

import torch


def top2_rows(rows: torch.Tensor) -> tuple[list[float], list[int]]:
    """rows [n, V] -> (top1 - top2 logit gaps [n], runner-up tokens [n]): the runner-up is the best token other
    than the argmax that greedy decoding commits. With an exact tie (gap 0, common in bf16) topk may list the
    tied tokens in either order, so taking topk's second index could name the committed token itself and turn
    a tie into a "mismatch" (seen in two demo runs); taking whichever of topk's two is not the argmax cannot."""
    rows = rows.float()
    first = rows.argmax(dim=-1)  # [n]: what greedy decoding commits
    v, i = torch.topk(rows, 2, dim=-1)  # [n, 2]; v[:, 1] is the second value whatever the order of ties
    second = torch.where(i[:, 0] == first, i[:, 1], i[:, 0])
    gaps = rows.gather(1, first[:, None])[:, 0] - v[:, 1]
    return gaps.tolist(), second.tolist()


def top2(logits_row: torch.Tensor) -> tuple[float, int]:
    """(top1 - top2 logit, runner-up token) of one row [V]; see top2_rows."""
    gaps, second = top2_rows(logits_row[None])
    return gaps[0], second[0]


# Tokens within this many logits of the top-1 are recorded as near ties (well above the bf16 rounding tolerance
# measured on SmolLM2, ~0.75); a measured tolerance above it falls back to the runner-up rule alone.
NEAR_TIE_BAND = 2.0
NEAR_TIE_TOP = 8  # at most this many best tokens are looked at per row


def near_ties_rows(rows: torch.Tensor, band: float = NEAR_TIE_BAND) -> list[list[list]]:
    """rows [n, V] -> per row, [[token, top1 - its logit], ...] for the tokens other than the committed argmax
    among the NEAR_TIE_TOP best whose logit is within `band` of the top-1 (usually an empty list). In bf16
    three or more tokens can tie exactly, and a verification forward may then commit any of them, not only the
    runner-up."""
    rows = rows.float()
    first = rows.argmax(dim=-1)  # [n]
    v, i = torch.topk(rows, min(NEAR_TIE_TOP, rows.shape[-1]), dim=-1)  # [n, k]
    gaps = rows.gather(1, first[:, None]) - v  # [n, k], >= 0
    out = []
    for g_row, i_row, f in zip(gaps.tolist(), i.tolist(), first.tolist()):
        out.append([[t, round(g, 6)] for t, g in zip(i_row, g_row) if t != f and g <= band])
    return out
