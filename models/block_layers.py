"""The layers a block draft is made of (models/block_draft.py's BlockDraft; DFlash, DSpark and Domino): the attention
of blocks of mask slots against a shared context and their own block (block_attention, no dense mask, and its slow
twin), the Qwen3-shaped attention and decoder layer whose keys / values come from the context and the slots, and the
context cache decoding keeps per layer. The parameter names are state-dict keys of exports on disk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from models.components import GatedMLP, RMSNorm, rotate_half


def block_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
    """Attention of A blocks of G slots against a shared context and their own block, no dense mask.

    q, kb, vb [B, H, A, G, hd] (RoPE applied, GQA expanded); kc, vc [B, H, T, hd] the context;
    anchors [B, A] long: block a sees context positions 0..anchors[b, a] and all G slots of itself.
    Scores [B, H, A, G, T + G] in fp32 (the context part and the block's own square); returns
    [B, H, A, G, hd] in q's dtype.
    """
    t, scale = kc.shape[2], q.shape[-1] ** -0.5
    qf = q.float()
    sc = torch.einsum("bhagd,bhtd->bhagt", qf, kc.float()) * scale  # [B, H, A, G, T]
    visible = torch.arange(t, device=q.device)[None, None, :] <= anchors[:, :, None]  # [B, A, T]
    sc = sc.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    sb = torch.einsum("bhagd,bhajd->bhagj", qf, kb.float()) * scale  # [B, H, A, G, G]
    p = torch.softmax(torch.cat([sc, sb], dim=-1), dim=-1)
    out = torch.einsum("bhagt,bhtd->bhagd", p[..., :t], vc.float())
    out = out + torch.einsum("bhagj,bhajd->bhagd", p[..., t:], vb.float())
    return out.to(q.dtype)


def block_attention_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kb: torch.Tensor,
                              vb: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Slow twin of `block_attention`: keys [context | all blocks] [B, H, T + A·G, hd] and the dense bool mask
    [B, A·G, T + A·G] (context position <= the query's anchor; key in the query's own block), through sdpa."""
    b, h, a, g, hd = q.shape
    t = kc.shape[2]
    block_of = torch.arange(a * g, device=q.device) // g  # [A·G]
    ctx = torch.arange(t, device=q.device)[None, None, :] <= anchors.repeat_interleave(g, dim=1)[:, :, None]
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, A·G, A·G]
    mask = torch.cat([ctx, own], dim=-1)[:, None]  # [B, 1, A·G, T + A·G]
    keys = torch.cat([kc, kb.reshape(b, h, a * g, hd)], dim=2)
    vals = torch.cat([vc, vb.reshape(b, h, a * g, hd)], dim=2)
    out = F.scaled_dot_product_attention(q.reshape(b, h, a * g, hd), keys, vals, attn_mask=mask)
    return out.reshape(b, h, a, g, hd)


class BlockAttention(nn.Module):
    """Qwen3-shaped attention (q_norm / k_norm per head): the names vLLM's DFlashQwen3 / Qwen3DSpark and speculators
    load."""

    def __init__(self, config):
        super().__init__()
        d = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or d // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        eps = float(config.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + rotate_half(x) * sin

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, *S, d], cos/sin [B or 1, *S, hd] -> k (k_norm, RoPE), v [B, H_kv, *S, hd]."""
        s = h.shape[1:-1]
        k = self.k_norm(self.k_proj(h).view(*h.shape[:-1], self.num_kv_heads, self.head_dim))
        v = self.v_proj(h).view(*h.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self._rope(k, cos.unsqueeze(-2), sin.unsqueeze(-2))
        perm = (0, len(s) + 1, *range(1, len(s) + 1), len(s) + 2)  # [B, *S, H, hd] -> [B, H, *S, hd]
        return k.permute(perm), v.permute(perm)

    def q(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [B, *S, d] -> q (q_norm, RoPE) [B, H, *S, hd]."""
        s = h.shape[1:-1]
        q = self.q_norm(self.q_proj(h).view(*h.shape[:-1], self.num_heads, self.head_dim))
        q = self._rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        return q.permute(0, len(s) + 1, *range(1, len(s) + 1), len(s) + 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, H, A, G, hd] -> [B, A, G, d]."""
        b, _, a, g, _ = o.shape
        return self.o_proj(o.permute(0, 2, 3, 1, 4).reshape(b, a, g, self.num_heads * self.head_dim))


class BlockLayer(nn.Module):
    """One draft decoder layer (vLLM's / speculators' `layers.{i}`)."""

    def __init__(self, config):
        super().__init__()
        d, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = GatedMLP(config)  # Qwen3's SiLU-gated MLP (gate_proj, up_proj, down_proj), whatever the base's
        # activation: the export says hidden_act silu


@dataclass
class BlockCache:
    """Context K/V of committed positions for each layer (batch 1): keys[l], values[l] [1, H_kv, capacity, hd]
    with RoPE applied, rows [:length] valid. Grows by doubling."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = int(kv[0][0].shape[2])
        end = self.length + n
        if end > self.keys[0].shape[2]:
            cap = max(end, 2 * int(self.keys[0].shape[2]))
            for store in (self.keys, self.values):
                for i, old in enumerate(store):
                    new = old.new_zeros((1, old.shape[1], cap, old.shape[3]))
                    new[:, :, :self.length] = old[:, :, :self.length]
                    store[i] = new
        for i, (k, v) in enumerate(kv):
            self.keys[i][:, :, self.length:end] = k
            self.values[i][:, :, self.length:end] = v
        self.length = end

    def context(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [1, H_kv, L, hd]: the rows of the first L committed positions (views; L = length or
        all of them), what a block drafted after position L-1 attends to."""
        n = self.length if length is None else int(length)
        if not 1 <= n <= self.length:
            raise ValueError(f"a block needs 1..{self.length} committed positions of this cache, got {n}")
        return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self.keys, self.values)]
