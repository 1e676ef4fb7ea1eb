"""Medusa at inference: K independent heads read h_t, each gives its top-k, a static tree combines them.

Head k (index k-1) predicts x_{t+1+k}, i.e. the depth-k nodes (the root x_{t+1} is the base's own
token). Heads are independent, so a node's token depends only on (depth, rank): one top-k per head,
gathered into the fixed tree by `StaticTree.fill`. Children are deterministic picks, so rejection
sampling treats them as point masses (no draft_probs needed).
"""

from __future__ import annotations

import torch
from torch import nn

from eval.drafters.base import DecodeState, Drafter
from eval.tree import StaticTree, Tree


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: nn.Module, tree: StaticTree):
        """heads: module with forward(hidden [n, d]) -> logits [K, n, V] (models.medusa.MedusaDraft)."""
        self.heads = heads.eval()
        self.tree = tree
        self.max_nodes = tree.num_nodes
        num_heads = getattr(heads, "num_heads", None)
        if num_heads is not None and num_heads < tree.depth:
            raise ValueError(f"the tree is {tree.depth} deep but the Medusa module has only {num_heads} "
                             "heads; use a shallower tree (e.g. 'chain4' needs 4 heads)")
        param = next(heads.parameters(), None)
        self._dtype = param.dtype if param is not None else None

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        if self.tree.depth == 0:
            return self.tree.fill(state.root, torch.zeros(0, 0, dtype=torch.long))
        h = state.last_hidden[None]  # [1, d]
        if self._dtype is not None:
            h = h.to(self._dtype)
        logits = self.heads(h)  # [K, 1, V]
        logits = logits.reshape(logits.shape[0], -1, logits.shape[-1])[:, -1]  # [K, V]
        if logits.shape[0] < self.tree.depth:
            raise ValueError(f"heads returned {logits.shape[0]} heads, the tree needs {self.tree.depth}")
        topk = logits[: self.tree.depth].topk(self.tree.topk, dim=-1).indices  # [D, k], rank order
        return self.tree.fill(state.root, topk)
