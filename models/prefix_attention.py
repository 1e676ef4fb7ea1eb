"""One extra decoder layer of the base's own architecture, run causally over the base hidden states.

Hydra++ (the Hydra paper, §3.1 and App. A.2 "PrefixMLP") adds a trainable self-attention decoder layer
whose only job is to turn the base's last hidden states h_1..h_t into a better summary z_t of the whole
context for the draft heads; it runs once per decoding step, over the tokens committed since the last
step, with its own KV cache. The CTC drafter's attention module is the same thing, so both import this.

    layer = PrefixAttention(base_model)          # base_model: the frozen HF causal LM (never stored)
    z = layer(hidden)                            # training: hidden [B, T, d] -> z [B, T, d], causal
    cache = layer.new_cache(max_len, device, dtype)
    z_new = layer.step(cache, new_hidden)        # inference: append n committed rows [n, d] -> [n, d]

Choices (the paper is silent on all three; the authors' code builds a freshly initialised one-layer
model with its own final norm):
- Architecture: `type(base.model.layers[-1])(config, layer_idx=0)`, i.e. a decoder layer of the base's
  class and config (attention forced to sdpa, which takes our explicit masks), plus the base's RoPE.
- Initialisation: a copy of the base's LAST decoder layer, except that the two projections that write
  into the residual stream (attention o_proj, MLP down_proj) start at zero. The layer is pre-norm
  (z = h + Attn(norm h) + MLP(norm ...)), so at init z_t == h_t exactly: a fresh Hydra++ draft starts
  as a Hydra draft on h_t, and training grows a correction out of the pretrained q/k/v and gate/up
  features (the zero-init residual trick of Medusa's ResBlock). A plain copy would instead add the last
  layer's full-size update (sized for the base's un-normalised residual stream) to an already
  normalised h_t, and the heads would start from noise.
- No norm on the output: h_t is the final-norm output, exactly what lm_head expects, and z_t = h_t + Δ
  with Δ = 0 at init. An RMSNorm would rescale every token (norm(h) != h) and throw that start away.
  Every consumer reads z_t through trainable layers first (a Hydra head's first block is a linear map
  of [z_t; e(...)]), so the scale of the learned Δ never reaches a frozen LM head unadapted.

Padding: batches are right-padded (data.dataset.collate), so a causal mask is all that is needed; a
real row never attends to a later pad row, and pad rows' outputs are never supervised.
Only static RoPE types are supported (default / linear / llama3 / yarn: a fixed inv_freq); dynamic
NTK scaling would change with the sequence length and is not reproduced.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface

# The attention function of a sequence-parallel forward (DraftBatch.shard), registered under its own name with
# transformers so the copied decoder layer calls it; selected only inside `forward(hidden, shard)`.
SHARDED_ATTENTION = "specdraft_sequence_shard"


def _sharded_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sequence_shard=None,
                       **kwargs):
    """q [B, H, n, hd], k / v [B, H_kv, n, hd] of this rank's rows (RoPE at their true positions) -> ([B, n, H, hd],
    None): causal attention over the whole sequence through sequence_shard.attend (models.draft.SequenceShard)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)

    def whole(q, k, v):  # every row of the sequence, this rank's heads
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)

    return sequence_shard.attend(whole, query, key, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(SHARDED_ATTENTION, _sharded_attention)


@dataclass
class PrefixKVCache:
    """The prefix layer's own KV cache for one sequence (batch size 1).

    keys, values [1, H_kv, capacity, head_dim]; rows [:length] hold the committed tokens, in order.
    Duck-types the one method a transformers attention layer calls on its cache (`update`). It grows by
    doubling when `capacity` is exceeded, so `max_len` given to `new_cache` is only the first allocation.
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    _pending: int = 0  # rows written by the current step(), committed when it returns

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int = 0, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write n new rows ([1, H_kv, n, hd], RoPE applied) after the committed ones; return all rows
        [1, H_kv, length + n, hd] for the attention of this step."""
        n = int(key_states.shape[2])
        end = self.length + n
        if end > self.capacity:  # grow: amortised O(1) per row, reallocation is rare
            b, h, _, hd = self.keys.shape
            new_cap = max(end, 2 * self.capacity)
            keys, values = self.keys.new_zeros((b, h, new_cap, hd)), self.values.new_zeros((b, h, new_cap, hd))
            keys[:, :, :self.length] = self.keys[:, :, :self.length]
            values[:, :, :self.length] = self.values[:, :, :self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length:end] = key_states.to(self.keys.dtype)
        self.values[:, :, self.length:end] = value_states.to(self.values.dtype)
        self._pending = n
        return self.keys[:, :, :end], self.values[:, :, :end]


class PrefixAttention(nn.Module):
    """A trainable decoder layer (base architecture, RoPE positions 0..T-1) over base hidden states.

    Holds no reference to the base model: the config is deep-copied and the weights are copied in.
    """

    def __init__(self, base_model: nn.Module, zero_init_output: bool = True):
        super().__init__()
        body = getattr(base_model, "model", None)
        layers = getattr(body, "layers", None)
        rotary = getattr(body, "rotary_emb", None)
        if layers is None or len(layers) == 0 or rotary is None:
            raise ValueError(f"{type(base_model).__name__} has no `.model.layers` / `.model.rotary_emb`; the prefix "
                             "layer needs a LLaMA-style causal LM (LlamaForCausalLM, Qwen2, Mistral, ...)")
        config = copy.deepcopy(base_model.config)
        config._attn_implementation = "sdpa"  # takes our explicit boolean masks (flash / eager would not)
        last = layers[-1]
        # Fresh module (trainable, fp32 on the CPU like the heads) with the base's last layer copied in;
        # copying weights rather than the module leaves the base's requires_grad=False flags behind.
        self.layer = type(last)(config, layer_idx=0)
        self.layer.load_state_dict(last.state_dict())
        if zero_init_output:
            with torch.no_grad():
                for proj in (self.layer.self_attn.o_proj, self.layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
        self.hidden_size = int(config.hidden_size)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        # RoPE frequencies in fp32, kept OUT of the module's buffers: `.to(bfloat16)` (DeepSpeed bf16, a bf16
        # export) would otherwise round inv_freq and shift every position's angle. [head_dim / 2]
        fresh = type(rotary)(config=config)
        inv_freq, scale = getattr(fresh, "inv_freq", None), getattr(fresh, "attention_scaling", 1.0)
        if inv_freq is None:  # one RoPE per layer type (Gemma-3: local / global bases): the copied layer's
            kind = config.get_text_config(decoder=True).layer_types[len(layers) - 1]
            inv_freq, scale = getattr(fresh, f"{kind}_inv_freq"), getattr(fresh, f"{kind}_attention_scaling", 1.0)
        self._inv_freq = inv_freq.detach().float().cpu().clone()
        self._rope_scale = float(scale)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    # -- helpers -----------------------------------------------------------------------------------

    def _param(self) -> torch.Tensor:
        return self.layer.input_layernorm.weight

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [1, n] long -> (cos, sin) [1, n, head_dim] in `dtype`, the HF rotate-half layout."""
        dev = positions.device
        if dev not in self._inv_freq_on:
            self._inv_freq_on[dev] = self._inv_freq.to(dev)
        freqs = positions[..., None].float() * self._inv_freq_on[dev]  # [1, n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [1, n, hd]
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def _check(self, hidden: torch.Tensor, dims: int, what: str) -> None:
        if hidden.dim() != dims or hidden.shape[-1] != self.hidden_size:
            shape = "[B, T, d]" if dims == 3 else "[n, d]"
            raise ValueError(f"PrefixAttention.{what} expects hidden {shape} with d={self.hidden_size}, got "
                             f"{tuple(hidden.shape)}; pass the base's last hidden states (post final norm)")

    # -- training: the full causal sequence ---------------------------------------------------------

    def forward(self, hidden: torch.Tensor, shard=None) -> torch.Tensor:
        """hidden [B, T, d] (base h_t, right-padded) -> z [B, T, d]; row t sees rows 0..t only.

        shard (a models.draft.SequenceShard, sequence parallelism): hidden holds rows [shard.start, shard.stop) only
        ([B, n, d] -> z [B, n, d]); they sit at their true positions and attend to every earlier row of the sequence
        through shard.attend."""
        self._check(hidden, 3, "forward")
        x = hidden.to(self._param().dtype)
        if shard is not None:
            return self._forward_shard(x, shard)
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)[None]  # [1, T], the same positions for every row
        # attention_mask=None with no cache: sdpa runs its causal kernel (is_causal, flash-capable on GPU).
        return self.layer(x, attention_mask=None, position_ids=pos, past_key_values=None, use_cache=False,
                          position_embeddings=self._rope(pos, x.dtype))

    def _forward_shard(self, x: torch.Tensor, shard) -> torch.Tensor:
        pos = torch.arange(shard.start, shard.stop, device=x.device)[None]  # [1, n]
        config = self.layer.self_attn.config  # this layer's own deep copy: no other module reads it
        saved, config._attn_implementation = config._attn_implementation, SHARDED_ATTENTION
        try:
            return self.layer(x, attention_mask=None, position_ids=pos, past_key_values=None, use_cache=False,
                              position_embeddings=self._rope(pos, x.dtype), sequence_shard=shard)
        finally:
            config._attn_implementation = saved

    # -- inference: incremental, with its own KV cache ------------------------------------------------

    def new_cache(self, max_len: int, device: torch.device | str, dtype: torch.dtype) -> PrefixKVCache:
        """An empty cache with room for `max_len` rows (it grows if a sequence needs more)."""
        shape = (1, self.num_kv_heads, max(1, int(max_len)), self.head_dim)
        return PrefixKVCache(torch.zeros(shape, device=device, dtype=dtype),
                             torch.zeros(shape, device=device, dtype=dtype))

    def step(self, cache: PrefixKVCache, new_hidden: torch.Tensor) -> torch.Tensor:
        """Append n committed rows new_hidden [n, d] (positions cache.length .. +n-1) -> their z [n, d].

        Equal to forward() over the whole sequence so far, restricted to the new rows. Call it under
        torch.no_grad() / inference_mode (the cache is written in place).
        """
        self._check(new_hidden, 2, "step")
        n = int(new_hidden.shape[0])
        if n == 0:
            return new_hidden.new_zeros((0, self.hidden_size)).to(self._param().dtype)
        x = new_hidden.to(self._param().dtype)[None]  # [1, n, d]
        past = cache.length
        pos = torch.arange(past, past + n, device=x.device)[None]  # [1, n]
        # [1, 1, n, past + n] bool, True = visible: every committed row, and the new rows causally. Always
        # explicit: sdpa's own causal flag aligns to the top-left corner, wrong once a cache precedes.
        mask = torch.ones((n, past + n), dtype=torch.bool, device=x.device)
        mask[:, past:] = torch.tril(mask[:, past:])
        out = self.layer(x, attention_mask=mask[None, None], position_ids=pos, past_key_values=cache,
                         use_cache=True, position_embeddings=self._rope(pos, x.dtype))
        cache.length, cache._pending = past + cache._pending, 0
        return out[0]
