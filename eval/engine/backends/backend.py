"""The contract every base backend (`hf`, `fast`) implements for the speculative decoder.

Batch size is 1 throughout the decoder. The backend owns the base model's KV cache. Positions are
explicit: a tree node at depth k (root depth 0) gets position `cache_len + k`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Backend(ABC):
    """Frozen base model + KV cache, driven one step at a time."""

    vocab_size: int
    hidden_size: int
    device: torch.device
    # EAGLE-3 reads the base's residual stream after some layers (HF output_hidden_states[l]). After
    # set_aux_layers(ids), every prefill / forward_tree also leaves last_aux [N, len(ids)*d] (layer by layer in
    # the given order) for the rows it returned; () = off (the default: no extra work).
    aux_layers: tuple[int, ...] = ()
    last_aux: torch.Tensor | None = None

    def set_aux_layers(self, ids) -> None:
        """Capture the residual stream after base layers `ids` on every forward (see `aux_layers`)."""
        if tuple(ids):
            raise NotImplementedError(f"{type(self).__name__} cannot return aux hidden states (EAGLE-3); use "
                                      "backend=hf or backend=fast")
        self.aux_layers, self.last_aux = (), None

    def _check_aux_ids(self, ids, num_layers: int) -> tuple[int, ...]:
        ids = tuple(int(i) for i in ids)
        if any(not 0 <= i < num_layers for i in ids):
            raise ValueError(f"aux layer ids {list(ids)} must lie in [0, {num_layers - 1}] for this "
                             f"{num_layers}-layer base; the draft was trained on another base?")
        return ids

    @abstractmethod
    def reset(self, max_len: int) -> None:
        """Forget the cache; get ready for a sequence of at most `max_len` tokens (prompt + new + tree)."""

    @property
    @abstractmethod
    def cache_len(self) -> int:
        """Number of committed tokens whose K/V are in the cache."""

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt `input_ids` [T] (cache must be empty); append its K/V to the cache.

        Returns (logits [T, V] fp32, hidden [T, d]) where hidden is the last hidden state after the
        final norm (the lm_head input), so logits == lm_head(hidden).
        """

    @abstractmethod
    def forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One verification pass over N tree tokens, appended *tentatively* after the cache.

        tokens [N] long, depths [N] long (position = cache_len + depth), tree_mask [N, N] bool
        (True where node i may attend node j: its ancestors and itself). Every node sees the whole
        committed prefix. Returns (logits [N, V] fp32, hidden [N, d]). The N new K/V entries sit at
        slots cache_len .. cache_len+N-1 until `commit` is called.
        """

    @abstractmethod
    def commit(self, keep: torch.Tensor) -> None:
        """Keep only tree nodes `keep` [m] (indices into the last forward_tree's nodes, in path
        order root first): gather their K/V into slots cache_len .. cache_len+m-1, drop the rest,
        and advance cache_len by m."""
