"""`hf` backend: any transformers causal LM, tree verification through a custom 4D attention mask.

Per step the model's decoder (`model.model`) runs over the tree tokens with
- position_ids = cache_len + depth (siblings share a position, like RoPE would see them on their path),
- a float mask [1, 1, N, keys]: 0 where visible (committed prefix + own ancestors and itself, within
  the layer's window), dtype-min elsewhere; transformers passes a 4D mask through to sdpa / eager
  unchanged. Models whose layers mix full and sliding-window attention (Gemma-2/3, Qwen2 with
  max_window_layers, ...) get a dict {layer type: mask}, which their decoder uses as is;
- the model's own `DynamicCache(config=...)`: `DynamicLayer` for full attention, whose keys / values
  [1, H_kv, S, hd] hold every committed token, and `DynamicSlidingWindowLayer` for sliding windows of
  W tokens, which holds only the last W-1 committed tokens (all a query at the next position can
  see). Sliding layers run with past recording on, so a tree pass appends all N nodes without
  dropping the prefix; `commit` gathers prefix + accepted nodes in every layer and trims sliding
  layers back to their last W-1 entries.
A query at position p sees a key at position k of a sliding layer iff p - W < k <= p (transformers'
`sliding_window_overlay`); for a tree node that is its own depth, not its slot.

Cache layer types that cannot be tree-verified and rolled back this way raise at reset(): linear
attention / conv / hybrid layers (a recurrent state, not per-token K/V: a tree pass mixes every
branch into one state, which no gather can undo), indexed (sparse top-k) attention, chunked attention
(Llama 4; not implemented) and KV-sharing "dummy" layers (not implemented).

Logits come from `model.lm_head` on the post-norm hidden state, followed by the config's
`final_logit_softcapping` where set (Gemma-2/3); the constructor checks once that this reproduces
`model(...).logits` (other logit post-processing would fail that check).

This backend allocates per step (DynamicCache concatenates); it is the reference that the static-KV
`fast` backend is checked against.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from eval.engine.backends.backend import Backend

_MASKABLE_ATTENTION = ("sdpa", "eager")
FULL, SLIDING = "full_attention", "sliding_attention"
# Cache layer types with no tree-verification support, and why (reported by reset()).
_UNSUPPORTED_LAYERS = {
    "linear_attention": "a recurrent state, not per-token K/V: a tree pass folds every branch into one "
                        "state that no gather can undo",
    "conv": "a convolution state, not per-token K/V: a tree pass cannot be rolled back to one path",
    "hybrid": "linear attention next to attention: its recurrent state cannot be rolled back to one path",
    "hybrid_sliding": "linear attention next to attention: its recurrent state cannot be rolled back to one path",
    "indexed_attention": "sparse (indexer top-k) attention: not implemented",
    "chunked_attention": "chunked (block-local) attention: not implemented",
    "dummy": "KV sharing between layers: not implemented",
}


def cache_layer_types(config) -> list[str]:
    """Per decoder layer: the cache layer type transformers builds for `config` (full_attention,
    sliding_attention, ...)."""
    return list(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])


class HFBackend(Backend):
    def __init__(self, model, check_logits: bool = True):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in _MASKABLE_ATTENTION:
            raise ValueError(f"HFBackend needs an attention implementation that accepts a custom 4D float "
                             f"mask ({' or '.join(_MASKABLE_ATTENTION)}), the model uses {impl!r}; load it "
                             "with attn_implementation='sdpa'")
        decoder = getattr(model, "model", None)
        lm_head = model.get_output_embeddings()
        if decoder is None or lm_head is None:
            raise ValueError(f"{type(model).__name__} has no `.model` decoder and `lm_head`; HFBackend "
                             "needs a causal LM laid out like LlamaForCausalLM")
        self.model = model.eval()
        self.decoder, self.lm_head = decoder, lm_head
        self.vocab_size = int(lm_head.weight.shape[0])
        self.hidden_size = int(lm_head.weight.shape[1])
        self.device = lm_head.weight.device
        self.dtype = lm_head.weight.dtype
        text_cfg = model.config.get_text_config(decoder=True)
        self.softcap = getattr(text_cfg, "final_logit_softcapping", None)  # Gemma-2/3; None elsewhere
        self.layer_types = cache_layer_types(model.config)
        bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        if bad:
            why = "; ".join(f"{t}: {_UNSUPPORTED_LAYERS.get(t, 'unknown cache layer type')}" for t in bad)
            raise ValueError(f"{type(model).__name__} has {', '.join(bad)} layers, which HFBackend cannot "
                             f"tree-verify ({why}); only full and sliding-window attention layers are "
                             "supported. Evaluate this base with plain decoding (the `generate` baseline)")
        self._cache: DynamicCache | None = None
        self._windows: list[int | None] = []  # per layer: None (full attention) or the window W
        self._len = 0  # committed tokens
        self._pending = 0  # tentative tree tokens after them (0 when nothing awaits commit)
        self._max_len = 0
        if check_logits:
            self._check_logits()

    # -- contract -----------------------------------------------------------------------------------

    def reset(self, max_len: int) -> None:
        self._cache = DynamicCache(config=self.model.config)
        self._windows = []
        for i, layer in enumerate(self._cache.layers):
            if type(layer) is DynamicLayer:
                self._windows.append(None)
            elif type(layer) is DynamicSlidingWindowLayer:
                # Keep the whole tree pass until commit() decides which nodes stay (else update()
                # would trim to W-1 entries and drop prefix tokens the accepted path still needs).
                layer.activate_past_recording()
                self._windows.append(int(layer.sliding_window))
            else:
                raise ValueError(f"layer {i} ({self.layer_types[i]}) got a {type(layer).__name__} cache; "
                                 "HFBackend gathers only DynamicLayer and DynamicSlidingWindowLayer caches")
        self._len, self._pending, self._max_len = 0, 0, int(max_len)

    @property
    def cache_len(self) -> int:
        return self._len

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._need_cache()
        if self._len or self._pending:
            raise RuntimeError("prefill needs an empty cache; call reset(max_len) first")
        t = int(input_ids.shape[0])
        self._check_room(t)
        ids = input_ids.to(self.device).long()
        # No explicit mask: an empty cache + plain causal attention is exactly the prompt's mask.
        hidden = self._run(ids, torch.arange(t, device=self.device), None)
        self._len = t
        self._trim_windows()
        return self._logits(hidden), hidden

    @torch.inference_mode()
    def forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        self._need_cache()
        if self._pending:
            raise RuntimeError("forward_tree called twice without commit(); commit the accepted path first")
        n = int(tokens.shape[0])
        if tree_mask.shape != (n, n) or depths.shape != (n,):
            raise ValueError(f"tokens [N], depths [N], tree_mask [N, N] must agree; got "
                             f"{tuple(tokens.shape)}, {tuple(depths.shape)}, {tuple(tree_mask.shape)}")
        self._check_room(n)
        tree_mask, depths = tree_mask.to(self.device), depths.to(self.device).long()
        masks = {}  # one mask per layer type: full layers see every committed key, sliding ones fewer
        for kind, window in {(FULL if w is None else SLIDING): w for w in self._windows}.items():
            if window is None:
                masks[kind] = tree_attention_mask(tree_mask, self._len, self.dtype)
            else:
                stored = min(self._len, window - 1)  # committed keys a sliding layer holds
                masks[kind] = window_tree_attention_mask(tree_mask, depths, self._len, stored, window, self.dtype)
        # One layer type: a plain tensor (every decoder accepts it); mixed: the per-type dict.
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        hidden = self._run(tokens.to(self.device).long(), self._len + depths, mask)
        self._pending = n
        return self._logits(hidden), hidden

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor) -> None:
        self._need_cache()
        keep = keep.to(self.device).long().reshape(-1)
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= self._pending):
            raise ValueError(f"commit indices must be in [0, {self._pending}) (nodes of the last "
                             f"forward_tree), got {keep.tolist()}")
        for layer in self._cache.layers:
            if not (layer.is_initialized and layer.keys.numel()):
                continue
            # The layer holds `stored` committed entries (all of them, or a sliding layer's last W-1)
            # followed by the tree's N; keep those and the accepted nodes, in path order.
            stored = layer.keys.shape[2] - self._pending
            idx = torch.cat([torch.arange(stored, device=self.device), stored + keep])
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)
        self._len += int(keep.numel())
        self._pending = 0
        self._trim_windows()

    # -- helpers ------------------------------------------------------------------------------------

    def committed_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [H_kv, S, hd] of the committed tokens it holds (for tests): all
        cache_len of them in a full layer, the last min(cache_len, W-1) in a sliding one."""
        self._need_cache()
        if self._pending:
            raise RuntimeError("committed_kv() between forward_tree and commit; commit first")
        return [(layer.keys[0], layer.values[0]) for layer in self._cache.layers]

    def _trim_windows(self) -> None:
        """Sliding layers keep only what the next query can see: the last W-1 committed tokens."""
        for layer, window in zip(self._cache.layers, self._windows):
            if window is None or not layer.is_initialized:
                continue
            extra = layer.keys.shape[2] - (window - 1)
            if extra > 0:
                layer.keys = layer.keys[:, :, extra:]
                layer.values = layer.values[:, :, extra:]
            layer.cumulative_length = self._len  # what get_seq_length() reports

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap:  # Gemma: cap * tanh(z / cap), after the lm_head
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def set_aux_layers(self, ids) -> None:
        self.aux_layers = self._check_aux_ids(ids, int(self.model.config.num_hidden_layers))
        self.last_aux = None

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = self.decoder(input_ids=ids[None], attention_mask=mask, position_ids=pos[None],
                           past_key_values=self._cache, use_cache=True, output_hidden_states=bool(self.aux_layers))
        if self.aux_layers:  # hidden_states[l] = output of l layers (0 = embeddings): [T, k*d]
            self.last_aux = torch.cat([out.hidden_states[i][0] for i in self.aux_layers], dim=-1)
        return out.last_hidden_state[0]  # [T, d], after the final norm

    def _need_cache(self) -> None:
        if self._cache is None:
            raise RuntimeError("call reset(max_len) before using the backend")

    def _check_room(self, n: int) -> None:
        if self._len + n > self._max_len:
            raise ValueError(f"cache would hold {self._len + n} tokens but reset() was given max_len="
                               f"{self._max_len}; pass prompt + max_new_tokens + tree size")

    @torch.inference_mode()
    def _check_logits(self) -> None:
        ids = torch.arange(3, device=self.device)[None] % self.vocab_size
        want = self.model(input_ids=ids).logits[0].float()
        got = self._logits(self.decoder(input_ids=ids).last_hidden_state[0])
        tol = 1e-4 if self.dtype == torch.float32 else 5e-2
        if not torch.allclose(got, want, atol=tol, rtol=tol):
            raise ValueError(f"{type(self.model).__name__}: lm_head(model.model(x)) differs from "
                             f"model(x).logits by {float((got - want).abs().max()):.3g}; the model "
                             "post-processes logits "
                             "(scaling?) beyond the final soft-capping HFBackend reproduces")


