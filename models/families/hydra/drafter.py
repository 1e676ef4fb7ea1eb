"""Hydra / Hydra++ at inference: a static tree expanded level by level, each node conditioned on its path.

Tree shape = Medusa-style choices (eval.engine.tree.StaticTree): node (r_1..r_k) is the rank-r_k child of node
(r_1..r_{k-1}). Unlike Medusa, head k's candidates depend on the node being expanded: its input is
[z_t; e(root); e(ancestors...)], so for depth k every depth-(k-1) node that has children goes through
head k in ONE batched call ([P_k, (k+1)d] -> [P_k, V]), and each node's top-k become its children.
Tokens land in the StaticTree's node order, so its parents / depths / mask / paths are reused as is.

z_t: the base's last hidden state h_t, or (Hydra++) the prefix layer's output for the last committed
token; the prefix layer keeps its own KV cache of committed tokens: reset() drops it, each propose()
first appends state.new_hidden (everything committed since the last call; the whole prompt after
prefill) with one step() call.

Children are deterministic top-k picks, so rejection sampling treats them as point masses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.engine.backends.fast_matmul import fp32_layout, matmul_wx
from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.drafters.options import NoOptions
from eval.engine.drafters.static import (
    heads_max_speculative_tokens,
    near_ties,
    static_chain,
    static_num_speculative_tokens,
    static_shape,
    static_tree_builder,
    static_tune_shapes,
)
from eval.engine.tree import StaticTree, Tree
from models.vocab_map import to_draft_labels


@dataclass
class _Level:
    """How depth k of the static tree is filled (index tensors on the draft's device)."""

    depth: int
    path_nodes: torch.Tensor  # [P, k] node indices root .. each expanded depth-(k-1) node
    child_nodes: torch.Tensor  # [n_k] the depth-k nodes
    child_slot: torch.Tensor  # [n_k] which expanded node (row of path_nodes) is each one's parent
    child_rank: torch.Tensor  # [n_k] its rank among that parent's candidates
    width: int  # top-k taken per expanded node (max rank + 1)
    row_width: torch.Tensor  # [P] ranks each expanded node's children take (its max child rank + 1)


class HydraDrafter(Drafter):
    name = "hydra"

    def __init__(self, draft, tree: StaticTree):
        """draft: models.families.hydra.model.HydraDraft (head_logits, embed_tokens, context, prefix)."""
        if tree.depth > draft.num_heads:
            raise ValueError(f"the tree is {tree.depth} deep but the Hydra draft has only {draft.num_heads} heads; "
                             "use a shallower tree (e.g. 'chain4' needs 4 heads)")
        self.draft = draft.eval()
        self.tree = tree
        self.max_nodes = tree.num_nodes
        param = next(draft.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._cache = None  # the prefix layer's KV cache for the current sequence
        self._levels = self._plan_levels(tree)
        # The head's LM-head product over a few rows is the largest part of drafting. In fp32 on a CPU whose MKL
        # runs the transposed product faster ("wx", eval/engine/backends/fast_matmul.py), it goes that way too:
        # 1 row x SmolLM2's 16k draft rows 1.1 ms against 3.4 ms as x @ W.T on the AMD EPYC (docs/lab/benchmarks.md,
        # "The demo: the soft loss and a tree chosen per machine").
        wx = self._dtype == torch.float32 and self._device.type == "cpu" and fp32_layout(self._device) == "wx"
        self._matmul = matmul_wx if wx else None

    def _plan_levels(self, tree: StaticTree) -> list[_Level]:
        ranks = torch.tensor([0] + [c[-1] for c in tree.choices], dtype=torch.long)  # [N]; rank of each node
        levels = []
        for k in range(1, tree.depth + 1):
            children = (tree.depths == k).nonzero().flatten()  # [n_k]
            parents = tree.parents[children]  # [n_k]
            expanded = torch.unique(parents)  # [P_k] sorted node indices
            slot = torch.searchsorted(expanded, parents)  # [n_k]
            # A depth-(k-1) node's ancestors are the True entries of its mask row, root first (topological order).
            path = torch.stack([tree.mask[p].nonzero().flatten() for p in expanded.tolist()])  # [P_k, k]
            row_width = torch.zeros(len(expanded), dtype=torch.long).scatter_reduce(
                0, slot, ranks[children] + 1, reduce="amax")  # [P_k]
            levels.append(_Level(k, path.to(self._device), children.to(self._device), slot.to(self._device),
                                 ranks[children].to(self._device), int(ranks[children].max()) + 1,
                                 row_width.to(self._device)))
        return levels

    def reset(self) -> None:
        self._cache = None

    def _z(self, state: DecodeState) -> torch.Tensor:
        """z_t [d] for this step; with the prefix layer, commit state.new_hidden to its cache first."""
        self._cache, z = self.context_step(self._cache, state.new_hidden)
        return z

    def context_step(self, cache, new_hidden: torch.Tensor):
        """One prompt's z_t: new_hidden [n, d], the base rows committed since its last step (the whole prompt after
        the prefill) -> (its prefix cache, z_t [d]). Without the prefix layer z_t = h_t (new_hidden[-1]) and the
        cache stays None; with it, the rows are appended to `cache` (a new one when None) by one step() call."""
        prefix = self.draft.prefix
        if prefix is None:
            return cache, new_hidden[-1].to(self._device, self._dtype)
        new = new_hidden.to(self._device, self._dtype)  # [n, d]
        if cache is None:
            cache = prefix.new_cache(max(256, 2 * new.shape[0]), self._device, self._dtype)
        return cache, prefix.step(cache, new)[-1]

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        z = self._z(state)  # always, even for a root-only tree: the prefix cache must see every token
        tokens, _ = self.fill_trees(z[None], torch.tensor([int(state.root)], device=self._device))
        tree = self.tree
        return Tree(tokens[0].cpu(), tree.parents, tree.depths, mask=tree.mask, paths=tree.paths)

    def fill_trees(self, z: torch.Tensor, roots: torch.Tensor, ties: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static tree's tokens for B prompts at once (propose: B = 1; the field's batched path,
        models/families/hydra/lockstep.py: every active prompt): z [B, d], roots [B] long -> (tokens [B, N] base
        ids in the StaticTree's node order, near [B] bool or None). Depth k runs head k ONCE over the B·P_k rows of
        every prompt's expanded depth-(k-1) nodes. ties: also flag each prompt one of whose rows has two logits
        that decide its children within static.TIE_EPS (near_ties)."""
        b, tree = z.shape[0], self.tree
        tokens = torch.empty(b, tree.num_nodes, dtype=torch.long, device=self._device)
        tokens[:, 0] = roots
        near = torch.zeros(b, dtype=torch.bool, device=self._device) if ties else None
        for lvl in self._levels:
            path_tokens = tokens[:, lvl.path_nodes]  # [B, P, k]: root + ancestors of each expanded node
            p, k = path_tokens.shape[1:]
            logits = self.draft.head_logits(lvl.depth, z[:, None].expand(b, p, -1).reshape(b * p, -1),
                                            self.draft.embed_tokens(path_tokens.reshape(b * p, k)), self._matmul)
            top = logits.topk(lvl.width, dim=-1).indices.view(b, p, lvl.width)  # [B, P, width] draft ids
            tokens[:, lvl.child_nodes] = self.draft.to_base(top[:, lvl.child_slot, lvl.child_rank])  # base ids
            if ties:
                near |= near_ties(logits, lvl.row_width.repeat(b)).view(b, p).any(dim=1)
        return tokens, near

    @torch.inference_mode()
    def true_path_ranks(self, hidden: torch.Tensor, ids: torch.Tensor, max_depth: int, max_rank: int
                        ) -> torch.Tensor:
        """Ranks of the true continuation under teacher-forced paths, for the data-driven tree search.

        hidden [T, d]: the base's h_t along one sequence (prompt + the base's own greedy continuation);
        ids [T] long: its tokens. Returns [T, D] long: entry [t, k-1] = rank (0 = best) of ids[t+1+k] among
        head k's candidates when the root is ids[t+1] and the path is ids[t+1 .. t+k] (what propose() ranks
        after ids[..t] are committed), clipped to max_rank R (R = "not in a tree of width R"); -1 where
        t+1+k >= T. Rank = number of tokens with a strictly larger logit (ties, likely only in bf16, count
        in the node's favour; a token outside the draft vocabulary gets max_rank).
        With the prefix layer z comes from its full causal forward over hidden
        (row t sees rows <= t, as in decoding). Batched over t, chunked so a chunk's logits stay ~64 MB.
        """
        if hidden.dim() != 2 or ids.dim() != 1 or hidden.shape[0] != ids.shape[0]:
            raise ValueError(f"true_path_ranks needs hidden [T, d] and ids [T] of one sequence, got "
                             f"{tuple(hidden.shape)} and {tuple(ids.shape)}")
        if not 1 <= max_depth <= self.draft.num_heads or max_rank < 1:
            raise ValueError(f"max_depth={max_depth} must be in 1..{self.draft.num_heads} (the draft's heads) and "
                             f"max_rank={max_rank} >= 1")
        t_len = int(ids.shape[0])
        ids = ids.to(self._device).long()
        z = self.draft.context(hidden.to(self._device, self._dtype)[None])[0]  # [T, d]
        out = torch.full((t_len, max_depth), -1, dtype=torch.long, device=self._device)
        chunk = max(1, (1 << 24) // self.draft.vocab_size)  # rows per chunk: chunk x V fp32 logits <= 64 MB
        for k in range(1, max_depth + 1):
            steps = torch.arange(1, k + 1, device=self._device)
            for start in range(0, max(0, t_len - 1 - k), chunk):  # valid t: t + 1 + k < T
                t = torch.arange(start, min(t_len - 1 - k, start + chunk), device=self._device)  # [c]
                path = ids[t[:, None] + steps]  # [c, k]: ids[t+1 .. t+k]
                logits = self.draft.head_logits(k, z[t], self.draft.embed_tokens(path)).float()  # [c, N or V]
                want, outside = to_draft_labels(ids[t + 1 + k], self.draft.t2d)  # [c] draft ids, -100 outside
                target = logits.gather(1, want.clamp(min=0)[:, None])  # [c, 1]
                rank = (logits > target).sum(dim=-1).clamp(max=max_rank)
                out[t, k - 1] = rank.masked_fill(outside, max_rank)
        return out.cpu()


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

Options = NoOptions  # the tree comes from the eval config's own keys (tree, tree_choices)
build = static_tree_builder(HydraDrafter)
chain, num_speculative_tokens, shape = static_chain, static_num_speculative_tokens, static_shape
tune_shapes, max_speculative_tokens = static_tune_shapes, heads_max_speculative_tokens
searched_trees = True  # `specdraft tune` also sweeps trees the tree search grows from its heads' ranks


def target_key(extra: dict) -> str:
    """Its acceptance target in docs/lab/results.md: a row labelled Hydra++ (the prefix layer) has its own."""
    return "hydra++" if "++" in extra.get("label", "") else "hydra"
