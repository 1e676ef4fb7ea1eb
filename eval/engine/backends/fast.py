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

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from eval.engine.backends.backend import Backend
from eval.engine.backends.fast_compile import _compile_step, _CountingCompiler
from eval.engine.backends.fast_core import _STATIC_PAD_ROOM, _bucket, _LlamaCore
from eval.engine.backends.fast_support import FAST_ARCHITECTURES, supports  # noqa: F401 (re-exported)


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