def tree_attention_mask(tree_mask: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """tree_mask [N, N] bool -> additive float mask [1, 1, N, prefix_len + N]: 0 = visible, dtype-min =
    hidden. Every node sees the whole prefix; among tree slots only its ancestors and itself."""
    n = tree_mask.shape[0]
    out = torch.zeros((1, 1, n, prefix_len + n), dtype=dtype, device=tree_mask.device)
    out[0, 0, :, prefix_len:].masked_fill_(~tree_mask, torch.finfo(dtype).min)
    return out


def window_tree_attention_mask(tree_mask: torch.Tensor, depths: torch.Tensor, prefix_len: int, stored: int,
                               window: int, dtype: torch.dtype) -> torch.Tensor:
    """Mask of a sliding-window layer: [1, 1, N, stored + N] additive float.

    Keys are the last `stored` committed tokens (positions prefix_len - stored .. prefix_len - 1) then
    the N tree nodes (positions prefix_len + depth). Node i at position q = prefix_len + depths[i] sees a
    key at position k iff k > q - window, and a tree key only if it is an ancestor or itself.
    """
    n = tree_mask.shape[0]
    q = prefix_len + depths  # [N] query positions
    k_prefix = torch.arange(prefix_len - stored, prefix_len, device=depths.device)  # [stored]
    visible = torch.cat([k_prefix[None, :] > (q[:, None] - window),  # [N, stored]
                         tree_mask & ((prefix_len + depths)[None, :] > (q[:, None] - window))], 1)  # [N, N]
    out = torch.zeros((1, 1, n, stored + n), dtype=dtype, device=tree_mask.device)
    out[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
    return out
