"""`fast` backend: our own LLaMA-family forward over a preallocated static KV cache.

Architectures (`supports(config)` is the one place that decides): LLaMA, Qwen2 (q/k/v biases, optional
sliding-window layers), Qwen3 (per-head q/k RMSNorm before RoPE, explicit head_dim), Mistral
(sliding window) and Gemma-3 text (sliding/global layer mix with one RoPE table per layer type,
sqrt(d) embedding scale, (1 + w) RMSNorms before and after both sublayers, q/k norms, GELU-tanh,
query_pre_attn_scalar, final logit soft-capping). Sliding-window layers keep every slot in the
static cache, like full ones, and differ only in their mask: a query at position p sees a key at
position k iff p - W < k <= p (tree nodes have position cache_len + depth, committed slots their index).

Why it exists: for a small base (SmolLM2-135M) a decode step streams ~0.5 GB of fp32 weights
through ~150 skinny matmuls, so both the matmul kernel and the per-step overhead (Python, dynamic
cache concatenation, mask building, thread fork/join) matter. This backend reads the weights of a
transformers `LlamaForCausalLM` once, fuses q/k/v and gate/up into single matmuls stored transposed
(the faster CPU kernel for one-row inputs), keeps K/V in one preallocated buffer
`[layers, kv_heads, capacity, head_dim]` (commit = one gather + index_copy inside it, never a new
cache), and uses precomputed RoPE tables. On CPU, `cpu_threads` can pin its intra-op thread count.

Two execution modes:
- eager (CPU default): shapes follow the step exactly (attend over `cache_len + N` slots).
- static (CUDA default, or `compile=True`): the tree is padded to a power-of-two bucket and
  attention runs over the whole buffer with a mask, so every step of a bucket has the same shapes
  and `torch.compile` (CUDA graphs via mode "reduce-overhead" on GPU) can replay it. Prefill
  always runs eager (prompt lengths vary). On CPU, inductor was measured slower than eager for
  SmolLM2 (41 vs 34 ms per decode step; the matmuls dominate), hence eager by default there.

The slow reference twin is the `hf` backend; `tests/test_eval_fast_backend.py` checks logits parity.
"""

from __future__ import annotations

import ctypes
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from eval.engine.backends.backend import Backend
from eval.engine.backends.fast_compile import _compile_step, _CountingCompiler
from eval.engine.backends.fast_matmul import fp32_layout, matmul_wx, matmul_xw
from eval.engine.backends.fast_support import (  # noqa: F401 (FAST_ARCHITECTURES re-exported)
    DYNAMIC_ROPE_TYPES,
    FAST_ARCHITECTURES,
    layer_windows,
    supports,
)

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


