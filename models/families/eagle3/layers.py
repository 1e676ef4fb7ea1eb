"""EAGLE-3's decoder layers and their decode-time KV cache (models/families/eagle3/model.py builds the draft from them).

Layer 0 (`Eagle3Layer`, speculators' / vLLM's `layers.0`) reads the token embedding and the feature side by side:
[input_layernorm(e); hidden_norm(g)] (q/k/v take 2d), residual g. A deeper draft (`draft.eagle3.num_layers` > 1)
stacks plain decoder layers of the base's shape after it (`Eagle3DecoderLayer`, `layers.1`, `layers.2`, ...): each
reads the d-wide output of the layer before, x + attention(input_layernorm(x)), then + MLP(post_attention_layernorm(.)),
as vLLM's llama_eagle3.py (layer_idx > 0) and speculators (its later layers are the base architecture's own decoder
layer) run them. Every layer attends with its own keys; `Eagle3Cache` holds them for all layers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.components import GatedMLP, RMSNorm, rotate_half


class Eagle3Attention(nn.Module):
    """LLaMA attention whose q/k/v read `in_features` (2d for layer 0, d for the layers after it). Names match HF /
    speculators (q_proj, ...)."""

    def __init__(self, config, in_features: int | None = None):
        super().__init__()
        d = int(config.hidden_size)
        width = 2 * d if in_features is None else int(in_features)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or d // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, n, in], cos/sin [B or 1, n, hd] -> q [B, H, n, hd], k / v [B, H_kv, n, hd] (RoPE on q, k)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, H, n, hd] -> [B, n, d]."""
        b, _, n, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class _Post:
    """The second half every layer shares: attention output + residual, then + MLP(post_attention_layernorm(.))."""

    post_attention_layernorm: RMSNorm
    mlp: GatedMLP

    def post(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attention output [B, n, d] (after o_proj) + residual -> the layer output [B, n, d] (pre final norm)."""
        a = residual + attn
        return a + self.mlp(self.post_attention_layernorm(a))


class Eagle3Layer(_Post, nn.Module):
    """Layer 0 (speculators' `layers.0`): two input norms, 2d-wide attention, MLP."""

    def __init__(self, config, norm_before_residual: bool = False):
        super().__init__()
        d, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.norm_before_residual = bool(norm_before_residual)
        self.input_layernorm = RMSNorm(d, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(d, eps)  # on the feature (fc output or the previous step's output)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = GatedMLP(config)

    def pre(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, hidden [B, n, d] -> (attention input [B, n, 2d] = [norm(emb); norm(hidden)], residual = hidden,
        or hidden_norm(hidden) with norm_before_residual)."""
        normed = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(emb), normed], dim=-1), normed if self.norm_before_residual else hidden


class Eagle3DecoderLayer(_Post, nn.Module):
    """Layers 1.. of a deeper draft (`layers.1`, ...): the base architecture's plain pre-norm decoder layer, d-wide
    q/k/v, on the output of the layer before (no embedding, no hidden_norm: vLLM's layer_idx > 0)."""

    def __init__(self, config):
        super().__init__()
        d, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Eagle3Attention(config, in_features=d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = GatedMLP(config)

    def pre(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer before's output [B, n, d] -> (attention input input_layernorm(hidden) [B, n, d], residual)."""
        return self.input_layernorm(hidden), hidden


@dataclass
class Eagle3Cache:
    """The draft's own KV cache of committed positions (batch 1): step-0 keys/values [L, H_kv, capacity, hd], row l
    the keys of decoder layer l (L = 1: the one-layer draft's [1, H_kv, capacity, hd]); rows [:length] of every layer
    valid. Grows by doubling."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    def reserve(self, end: int) -> None:
        """Room for rows [0, end) in every layer; what the buffer holds is kept."""
        cap = int(self.keys.shape[2])
        if end > cap:
            grow = (self.keys.shape[0], self.keys.shape[1], max(end, 2 * cap), self.keys.shape[3])
            keys, values = self.keys.new_zeros(grow), self.values.new_zeros(grow)
            keys[:, :, :cap], values[:, :, :cap] = self.keys, self.values
            self.keys, self.values = keys, values

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Layer `layer`'s K/V [1, H_kv, n, hd] at rows start .. start + n; the length stays put (the caller moves it
        once every layer has written its rows, or leaves scratch rows past it)."""
        end = start + int(k.shape[2])
        self.reserve(end)
        self.keys[layer:layer + 1, :, start:end] = k
        self.values[layer:layer + 1, :, start:end] = v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's K/V [L, H_kv, n, hd] after the committed rows; length += n."""
        end = self.length + int(k.shape[2])
        self.reserve(end)
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end


# -- initialisation from a base decoder layer ----------------------------------------------------------------------


def _copy_base_layer(layer: nn.Module, src: dict, widen: bool) -> None:
    """q/k/v (and their biases) and gate/up from the base layer whose state dict is `src`; widen: q/k/v read the 2d-wide
    [embedding; feature] input of layer 0, so the base's weights go on both halves."""
    for name in ("q_proj", "k_proj", "v_proj"):
        w = src[f"self_attn.{name}.weight"]
        getattr(layer.self_attn, name).weight.copy_(torch.cat([w, w], dim=1) if widen else w)
        if getattr(layer.self_attn, name).bias is not None:
            getattr(layer.self_attn, name).bias.copy_(src[f"self_attn.{name}.bias"])
    for name in ("gate_proj", "up_proj"):
        getattr(layer.mlp, name).weight.copy_(src[f"mlp.{name}.weight"])
    layer.post_attention_layernorm.weight.copy_(src["post_attention_layernorm.weight"])


@torch.no_grad()
def init_first_layer(layer: Eagle3Layer, src: dict) -> None:
    """Layer 0 = the base layer `src` with q/k/v on both input halves, o_proj / down_proj weights at zero, both input
    norms from the base's input norm."""
    _copy_base_layer(layer, src, widen=True)
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    for norm in ("input_layernorm", "hidden_norm"):
        getattr(layer, norm).weight.copy_(src["input_layernorm.weight"])


@torch.no_grad()
def init_deep_layer(layer: Eagle3DecoderLayer, src: dict) -> None:
    """A layer after the first = the base layer `src` with o_proj and down_proj (and their biases) at zero: the
    identity on its input, so a fresh deeper draft predicts what a fresh one-layer one does."""
    _copy_base_layer(layer, src, widen=False)
    for zero in (layer.self_attn.o_proj, layer.mlp.down_proj):
        zero.weight.zero_()
        if zero.bias is not None:
            zero.bias.zero_()
    layer.input_layernorm.weight.copy_(src["input_layernorm.weight"])
