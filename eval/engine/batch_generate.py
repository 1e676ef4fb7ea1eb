"""`FastBatchGenerator`: batched greedy / sampled generation on the `fast` LLaMA-family core with a static KV cache,
the `fast` engine of `specdraft regenerate` (the `Generator` protocol of data/self_distill.py).

Why: transformers `generate` spends most of a small base's decode step in Python (28 ms per step for SmolLM2 at
batch 1 on a GPU, whatever the batch), so a batch of 256 makes under 1,000 tok/s. Here one decode step is a fixed
sequence of kernels over fixed shapes, replayed as a CUDA graph.

Layout:
- weights and layers: `_LlamaCore` of eval/engine/backends/fast.py (fused q/k/v and gate/up, RoPE tables; its own
  batch-1 KV cache stays at one slot and is never used here). Its `run_layers` is the one layer loop of both; this
  module passes the attention (an `attend` callback over its own per-row cache) and takes logits from `head`;
- KV cache: `[layers, B, kv_heads, capacity, head_dim]`, one row per live sequence (a "slot"). Row b's token at
  position p sits at slot p of row b: every row's positions start at 0, there is no left padding;
- prefill: the new rows of a refill, right padded to the longest of them, in one eager forward that writes their
  K/V at slots [0, T) (the padding's K/V land beyond the row's length, where a later decode step overwrites them
  before any query can see them: a decode query at position p sees slots <= p only);
- decode: one forward of one token for each of the first `width` rows; finished rows are masked out of the result
  and their slots refilled from the queue of waiting prompts (a call may pass more prompts than `batch_size`);
  when the queue is empty and at most half the rows live, the live rows move to the front and the width shrinks.

CUDA: each (width, kv_len bucket) decode step is captured once as a CUDA graph (`torch.cuda.CUDAGraph`) and
replayed; kv_len is the live rows' longest position rounded up to a multiple of KV_BUCKET, so a handful of graphs
serve a whole regeneration. No inductor: the step is a fixed kernel sequence already, and compiling 30 unrolled
layers for every shape would take minutes of a run. CPU: eager with exact shapes (width = live rows, kv_len =
longest position + 1).

Greedy answers are token-identical to transformers `generate` in fp32 (tests/test_batch_generate.py); sampling
(temperature > 0, no top-k / top-p, like HFGenerator) is deterministic for a seed and a batch_size, but draws
differently from `generate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eval.engine.backends.fast import _LlamaCore
from eval.engine.backends.fast_support import supports

CAPACITY_MULTIPLE = 64  # slots per row are rounded up to this, so buffers (and graphs) repeat across calls
KV_BUCKET = 128  # CUDA graphs attend over the live rows' longest position rounded up to this


class BatchOutOfMemory(RuntimeError):
    """The KV cache or a step did not fit the device at this batch size; the message names the size to try, and
    `retry_rows` holds it (the caller names its own flag: `specdraft regenerate --fast-rows`)."""

    def __init__(self, message: str, retry_rows: int):
        super().__init__(message)
        self.retry_rows = retry_rows


def _engine_hint(why: str) -> str:
    return why.replace("use backend=hf for this model", "use --engine hf").replace("use backend=hf", "use --engine hf")


class FastBatchGenerator:
    """Batched generation over a static KV cache on the fast backend's LLaMA-family core.

    model: a transformers causal LM the fast backend supports (LLaMA / SmolLM2, Qwen2, Qwen3, Mistral, Gemma-3
    text); its weights are copied once into the fused layout. eos: end-of-turn token ids (an answer ends with the
    first of them, included). max_new_tokens: the largest per-prompt limit. temperature: 0 = greedy.
    batch_size: rows decoded at once (KV cache rows); a call may pass more prompts, which wait in a queue and take
    the slots of finished rows. prefill_tokens: padded prompt tokens per prefill forward (bounds its activations).
    dtype / device: default to the model's. cuda_graphs: capture the decode step (default: on for CUDA; CPU is
    always eager).
    """

    name = "fast"

    def __init__(self, model, eos: list[int], max_new_tokens: int, temperature: float = 0.0, *,
                 batch_size: int = 256, prefill_tokens: int = 16384, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, cuda_graphs: bool | None = None):
        ok, why = supports(model.config)
        if not ok:
            raise ValueError(f"the fast engine cannot run this base: {_engine_hint(why)}")
        if max_new_tokens < 1 or batch_size < 1 or prefill_tokens < 1 or temperature < 0:
            raise ValueError(f"FastBatchGenerator: need max_new_tokens, batch_size, prefill_tokens >= 1 and "
                             f"temperature >= 0 (got {max_new_tokens}, {batch_size}, {prefill_tokens}, {temperature})")
        ref = model.get_input_embeddings().weight
        self.device = torch.device(device) if device is not None else ref.device
        self.dtype = dtype or ref.dtype
        try:
            with torch.no_grad():  # one-slot batch-1 cache: only the weights and RoPE setup are used
                self.core = _LlamaCore(model, 1, self.dtype, self.device).eval()
        except NotImplementedError as err:  # what only the weights reveal (partial RoPE)
            raise ValueError(f"the fast engine cannot run this base: {_engine_hint(str(err))}") from None
        self.eos, self.max_new_tokens, self.temperature = sorted(set(eos)), max_new_tokens, float(temperature)
        self.batch_size, self.prefill_tokens = batch_size, prefill_tokens
        self.graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {self.device}")
        self.version = f"specdraft-fast {torch.__version__} {str(self.dtype).removeprefix('torch.')} {self.device.type}"
        # KV buffers: allocated on the first call, grown (never shrunk) when a call needs more rows or slots
        self.rows = self.capacity = 0
        self.k_cache = self.v_cache = None
        self._graphs: dict[tuple[int, int], tuple] = {}  # (width, kv_len) -> (graph, logits [width, V])
        self._pool = None
        self._inputs = None  # [2, rows] long on device: tokens, positions (the graphs' static input)

    # -- the Generator protocol ----------------------------------------------------------------------------------

    def __call__(self, prompts: list[list[int]], seed: int, limits: list[int] | None = None) -> list[list[int]]:
        limits = [self.max_new_tokens] * len(prompts) if limits is None else [int(n) for n in limits]
        if len(limits) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(limits)} limits; pass one limit per prompt")
        bad = [i for i, (p, n) in enumerate(zip(prompts, limits)) if not p or not 0 <= n <= self.max_new_tokens]
        if bad:
            i = bad[0]
            raise ValueError(f"prompt {i}: {len(prompts[i])} tokens, limit {limits[i]}; need a non-empty prompt and "
                             f"0 <= limit <= max_new_tokens={self.max_new_tokens}")
        answers: list[list[int]] = [[] for _ in prompts]
        # Longest first: a refill's prompts then have similar lengths (little prefill padding).
        queue = sorted((i for i in range(len(prompts)) if limits[i] > 0), key=lambda i: -len(prompts[i]))
        if not queue:
            return answers
        need = max(len(prompts[i]) + limits[i] for i in queue)
        capacity = -(-need // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE  # slots per row
        rows = min(self.batch_size, len(queue))
        held, slots = max(rows, self.rows), max(capacity, self.capacity)  # what this call runs with (buffers grow)
        try:
            self._ensure(rows, capacity)
            gen = None
            if self.temperature > 0:
                gen = torch.Generator(self.device).manual_seed(seed)
            with torch.inference_mode():
                self._run(prompts, limits, queue, answers, rows, gen)
        except torch.OutOfMemoryError:
            self._release()
            retry = max(1, held // 2)
            raise BatchOutOfMemory(
                f"fast engine: out of {self.device} memory at batch size {held} ({slots} KV slots per row, "
                f"{str(self.dtype).removeprefix('torch.')}); retry with batch size {retry}", retry) from None
        return answers

    # -- buffers -------------------------------------------------------------------------------------------------

    def _ensure(self, rows: int, capacity: int) -> None:
        """KV buffers [layers, >= rows, kv_heads, >= capacity, hd] and RoPE tables of as many slots."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        rows, capacity = max(rows, self.rows), max(capacity, self.capacity)
        self._release()
        c = self.core
        shape = (c.n_layers, rows, c.n_kv, capacity, c.head_dim)
        # zeros, not empty: masked slots still enter the attention product, and 0 * NaN garbage would be NaN.
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cos, self.sin = c.rope_tables(capacity)  # [tables, capacity, hd]
        self._inputs = torch.zeros(2, rows, dtype=torch.long, device=self.device)
        self.rows, self.capacity = rows, capacity

    def _release(self) -> None:
        self._graphs.clear()
        self._pool = None
        self.k_cache = self.v_cache = self._inputs = None
        self.rows = self.capacity = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the loop ------------------------------------------------------------------------------------------------

    def _run(self, prompts, limits, queue, answers, rows: int, gen) -> None:
        """Fill `rows` slots from `queue`, decode, refill finished slots, until every answer is done."""
        owner = [-1] * rows  # slot -> prompt index, -1 = free
        tok, pos = [0] * rows, [0] * rows  # the next token to feed each slot and its position (host copies)
        eos = set(self.eos)
        # Refill when this many slots are free (or none is live): each prefill is an eager forward, so refilling
        # one slot per step would cost more than the idle slots it saves.
        refill_at = max(1, rows // 8)
        width = rows  # slots [0, width) are decoded
        while True:
            free = [b for b in range(width) if owner[b] < 0]
            live = width - len(free)
            if queue and (len(free) >= refill_at or live == 0):
                self._refill(prompts, limits, queue, answers, free, owner, tok, pos, gen, eos)
                live = sum(o >= 0 for o in owner[:width])
            if live == 0:
                if not queue:
                    return
                continue
            if not queue and 2 * live <= width:  # the tail of the call: move the live rows to the front
                width = self._compact(owner, tok, pos, width)
            logits = self._decode(tok[:width], pos[:width])  # [width, V] fp32
            nxt = self._pick(logits, gen).tolist()
            for b in range(width):
                i = owner[b]
                if i < 0:
                    continue
                answers[i].append(nxt[b])
                tok[b], pos[b] = nxt[b], pos[b] + 1
                if nxt[b] in eos or len(answers[i]) >= limits[i]:
                    owner[b], tok[b], pos[b] = -1, 0, 0

    def _refill(self, prompts, limits, queue, answers, free, owner, tok, pos, gen, eos) -> None:
        """Prefill waiting prompts into free slots, in groups of at most prefill_tokens padded tokens; each new
        row's first answer token comes from its prefill."""
        while queue and free:
            group = [queue[0]]  # the queue is sorted longest first: the group's first prompt is its widest
            width = len(prompts[group[0]])
            while (len(group) < len(free) and len(group) < len(queue)
                   and (len(group) + 1) * width <= self.prefill_tokens):
                group.append(queue[len(group)])
            del queue[:len(group)]
            slots = free[:len(group)]
            del free[:len(group)]
            logits = self._prefill([prompts[i] for i in group], slots)  # [R, V]
            first = self._pick(logits, gen).tolist()
            for i, b, t in zip(group, slots, first):
                answers[i].append(t)
                if t in eos or len(answers[i]) >= limits[i]:
                    continue  # done at its first token: the slot stays free
                owner[b], tok[b], pos[b] = i, t, len(prompts[i])

    def _compact(self, owner, tok, pos, width: int) -> int:
        """Move the live rows' K/V, tokens and positions to slots [0, live); return the new width."""
        src = [b for b in range(width) if owner[b] >= 0]
        dst = list(range(len(src)))
        if src != dst:
            s, d = (torch.tensor(x, device=self.device) for x in (src, dst))
            for cache in (self.k_cache, self.v_cache):  # [L, B, Hkv, cap, hd], rows along dim 1
                cache.index_copy_(1, d, cache.index_select(1, s))
            for state in (owner, tok, pos):
                state[:len(src)] = [state[b] for b in src]
            for b in range(len(src), width):
                owner[b], tok[b], pos[b] = -1, 0, 0
        return len(src)

    def _pick(self, logits: torch.Tensor, gen) -> torch.Tensor:
        """[R, V] fp32 logits -> [R] next tokens: argmax (the first of equal maxima, like generate), or a draw
        from softmax(logits / T)."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, -1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1)

    # -- forwards ------------------------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Right-padded prompts [R, T] into cache rows `slots` at slots [0, T); returns the logits [R, V] (fp32)
        at each prompt's last token."""
        c, dev = self.core, self.device
        r, t = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(r, t, dtype=torch.long)
        for k, p in enumerate(prompts):
            ids[k, :len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        rows = torch.tensor(slots, device=dev)
        positions = torch.arange(t, device=dev).expand(r, t).reshape(-1)  # [R*T]
        ar = torch.arange(t, device=dev)
        causal = ar[None, :] <= ar[:, None]  # [T(query), T(key)]
        masks = {None: causal}
        if c.window is not None:
            masks[c.window] = causal & (ar[None, :] > ar[:, None] - c.window)
        G, H, Hkv, hd = c.groups, c.n_heads, c.n_kv, c.head_dim
        # Grouped-query layout: [G*T, T] rows ordered (g, t), the order of q below.
        masks = {w: m.repeat(G, 1) if G > 1 else m for w, m in masks.items()}

        def attend(i, q, k, v):  # q [R*T, H, hd], k / v [R*T, Hkv, hd] -> [R*T, H*hd]
            k, v = k.view(r, t, Hkv, hd).transpose(1, 2), v.view(r, t, Hkv, hd).transpose(1, 2)  # [R, Hkv, T, hd]
            self.k_cache[i, rows, :, :t] = k
            self.v_cache[i, rows, :, :t] = v
            # query head j*G + g uses K/V head j: [R, T, Hkv, G, hd] -> [R, Hkv, G*T, hd], no K/V repeat
            q = q.view(r, t, Hkv, G, hd).permute(0, 2, 3, 1, 4).reshape(r, Hkv, G * t, hd)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[c.windows[i]], scale=c.scale)
            return o.unflatten(2, (G, t)).permute(0, 3, 1, 2, 4).reshape(r * t, H * hd)

        x, _ = c.run_layers(ids.reshape(-1), positions, self.cos, self.sin, attend)  # [R*T, d]
        last = torch.tensor([k * t + len(p) - 1 for k, p in enumerate(prompts)], device=dev)
        return c.head(x.index_select(0, last))[0]  # the prompts' last tokens only: no [R*T, V] logits

    def _decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of the first `width` rows at its position: logits [width, V] fp32."""
        width = len(tokens)
        self._inputs[:, :width].copy_(torch.tensor([tokens, positions]), non_blocking=False)
        if not self.graphs:
            return self._decode_step(width, max(positions) + 1)
        kv_len = min(self.capacity, -(-(max(positions) + 1) // KV_BUCKET) * KV_BUCKET)
        width = min(self.rows, 1 << (width - 1).bit_length())  # graphs for power-of-two widths only
        key = (width, kv_len)
        if key not in self._graphs:
            self._graphs[key] = self._capture(width, kv_len)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:len(tokens)]

    def _capture(self, width: int, kv_len: int):
        """A CUDA graph of `_decode_step(width, kv_len)`, reading tokens / positions from self._inputs. Graphs
        share one memory pool: each replay's logits are consumed before the next replay."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture (library handles, workspaces); it writes
            self._decode_step(width, kv_len)  # the same K/V the replay will write, so it changes nothing
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._decode_step(width, kv_len)
        return graph, logits

    def _decode_step(self, width: int, kv_len: int) -> torch.Tensor:
        """The decode forward on self._inputs[:, :width]; attends over slots [0, kv_len) of each row. Static
        shapes for a (width, kv_len): no host sync inside (CUDA-graph safe)."""
        c, dev = self.core, self.device
        tokens, positions = self._inputs[0, :width], self._inputs[1, :width]
        rows = torch.arange(width, device=dev)
        slot = torch.arange(kv_len, device=dev)
        seen = slot[None, :] <= positions[:, None]  # [width, kv_len]: a row sees its own slots <= its position
        masks = {None: seen[:, None, None, :]}  # [width, 1, 1, kv_len], broadcast over K/V heads and groups
        if c.window is not None:
            masks[c.window] = (seen & (slot[None, :] > positions[:, None] - c.window))[:, None, None, :]
        G, H, Hkv, hd = c.groups, c.n_heads, c.n_kv, c.head_dim

        def attend(i, q, k, v):  # q [width, H, hd], k / v [width, Hkv, hd] -> [width, H*hd]
            kc, vc = self.k_cache[i, :width], self.v_cache[i, :width]  # [width, Hkv, cap, hd]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            q = q.view(width, Hkv, G, hd)  # query head j*G + g uses K/V head j
            o = F.scaled_dot_product_attention(q, kc[:, :, :kv_len], vc[:, :, :kv_len],
                                               attn_mask=masks[c.windows[i]], scale=c.scale)  # [width, Hkv, G, hd]
            return o.reshape(width, H * hd)

        return c.head(c.run_layers(tokens, positions, self.cos, self.sin, attend)[0])[0]
