"""EAGLE-3's training-time pieces that are not the model: the attention of a training-time-test (TTT) step without the
dense mask and its slow twin (the parity test in tests/test_eagle3.py), and P-EAGLE's COD sampling of the anchors each
depth trains on (models/families/eagle3/model.py uses all three in `ttt_unroll` and `loss`)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of TTT step j = len(keys) - 1 without the dense mask.

    q [B, H, T, hd] (step j's queries, RoPE applied); keys / values: j+1 tensors [B, H, T, hd] (GQA
    already expanded), keys[0] = step 0's (every committed row), keys[i] = step i's at the same rows.
    Row t attends to keys[0][:, :, :t+1] (causal) and to keys[i][:, :, t] for i = 1..j (itself and its
    own earlier steps). Returns [B, H, T, hd]. Scores [B, H, T, T+j] in fp32.
    """
    t, hd = q.shape[2], q.shape[3]
    scale = hd ** -0.5
    qf = q.float()
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s0 = (qf @ keys[0].float().transpose(-1, -2)) * scale  # [B, H, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(qf * k.float()).sum(-1, keepdim=True) * scale for k in keys[1:]]  # j x [B, H, T, 1]
    p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)  # [B, H, T, T+j]
    out = p[..., :t] @ values[0].float()
    for i, v in enumerate(values[1:]):
        out = out + p[..., t + i:t + i + 1] * v.float()
    return out.to(q.dtype)


def ttt_attention_reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Slow twin of `ttt_attention`: all steps' keys side by side [B, H, (j+1)T, hd] and the dense bool
    mask [T, (j+1)T] = [tril | I | ... | I] (speculators' flex-attention mask), through sdpa."""
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal] + [eye] * (len(keys) - 1), dim=1)
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)


def cod_keep(valid: torch.Tensor, prev: torch.Tensor | None, depth: int, n0: int, ratio: float, ratio_min: float
             ) -> torch.Tensor:
    """P-EAGLE's COD sampling (speculators' `generate_cod_sample_indices`), one depth: which anchors depth `depth`
    trains on. valid [B, S] bool: anchors with a target at this depth; prev [B, S] bool: the anchors depth-1 kept
    (None at depth 0); n0: how many depth 0 kept. Depth 0 keeps every valid anchor; depth k >= 1 draws, uniformly
    and without replacement from the anchors depth k-1 kept that are valid here, round(n0 · max(ratio^k,
    ratio_min)) of them (at least one; all of them when fewer are left). Nested: an anchor kept at depth k is kept
    at every shallower depth. Draws from torch's global RNG (the training loop seeds it). Returns [B, S] bool."""
    if depth == 0 or prev is None:
        return valid.clone()
    pool = (valid & prev).flatten().nonzero().squeeze(1)  # flat indices of the candidates
    want = max(1, round(n0 * max(ratio ** depth, ratio_min)))
    if pool.numel() > want:
        pool = pool[torch.randperm(pool.numel(), device=pool.device)[:want]]
    keep = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    keep[pool] = True
    return keep.view_as(valid)
