"""The `fast` backend's core (eval/engine/backends/fast.py): a LLaMA-family forward over N new tokens whose
weights (q/k/v and gate/up fused, stored transposed), RoPE tables and preallocated static KV cache
`[layers, kv_heads, capacity, head_dim]` are module buffers, so torch.compile / CUDA graphs see static addresses.
`FastBackend` owns one and drives its prefill, tree steps and commits.
"""

from __future__ import annotations

import ctypes
import sys

import torch
import torch.nn.functional as F
from torch import nn

from eval.engine.backends.fast_matmul import fp32_layout, matmul_wx, matmul_xw
from eval.engine.backends.fast_support import DYNAMIC_ROPE_TYPES, layer_windows

# Per-layer tensors in the order `_LlamaCore.run_layers` unpacks them (biases and q/k norms may be None).
# ln2 is the norm in front of the MLP; pan / pfn the norms after attention / MLP (Gemma; else None).
_LAYER_TENSORS = ("ln1", "wqkv", "bqkv", "qn", "kn", "wo", "bo", "pan", "ln2", "wgu", "bgu", "wd", "bd", "pfn")

# Spare slots after max_len for static-mode padding: enough for any tree of up to 65 nodes (the
# 63-node Medusa tree pads to 64) wherever the cache stands.
_STATIC_PAD_ROOM = 64


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _huge_page_copy(x: torch.Tensor) -> torch.Tensor:
    """Contiguous copy of `x`; on Linux CPU placed in memory advised for 2 MiB transparent huge
    pages (where THP is in "madvise" mode, as on the CI boxes, nothing else gets them).

    Why: a decode step streams every weight once (~0.5 GB for SmolLM2 in fp32), i.e. ~130k 4 KiB
    pages; huge pages cut the TLB misses (measured 2-6% faster decode steps on the 2-core box).
    Best effort: any failure falls back to an ordinary copy, which is only slower.
    """
    if x.device.type != "cpu" or not sys.platform.startswith("linux") or x.nbytes < _HUGE_PAGE:
        return x.contiguous()
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        per_page = _HUGE_PAGE // x.element_size()
        # Over-allocate by two huge pages: room for an aligned start and for advising whole pages.
        # Pages are not touched (so not backed) until the copy below faults them in, as huge pages.
        raw = torch.empty(x.numel() + 2 * per_page, dtype=x.dtype)
        skip = (-raw.data_ptr() % _HUGE_PAGE) // x.element_size()
        out = raw[skip:skip + x.numel()]
        length = -(-x.nbytes // _HUGE_PAGE) * _HUGE_PAGE
        if madvise(out.data_ptr(), length, _MADV_HUGEPAGE) != 0:
            return x.contiguous()
        return out.view(x.shape).copy_(x)
    except (OSError, AttributeError):
        return x.contiguous()


def _bucket(n: int) -> int:
    """Smallest power of two >= n: the padded tree size of the static (compiled) mode."""
    return 1 << (n - 1).bit_length()


class _LlamaCore(nn.Module):
    """Weights, RoPE tables and the KV cache as buffers (so torch.compile / CUDA graphs treat them
    as static addresses), plus one forward over N new tokens."""

    def __init__(self, hf_model: nn.Module, capacity: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        cfg = hf_model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.groups = self.n_heads // self.n_kv  # query heads per K/V head (GQA)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = float(cfg.rms_norm_eps)
        self.dims = (cfg.hidden_size,)  # normalized_shape for F.rms_norm
        # Sliding windows: one W shared by every sliding layer (all supported configs have one).
        self.windows = layer_windows(cfg)
        self.window = next((w for w in self.windows if w is not None), None)
        self.is_sliding = [w is not None for w in self.windows]
        self.gemma = cfg.model_type == "gemma3_text"
        # Gemma: attention scale query_pre_attn_scalar^-1/2 (None = sdpa's default 1/sqrt(hd)) and the
        # soft-cap of the final logits; GELU-tanh instead of SiLU.
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5 if self.gemma else None
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if self.gemma else F.silu
        base = hf_model.model

        def t(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.detach().to(device=device, dtype=dtype)

        def nw(norm: nn.Module | None) -> torch.Tensor | None:
            """RMSNorm weight as F.rms_norm wants it: Gemma's norms scale by (1 + w), in fp32 first."""
            if norm is None:
                return None
            return t(norm.weight.detach().float() + 1.0) if self.gemma else t(norm.weight)

        # Matmul weights are stored transposed, [in, out], and applied as `x @ W_t`: on CPU (MKL)
        # that runs 1.3-2x faster than F.linear's [out, in] layout for N=1 (SmolLM2's lm_head:
        # 4.3 vs 7.4 ms), the decode case. For prompt-sized N it is ~20% slower, which only touches
        # prefill. On CUDA both layouts are plain cuBLAS GEMMs.
        # bf16/fp16 are the other way round: oneDNN's fast low-precision GEMV wants the [out, in] rows
        # (lm_head 1.9 ms as x @ W.T vs 4.4 ms from a transposed copy), so they keep F.linear's layout
        # and hand the matmul a transposed *view* (same `x @ W_t` call sites, no copy).
        # fp32 on a CPU whose MKL prefers the transposed product (fp32_layout "wx"): the body's weights keep their
        # [out, in] layout too, and matmul_wx computes (W @ x^T)^T; the lm_head keeps both layouts (below).
        low_precision = dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"
        self.wx = dtype == torch.float32 and fp32_layout(device) == "wx"
        row_layout = low_precision or self.wx

        def tt(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            return _huge_page_copy(t(x)).t() if row_layout else _huge_page_copy(t(x).t())

        self.register_buffer("embed", t(base.embed_tokens.weight), persistent=False)  # [V, d]
        # [d, V]; with tied embeddings this is the one extra copy of the embedding we keep. In "wx" mode a 1-row
        # product is still fastest as x @ W_t from this contiguous copy (4.3 vs 8.1 ms for SmolLM2's lm_head),
        # wider ones read lm_head_w, the [V, d] rows (the embedding itself when tied: no extra copy).
        head = hf_model.lm_head.weight
        self.register_buffer("lm_head_t", _huge_page_copy(t(head).t()) if self.wx else tt(head), persistent=False)
        tied = head.data_ptr() == base.embed_tokens.weight.data_ptr()
        self.register_buffer("lm_head_w", (self.embed if tied else t(head)) if self.wx else None, persistent=False)
        self.register_buffer("final_norm", nw(base.norm), persistent=False)
        # Gemma multiplies embeddings by sqrt(d), rounded to the weight dtype first (as transformers does).
        scale = getattr(base.embed_tokens, "embed_scale", None)
        self.register_buffer("embed_scale", None if scale is None else t(torch.as_tensor(scale)), persistent=False)

        # Per-layer fused weights. Stored as separately named buffers (layer count is small and
        # fixed); `self.layers` keeps plain tuples of them for a cheap Python loop.
        self.layers: list[tuple] = []
        for i, layer in enumerate(base.layers):
            att, mlp = layer.self_attn, layer.mlp
            # [(H + 2*Hkv) * hd, d] (stored transposed): one matmul gives q, k and v of every head.
            wqkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], 0)
            bqkv = None
            if att.q_proj.bias is not None:
                bqkv = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias], 0)
            # [2 * I, d] (stored transposed): gate rows first, then up rows.
            wgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
            bgu = None
            if mlp.gate_proj.bias is not None:
                bgu = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias], 0)
            # Qwen3 / Gemma-3: RMSNorm over head_dim on every q and k head, before RoPE ([hd] weights).
            qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
            if self.gemma:  # norms around both sublayers: input / post-attention / pre-FFN / post-FFN
                ln1, pan = layer.input_layernorm, layer.post_attention_layernorm
                ln2, pfn = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
            else:  # LLaMA's "post_attention_layernorm" is the norm in front of the MLP
                ln1, ln2, pan, pfn = layer.input_layernorm, layer.post_attention_layernorm, None, None
            tensors = (nw(ln1), tt(wqkv), t(bqkv), nw(qn), nw(kn), tt(att.o_proj.weight), t(att.o_proj.bias),
                       nw(pan), nw(ln2), tt(wgu), t(bgu), tt(mlp.down_proj.weight), t(mlp.down_proj.bias), nw(pfn))
            for name, x in zip(_LAYER_TENSORS, tensors):
                self.register_buffer(f"l{i}_{name}", x, persistent=False)
        self._bind_layers()

        # RoPE: the model's own inverse frequencies (this already applies linear / llama3 / yarn
        # scaling from the config) and its attention scaling, tabulated for every slot.
        # Gemma-3 keeps one (inv_freq, scaling) per layer type (local layers use a smaller base): one
        # cos/sin table each, and `rope_ids[i]` says which table layer i reads.
        rot = base.rotary_emb
        from eval.engine.backends.hf import cache_layer_types

        types = cache_layer_types(cfg) if hasattr(rot, "layer_types") else [None] * self.n_layers
        table_types = sorted(set(types), key=str)
        self.rope_ids = [table_types.index(ty) for ty in types]
        self.rope = []  # [(inv_freq [hd/2] fp32, attention scaling)] per table
        for ty in table_types:
            rope_type = getattr(rot, "rope_type", "default")
            rope_type = rope_type.get(ty, "default") if isinstance(rope_type, dict) else rope_type
            if rope_type in DYNAMIC_ROPE_TYPES:
                raise NotImplementedError(
                    f"fast backend: rope_type={rope_type!r} rescales frequencies with the sequence length, "
                    "which a static cos/sin table cannot follow; use backend=hf for this model")
            inv = getattr(rot, "inv_freq" if ty is None else f"{ty}_inv_freq")
            scaling = getattr(rot, "attention_scaling" if ty is None else f"{ty}_attention_scaling", 1.0)
            inv = inv.detach().float().to(device)
            if inv.numel() * 2 != self.head_dim:
                raise NotImplementedError(
                    f"fast backend: RoPE covers {inv.numel() * 2} of {self.head_dim} head dims "
                    "(partial rotary); only full-head RoPE is implemented, use backend=hf")
            self.rope.append((inv, float(scaling)))
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.allocate(capacity)

    def _layer_tensors(self) -> list[tuple]:
        return [tuple(getattr(self, f"l{i}_{n}") for n in _LAYER_TENSORS) for i in range(self.n_layers)]

    def _bind_layers(self) -> None:
        # Eager fast path: a plain list of tuples avoids ~300 nn.Module attribute lookups per step.
        self.layers = self._layer_tensors()

    def allocate(self, capacity: int) -> None:
        """(Re)build the KV buffers and RoPE tables for `capacity` slots. Called at construction
        and only when a longer sequence is requested, never per step."""
        # zeros, not empty: stale slots are masked out, but 0 * NaN garbage would still be NaN.
        shape = (self.n_layers, self.n_kv, capacity, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=self.dtype, device=self.device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=self.dtype, device=self.device),
                             persistent=False)
        cos, sin = self.rope_tables(capacity)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.capacity = capacity
        # Per-layer [Hkv, capacity, hd] views, made once here instead of two selects per layer-step.
        self.cache_views = [(self.k_cache[i], self.v_cache[i]) for i in range(self.n_layers)]

    def rope_tables(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [tables, capacity, hd] in the core's dtype, one table per RoPE variant (one, except for
        Gemma-3's two); sin has the first half negated (see below). Also used by eval/engine/batch_generate.py."""
        # Same arithmetic as transformers (fp32 angles, cast last), so fp32 parity is exact.
        coss, sins = [], []
        half = self.head_dim // 2
        for inv_freq, attn_scaling in self.rope:
            freqs = torch.arange(capacity, device=self.device, dtype=torch.float32)[:, None] * inv_freq
            emb = torch.cat([freqs, freqs], -1)  # [capacity, hd]
            cos = emb.cos() * attn_scaling
            sin = emb.sin() * attn_scaling
            # rotate_half(x) * sin == roll(x, hd/2) * cat(-sin1, sin2): saves the negation per call.
            coss.append(cos)
            sins.append(torch.cat([-sin[:, :half], sin[:, half:]], -1))
        return torch.stack(coss).to(self.dtype), torch.stack(sins).to(self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None, kv_len: int, win_mask: torch.Tensor | None = None,
                aux_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """tokens, positions, slots [N] long; mask [G*N, kv_len] bool (rows ordered group-major,
        see `group_mask`) or None for "see every slot"; win_mask: the same for sliding-window layers
        (mask with the window applied; None = use `mask`); new K/V are written at `slots`, then every
        query attends over slots [0, kv_len). aux_ids: base layers whose input residual stream EAGLE-3 reads
        (see `run_layers`). Returns (logits [N, V] fp32, hidden [N, d], aux [N, len(aux_ids)*d] or None).

        The aux states are an output, not a side effect: a compiled graph and a CUDA-graph replay return them
        like the logits (aux_ids is a constant of the graph: torch.compile specialises on it)."""
        n = tokens.shape[0]
        H, Hkv, G, hd, scale = self.n_heads, self.n_kv, self.groups, self.head_dim, self.scale
        caches = self.cache_views
        if torch.compiler.is_compiling():  # buffers by name: static addresses, see run_layers
            caches = [(self.k_cache[i], self.v_cache[i]) for i in range(self.n_layers)]
        layer_masks = [win_mask if sliding and win_mask is not None else mask for sliding in self.is_sliding]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = caches[i]  # [Hkv, capacity, hd]
            kc.index_copy_(1, slots, k.transpose(0, 1))
            vc.index_copy_(1, slots, v.transpose(0, 1))
            # GQA without repeating K/V: query head j*G+g uses K/V head j, so [H, N, hd] viewed as
            # [Hkv, G*N, hd] puts all queries of one K/V head in one row block (order g, n).
            q = q.transpose(0, 1).reshape(1, Hkv, G * n, hd)
            o = F.scaled_dot_product_attention(q, kc.narrow(1, 0, kv_len).unsqueeze(0),
                                               vc.narrow(1, 0, kv_len).unsqueeze(0),
                                               attn_mask=layer_masks[i], scale=scale)  # [1, Hkv, G*N, hd]
            # [Hkv, G*N, hd] -> [N, H*hd] with head h = j*G + g. unflatten, not view: CUDA's flash/efficient
            # kernels return o laid out as [1, G*N, Hkv, hd] (transposed strides), which no view of
            # [H, N, hd] can read; splitting one dim is a view for any strides.
            return o[0].unflatten(1, (G, n)).permute(2, 0, 1, 3).reshape(n, H * hd)

        x, aux = self.run_layers(tokens, positions, self.cos, self.sin, attend, aux_ids)
        logits, hidden = self.head(x)
        return logits, hidden, aux

    def run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend, aux_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding and every decoder layer over N flat tokens; returns the residual stream x [N, d] after the
        last layer (before the final norm, see `head`). cos / sin: RoPE tables [tables, >= max position + 1, hd]
        (`rope_tables`). Attention is the caller's: `attend(i, q [N, H, hd], k [N, Hkv, hd], v [N, Hkv, hd])
        -> [N, H*hd]` for layer i, with q and k already normed and rotated; it stores k / v wherever its cache
        keeps them and attends with its own masks (`forward` here, FastBatchGenerator's per-row cache in
        eval/engine/batch_generate.py). Returns (x, aux): aux [N, len(aux_ids)*d] is the residual stream entering each
        layer of `aux_ids` (EAGLE-3's low / mid / high states), concatenated in aux_ids' order; None without aux_ids."""
        # Every aten call costs a few microseconds of dispatch, ~35 of them per layer: the loop
        # below is written to keep that count low (fused matmuls, views over copies, no K/V repeat).
        n = tokens.shape[0]
        H, Hkv, hd, eps, dims, act = self.n_heads, self.n_kv, self.head_dim, self.eps, self.dims, self.act
        coss = cos[:, positions].unsqueeze(2)  # [tables, N, 1, hd], broadcast over heads
        sins = sin[:, positions].unsqueeze(2)
        x = F.embedding(tokens, self.embed)  # [N, d]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        layers = self.layers
        if torch.compiler.is_compiling():
            # Read the registered buffers by name so the compiler sees them as module state (static
            # addresses for CUDA graphs), not as loose tensors it would copy in on every replay.
            layers = self._layer_tensors()
        aux = []
        _mm = matmul_wx if self.wx else matmul_xw
        for i, ((ln1, wqkv, bqkv, qn, kn, wo, bo, pan, ln2, wgu, bgu, wd, bd, pfn), r) in enumerate(
                zip(layers, self.rope_ids)):
            if i in aux_ids:  # EAGLE-3: the residual stream after i layers, before layer i
                aux.append(x)
            h = F.rms_norm(x, dims, ln1, eps)
            qkv = _mm(h, wqkv, bqkv).view(n, H + 2 * Hkv, hd)
            # RoPE on q and k together (adjacent heads of the fused output): x*cos + rot(x)*sin.
            qk = qkv[:, : H + Hkv]
            if qn is not None:  # Qwen3 / Gemma-3: per-head RMSNorm of q and of k first
                qk = torch.cat([F.rms_norm(qk[:, :H], (hd,), qn, eps), F.rms_norm(qk[:, H:], (hd,), kn, eps)], 1)
            qk = torch.addcmul(qk * coss[r], qk.roll(hd // 2, -1), sins[r])  # [N, H + Hkv, hd]
            o = attend(i, qk[:, :H], qk[:, H:], qkv[:, H + Hkv:])  # [N, H*hd]
            if pan is None:
                x = _mm(o, wo, bo, residual=x)
            else:  # Gemma: normalise the attention output before the residual add
                x = x + F.rms_norm(_mm(o, wo, bo), dims, pan, eps)
            h = F.rms_norm(x, dims, ln2, eps)
            gate, up = _mm(h, wgu, bgu).chunk(2, -1)  # [N, I] each
            if pfn is None:
                x = _mm(act(gate).mul_(up), wd, bd, residual=x)
            else:
                x = x + F.rms_norm(_mm(act(gate).mul_(up), wd, bd), dims, pfn, eps)
        if not aux_ids:
            return x, None
        found = dict(zip(sorted(set(aux_ids)), aux))  # collected in layer order; returned in aux_ids' order
        return x, torch.cat([found[i] for i in aux_ids], -1)  # [N, k*d]

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x [M, d] (of run_layers, or rows of it) -> (logits [M, V] fp32, hidden [M, d]): the final
        norm, the lm_head, Gemma's soft-cap."""
        hidden = F.rms_norm(x, self.dims, self.final_norm, self.eps)
        if self.wx and x.shape[0] > 1:  # fp32 "wx" layout, full vocab for every row: (W [V, d] @ h^T)^T
            logits = torch.mm(self.lm_head_w, hidden.t()).t().contiguous()
        else:
            logits = torch.mm(hidden, self.lm_head_t).float()
        if self.softcap:  # Gemma: cap * tanh(z / cap)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits, hidden

    def group_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[N, S] per-node mask -> [G*N, S] rows for the grouped GQA query layout."""
        return mask.repeat(self.groups, 1) if self.groups > 1 else mask

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V of slots `src` [m] to slots `dst` [m], all layers at once."""
        self.k_cache.index_copy_(2, dst, self.k_cache.index_select(2, src))
        self.v_cache.index_copy_(2, dst, self.v_cache.index_select(2, src))
