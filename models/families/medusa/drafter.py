"""Medusa at inference: K independent heads read h_t, each gives its top-k, a static tree combines them.

Head k (index k-1) predicts x_{t+1+k}, i.e. the depth-k nodes (the root x_{t+1} is the base's own
token). Heads are independent, so a node's token depends only on (depth, rank): one top-k per head,
gathered into the fixed tree by `StaticTree.fill`. Children are deterministic picks, so rejection
sampling treats them as point masses (no draft_probs needed).
"""

from __future__ import annotations

import torch
from torch import nn

from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.drafters.options import NoOptions
from eval.engine.drafters.static import (
    depth_widths,
    heads_max_speculative_tokens,
    near_ties,
    static_chain,
    static_num_speculative_tokens,
    static_shape,
    static_tree_builder,
    static_tune_shapes,
)
from eval.engine.tree import StaticTree, Tree
from models.vocab_map import to_base_ids, to_draft_labels


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: nn.Module, tree: StaticTree):
        """heads: module with forward(hidden [n, d]) -> logits [K, n, V] (models.families.medusa.model.MedusaDraft)."""
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
        topk, _ = self.topk_rows(state.last_hidden[None])  # [1, D, k] draft ids, rank order
        return self.tree.fill(state.root, to_base_ids(topk[0], getattr(self.heads, "d2t", None)))  # base ids

    def topk_rows(self, h: torch.Tensor, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every head's top-k for B prompts at once (propose: B = 1; the field's batched path,
        models/families/medusa/lockstep.py: every active prompt): h [B, d], each prompt's h_t -> (topk [B, D, k]
        draft ids in rank order, near [B] bool or None). The heads run ONCE over the B rows. ties: also flag each
        prompt one of whose heads has two logits that decide its tree's nodes within static.TIE_EPS (near_ties)."""
        if self._dtype is not None:
            h = h.to(self._dtype)
        logits = self.heads(h)  # [K, B, V]
        logits = logits.reshape(logits.shape[0], -1, logits.shape[-1])
        if logits.shape[0] < self.tree.depth:
            raise ValueError(f"heads returned {logits.shape[0]} heads, the tree needs {self.tree.depth}")
        logits = logits[: self.tree.depth]  # [D, B, V]
        topk = logits.topk(self.tree.topk, dim=-1).indices.transpose(0, 1)  # [B, D, k]
        if not ties:
            return topk, None
        d, b = logits.shape[:2]
        near = near_ties(logits.reshape(d * b, -1), depth_widths(self.tree).repeat_interleave(b)).view(d, b)
        return topk, near.any(dim=0)

    @torch.inference_mode()
    def true_path_ranks(self, hidden: torch.Tensor, ids: torch.Tensor, max_depth: int, max_rank: int,
                        chunk_size: int = 32) -> torch.Tensor:
        """Rank statistics for the data-driven tree search (eval/harness/tree_search.py).

        hidden [T, d]: the base's h_t along one sequence; ids [T] long: that sequence.
        Returns ranks [T, max_depth] long: entry [t, k-1] = rank (0 = best) of ids[t+1+k] among head k's
        logits at h_t (what `propose` at that step would put at depth k), clipped to max_rank; -1 where
        t+1+k >= T. Heads are independent, so the true path does not change a Medusa rank.

        rank = number of tokens with a strictly larger logit: with ties this is the best place the
        token can take in topk's output (CPU topk orders tied values neither by index nor stably across
        k), so a tied token may be counted as a hit where propose put it one slot later. A token outside
        the draft vocabulary can never be proposed: its rank is max_rank (a miss). Rows go
        through the heads `chunk_size` at a time: [K, chunk, V] logits, never [K, T, V] at once.
        """
        num_heads = getattr(self.heads, "num_heads", max_depth)
        if max_depth > num_heads:
            raise ValueError(f"max_depth={max_depth} but the Medusa module has only {num_heads} heads; "
                             f"ask for at most {num_heads} depths")
        ids = ids.reshape(-1).to(hidden.device)
        t2d = getattr(self.heads, "t2d", None)
        n = ids.shape[0]
        ranks = torch.full((n, max_depth), -1, dtype=torch.long)
        if self._dtype is not None:
            hidden = hidden.to(self._dtype)
        for start in range(0, n, chunk_size):
            rows = torch.arange(start, min(start + chunk_size, n), device=hidden.device)  # [c]
            logits = self.heads(hidden[rows])  # [K, c, V], same dtype and math as propose
            for k in range(1, max_depth + 1):
                ok = rows + 1 + k < n  # the true token x_{t+1+k} exists
                if not bool(ok.any()):
                    break
                lk = logits[k - 1][ok]  # [c', V]
                target, outside = to_draft_labels(ids[rows[ok] + 1 + k], t2d)  # [c'] draft ids, -100 outside
                true_logit = lk.gather(1, target.clamp(min=0)[:, None])  # [c', 1]
                rank = (lk > true_logit).sum(dim=1).clamp(max=max_rank).masked_fill(outside, max_rank)  # [c']
                ranks[rows[ok].cpu(), k - 1] = rank.cpu()
        return ranks


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

Options = NoOptions  # the tree comes from the eval config's own keys (tree, tree_choices)
build = static_tree_builder(MedusaDrafter)
chain, num_speculative_tokens, shape = static_chain, static_num_speculative_tokens, static_shape
tune_shapes, max_speculative_tokens = static_tune_shapes, heads_max_speculative_tokens
searched_trees = True  # `specdraft tune` also sweeps trees the tree search grows from its heads' ranks
