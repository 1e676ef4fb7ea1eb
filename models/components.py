"""Building blocks shared by several draft families, so that no family module imports another family's module.

    ResBlock, stack_resblocks      Medusa's zero-init residual block (Medusa, Hydra, ReDrafter, CTC)
    default_aux_layers,            which base layers' residual streams a draft reads (EAGLE-3, DFlash)
      check_aux_layers
    rms_norm, RMSNorm              LLaMA RMSNorm in fp32 (EAGLE-3, DFlash)
    rotate_half, rope_cos_sin      RoPE in HF's rotate-half layout (EAGLE-3, DFlash)
    expand_kv                      GQA: key / value heads repeated for the query heads (EAGLE-3, DFlash)
    GatedMLP                       the SiLU-gated MLP of a LLaMA / Qwen3 decoder layer (EAGLE-3, DFlash)
    default_mask_token_id          the token whose embedding starts a mask slot (EAGLE-3's P-EAGLE, the block drafts)

The block-parallel draft DFlash, DSpark and Domino extend has its own module (models/block_draft.py), as has Hydra's
and CTC's prefix-attention layer (models/prefix_attention.py). The parameter names of these modules are state-dict
keys of exports on disk: renaming one would break loading them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' / vLLM's default [2, L//2, L-3], clamped to [0, L-1] and deduplicated (a 2-layer
    test base gets [0, 1]). Id l = the residual stream after l base layers (0 = the embeddings)."""
    return sorted({min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)})


def check_aux_layers(ids: list[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(f"draft.aux_layers={ids}: give distinct base layer ids in [0, {num_layers - 1}] (id l = "
                         f"the output of l base layers; the last layer's output is post-norm in HF and not "
                         f"allowed), or [] for the default {default_aux_layers(num_layers)}")
    return ids


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaMA RMSNorm, computed in fp32 like transformers/vLLM: [..., d] -> [..., d] in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] long -> (cos, sin) [..., hd] in HF's rotate-half layout (fp32 angles); inv_freq [hd/2] and
    scale are the base's rotary embedding's (attention_scaling)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: [B, H_kv, n, hd] -> [B, H_kv * groups, n, hd] (query head h uses K/V head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class GatedMLP(nn.Module):
    """LLaMA / Qwen3 SiLU-gated MLP: [.., d] -> down(SiLU(gate(x)) * up(x)) [.., d], intermediate size i.
    gate_proj / up_proj / down_proj are the state-dict keys HF, speculators and vLLM load."""

    def __init__(self, config):
        super().__init__()
        d, i = int(config.hidden_size), int(config.intermediate_size)
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

def default_mask_token_id(config) -> int:
    """The token whose embedding row starts the mask embedding (and the id vLLM feeds into the mask slots):
    speculators' fallback for a tokenizer without a mask token and without a free embedding row is the pad
    token, else eos, else unk; 0 when the config names none. With SmolLM2 that is <|im_end|>: a root equal to
    it ends the answer, so vLLM embedding such a root as the mask never matters."""
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
