"""The base's top-2 logit gap and runner-up token at each committed position: what the losslessness verdict
(eval/harness/lossless.py) needs to tell a bf16 rounding tie from a real mismatch. The decoder records them
outside its timings when asked (record_top2)."""

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