class FastBackend(Backend):
    """LLaMA-family base with a static KV cache; see the module docstring.

    hf_model: a transformers `LlamaForCausalLM` (read once; this backend keeps its own fused,
    transposed copy of the matmul weights, ~0.5 GB for SmolLM2 in fp32, and shares the input
    embedding when dtype/device match). max_len: slots reserved for
    prompt + generated tokens + one tree (reset() with a larger value reallocates). dtype / device:
    default to the model's. compile: torch.compile the tree step (default: on for CUDA, off on CPU,
    where eager with exact shapes is faster for a small model). compile_backend: the compiler dynamo hands
    the step to (default inductor, with CUDA graphs on GPU; tests use "eager" / "aot_eager", which compile
    in a fraction of the time). static: pad trees to power-of-two
    buckets and attend over the whole buffer (default: same as compile).
    cpu_threads: torch intra-op threads while this backend computes on CPU (restored afterwards);
    None (default) = torch's global setting, the same the `generate` baseline gets. On an idle 2-core
    box 2 threads decode SmolLM2 as fast as 1 in fp32 (memory-bound) and 1.5x faster in bf16; on a box
    shared with other busy processes every fork waits for a descheduled thread (measured: 250 ms vs
    35 ms per step), where cpu_threads=1 is the robust choice.
    """

    def __init__(self, hf_model: nn.Module, max_len: int = 2048, dtype: torch.dtype | None = None,
                 compile: bool | None = None, device: torch.device | str | None = None,
                 static: bool | None = None, cpu_threads: int | None = None, compile_backend: str = "inductor"):
        cfg = hf_model.config
        ok, why = supports(cfg)
        if not ok:
            raise ValueError(why)
        ref = hf_model.get_input_embeddings().weight
        self.device = torch.device(device) if device is not None else ref.device
        self.dtype = dtype or ref.dtype
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.compile = (self.device.type == "cuda") if compile is None else bool(compile)
        # Static shapes go with compilation: that is what lets one graph serve every step. (Tests
        # force static=True without compiling to check the padding logic on CPU.)
        self.static = self.compile if static is None else bool(static)
        with torch.no_grad():  # the fused copies must not record autograd history
            self._core = _LlamaCore(hf_model, self._capacity_for(max_len), self.dtype, self.device).eval()
        self._step = self._core.forward
        self._compiler: _CountingCompiler | None = None
        if self.compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._compiler = _CountingCompiler(compile_backend, mode)
            self._step = _compile_step(self._core.forward, self._compiler)
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads={cpu_threads}: pass a positive thread count, or None to use "
                             "torch's global setting")
        self.cpu_threads = cpu_threads if self.device.type == "cpu" else None
        self._max_len = max_len
        self._len = 0
        self._last_n = 0  # nodes of the last forward_tree, awaiting commit
        # Static tree steps that ran a compiled graph, and those that compile was on for but ran eagerly (dynamo
        # disabled or gave up): counted from the compiled code itself, so a test can tell compiled from not.
        self.compiled_steps = 0
        self.eager_steps = 0

    @property
    def compiled_graphs(self) -> int:
        """Graphs dynamo compiled for this backend's tree step (0 when compile is off)."""
        return self._compiler.graphs if self._compiler is not None else 0

    def compile_report(self) -> dict:
        """What compilation did for this backend: graphs compiled, static steps that ran one, steps that fell back to
        eager. `ran_compiled`: compile is on, at least one step ran a compiled graph and none fell back."""
        ran = self.compile and self.compiled_steps > 0 and self.eager_steps == 0
        return {"compile": self.compile, "graphs": self.compiled_graphs, "compiled_steps": self.compiled_steps,
                "eager_steps": self.eager_steps, "ran_compiled": ran}

    def set_aux_layers(self, ids) -> None:
        ids = self._check_aux_ids(ids, self._core.n_layers)
        # The compiled step takes the ids as an argument and returns the aux states, so compilation and CUDA
        # graphs stay on: a new set of ids compiles (once per bucket) a graph of its own.
        self.aux_layers = ids
        self.last_aux = None

    def _capacity_for(self, max_len: int) -> int:
        # Static mode pads a tree up to a power of two; the padding's K/V land in spare slots past
        # max_len. A step whose padding does not fit runs eager instead (see forward_tree).
        return max_len + _STATIC_PAD_ROOM if self.static else max_len

    # -- contract -----------------------------------------------------------------------------

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"reset(max_len={max_len}): max_len must be >= 1")
        need = self._capacity_for(max_len)
        if need > self._core.capacity:  # grow once; later resets reuse the buffer
            self._core.allocate(need)
        self._max_len = max_len
        self._len = 0
        self._last_n = 0

    @contextmanager
    def _compute(self):
        """No autograd, and cpu_threads intra-op threads for the duration of one call."""
        saved = torch.get_num_threads()
        change = self.cpu_threads is not None and self.cpu_threads != saved
        if change:
            torch.set_num_threads(self.cpu_threads)
        try:
            with torch.inference_mode():
                yield
        finally:
            if change:
                torch.set_num_threads(saved)

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self._compute():
            return self._prefill(input_ids)

    def forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._compute():
            return self._forward_tree(tokens, depths, tree_mask)

    def commit(self, keep: torch.Tensor) -> None:
        with self._compute():
            self._commit(keep)

    # -- implementation -------------------------------------------------------------------------

    def _prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"prefill expects a non-empty 1-D token tensor [T], got shape "
                             f"{tuple(input_ids.shape)}; drop the batch dim (batch size is 1)")
        if self._len != 0:
            raise RuntimeError(f"prefill needs an empty cache but cache_len={self._len}; call reset() first")
        t = input_ids.numel()
        self._check_room(t, "prefill")
        ids = input_ids.to(self.device)
        pos = torch.arange(t, device=self.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril_()
        win = self._window_mask(causal, pos, pos)
        # Eager even in static mode: prompt lengths vary, a graph per length would not pay off.
        logits, hidden, self.last_aux = self._core(ids, pos, pos, self._core.group_mask(causal), t, win,
                                                   self.aux_layers)
        self._len = t
        self._last_n = 0
        return logits, hidden

    def _forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        n = tokens.numel()
        if tokens.dim() != 1 or n == 0 or depths.shape != tokens.shape or tree_mask.shape != (n, n):
            raise ValueError(
                f"forward_tree expects tokens [N], depths [N], tree_mask [N, N]; got "
                f"{tuple(tokens.shape)}, {tuple(depths.shape)}, {tuple(tree_mask.shape)}")
        if self._last_n:
            raise RuntimeError("forward_tree called twice without commit(); commit the accepted path "
                               "first (commit(torch.tensor([], dtype=torch.long)) drops the whole tree)")
        self._check_room(n, "forward_tree")
        c, dev = self._len, self.device
        tokens, depths = tokens.to(dev), depths.to(dev)
        tree_mask = tree_mask.to(device=dev, dtype=torch.bool)
        if self.static and c + _bucket(n) <= self._core.capacity:
            logits, hidden = self._static_step(tokens, depths, tree_mask)
        else:
            kv_len = c + n
            slots = torch.arange(c, kv_len, device=dev)
            visible = torch.ones(n, kv_len, dtype=torch.bool, device=dev)
            visible[:, c:] = tree_mask
            win = None
            if self._core.window is not None:  # key positions: slots for the prefix, c + depth in the tree
                kpos = torch.cat([torch.arange(c, device=dev), c + depths])
                win = self._window_mask(visible, c + depths, kpos)
            # A lone root sees the prefix and itself, everything in [0, c+1): no mask needed.
            mask = None if n == 1 else self._core.group_mask(visible)
            # Not self._step: a compiled step is specialised to the static shapes.
            logits, hidden, self.last_aux = self._core(tokens, c + depths, slots, mask, kv_len, win, self.aux_layers)
        self._last_n = n
        return logits, hidden

    def _static_step(self, tokens, depths, tree_mask):
        """Pad to a bucket of B nodes and attend over the whole buffer: shapes depend on B only."""
        n, c, dev, cap = tokens.numel(), self._len, self.device, self._core.capacity
        b = _bucket(n)
        pad = b - n
        tok = F.pad(tokens, (0, pad))
        pos = F.pad(c + depths, (0, pad), value=c)
        slots = torch.arange(c, c + b, device=dev)  # padding lands in the reserved spare slots
        mask = torch.zeros(b, cap, dtype=torch.bool, device=dev)
        mask[:, :c] = True
        mask[:n, c:c + n] = tree_mask
        # Padding rows see only themselves, so they stay finite and never touch real nodes.
        idx = torch.arange(n, b, device=dev)
        mask[idx, c + idx] = True
        win = None
        if self._core.window is not None:  # slot positions, with the tree's (and padding's) in place
            kpos = torch.arange(cap, device=dev)
            kpos[c:c + b] = pos
            win = self._window_mask(mask, pos, kpos)
        runs = self._compiler.runs if self._compiler is not None else 0
        logits, hidden, aux = self._step(tok, pos, slots, self._core.group_mask(mask), cap, win, self.aux_layers)
        if self._compiler is not None:
            if self._compiler.runs > runs:
                self.compiled_steps += 1
            else:
                self.eager_steps += 1
        # Copy out of CUDA-graph-owned memory before the next replay overwrites it.
        self.last_aux = None if aux is None else aux[:n].clone()
        return logits[:n].clone(), hidden[:n].clone()

    def _commit(self, keep: torch.Tensor) -> None:
        keep_list = [int(i) for i in keep.reshape(-1).tolist()]
        m, n = len(keep_list), self._last_n
        if n == 0:
            raise RuntimeError("commit() without a pending forward_tree(); call forward_tree first")
        if m > n or (m and (min(keep_list) < 0 or max(keep_list) >= n)):
            raise ValueError(f"commit(keep={keep_list}): need at most {n} node indices in [0, {n}) "
                             f"from the last forward_tree")
        c = self._len
        # Nodes already in place (AR steps, or a path made of the first m nodes) need no copy.
        if keep_list != list(range(m)):
            src = torch.tensor(keep_list, device=self.device) + c
            self._core.compact(src, torch.arange(c, c + m, device=self.device))
        self._len = c + m
        self._last_n = 0

    def _window_mask(self, visible: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor | None:
        """visible [N, S] bool, query positions [N], key positions [S] -> the sliding layers' grouped
        mask [G*N, S]: visible and k > q - W (None when the model has no sliding layer)."""
        if self._core.window is None:
            return None
        return self._core.group_mask(visible & (kpos[None, :] > qpos[:, None] - self._core.window))

    def _check_room(self, n: int, what: str) -> None:
        if self._len + n > self._max_len:
            raise ValueError(
                f"{what}: {n} new tokens after cache_len={self._len} exceed max_len={self._max_len}; "
                f"call reset(max_len) with room for prompt + new tokens + the largest tree")
