"""`hf` backend: any transformers causal LM, tree verification through a custom 4D attention mask.

Per step the model's decoder (`model.model`) runs over the tree tokens with
- position_ids = cache_len + depth (siblings share a position, like RoPE would see them on their path),
- a float mask [1, 1, N, cache_len + N]: 0 where visible (whole committed prefix + own ancestors and
  itself), dtype-min elsewhere; transformers passes a 4D mask through to sdpa / eager unchanged,
- a `DynamicCache` whose per-layer `keys` / `values` [1, H_kv, S, hd] we crop and gather in `commit`.
Logits come from `model.lm_head` on the post-norm hidden state; the constructor checks once that this
reproduces `model(...).logits` (models with logit soft-capping or scaling would fail that check).

This backend allocates per step (DynamicCache concatenates); it is the reference that the static-KV
`fast` backend is checked against.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from eval.backends.base import BaseBackend

_MASKABLE_ATTENTION = ("sdpa", "eager")


class HFBackend(BaseBackend):
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
        self._cache: DynamicCache | None = None
        self._len = 0  # committed tokens
        self._pending = 0  # tentative tree tokens after them (0 when nothing awaits commit)
        self._max_len = 0
        if check_logits:
            self._check_logits()

    # -- contract -----------------------------------------------------------------------------------

    def reset(self, max_len: int) -> None:
        self._cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(self._cache.layers):
            if type(layer) is not DynamicLayer:
                raise ValueError(f"layer {i} uses {type(layer).__name__}; HFBackend can only gather plain "
                                 "DynamicLayer caches (no sliding windows / linear attention)")
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
        return self.lm_head(hidden).float(), hidden

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
        mask = tree_attention_mask(tree_mask.to(self.device), self._len, self.dtype)
        pos = self._len + depths.to(self.device).long()
        hidden = self._run(tokens.to(self.device).long(), pos, mask)
        self._pending = n
        return self.lm_head(hidden).float(), hidden

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor) -> None:
        self._need_cache()
        keep = keep.to(self.device).long().reshape(-1)
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= self._pending):
            raise ValueError(f"commit indices must be in [0, {self._pending}) (nodes of the last "
                             f"forward_tree), got {keep.tolist()}")
        idx = torch.cat([torch.arange(self._len, device=self.device), self._len + keep])
        for layer in self._cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(2, idx)
                layer.values = layer.values.index_select(2, idx)
        self._len += int(keep.numel())
        self._pending = 0

    # -- helpers ------------------------------------------------------------------------------------

    def committed_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [H_kv, cache_len, hd] of the committed tokens (for tests)."""
        self._need_cache()
        n = self._len
        return [(layer.keys[0, :, :n], layer.values[0, :, :n]) for layer in self._cache.layers]

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
        got = self.lm_head(self.decoder(input_ids=ids).last_hidden_state[0]).float()
        tol = 1e-4 if self.dtype == torch.float32 else 5e-2
        if not torch.allclose(got, want, atol=tol, rtol=tol):
            raise ValueError(f"{type(self.model).__name__}: lm_head(model.model(x)) differs from "
                             f"model(x).logits by {float((got - want).abs().max()):.3g}; the model "
                             "post-processes logits "
                             "(soft-capping / scaling?) which HFBackend does not reproduce")


def tree_attention_mask(tree_mask: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """tree_mask [N, N] bool -> additive float mask [1, 1, N, prefix_len + N]: 0 = visible, dtype-min =
    hidden. Every node sees the whole prefix; among tree slots only its ancestors and itself."""
    n = tree_mask.shape[0]
    out = torch.zeros((1, 1, n, prefix_len + n), dtype=dtype, device=tree_mask.device)
    out[0, 0, :, prefix_len:].masked_fill_(~tree_mask, torch.finfo(dtype).min)
    return out
