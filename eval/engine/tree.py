"""Token trees for one verification pass: the static Medusa-style "choices" trees and dynamic trees
deduplicated from arbitrary candidate paths (ReDrafter's tensor prefix matching).

Conventions (every drafter and the verifier rely on them):
- node 0 is the root: the base's own next token x_{t+1}, depth 0, parent -1;
- a depth-k node is a draft of x_{t+1+k} (docs/concepts.md#the-offset-rule);
- nodes are in topological order: parents[i] < i for i >= 1, so a node's ancestors all have smaller
  indices and "sorted ancestor indices" is already the path order root first;
- trees live on the CPU (they are a few hundred ints); only `draft_probs` may live on the accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class Tree:
    """A draft tree. Structure in `tokens`, `parents`, `depths`; `mask` and `paths` are derived.

    tokens  [N] long: node tokens, tokens[0] = root
    parents [N] long: parent index, -1 for the root
    depths  [N] long: 0 for the root, depth(parent) + 1 otherwise
    draft_probs [N, V] float or None: for rejection sampling, row i is the draft distribution q that
        node i's token was *sampled* from (warped with the same `eval.engine.sampling.warp` as the base; row 0
        unused). None means the children are deterministic picks (top-k, beam search): q is a point
        mass on each child, which needs no probabilities.
    mask    [N, N] bool (derived): mask[i, j] = j is an ancestor of i or i itself
    paths   [P, D+1] long (derived): one row per leaf, the node indices root first, padded with -1
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    draft_probs: torch.Tensor | None = None
    mask: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    paths: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.mask is None:  # built from raw structure: check it once, then derive the buffers
            self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).cpu()
            self.parents = torch.as_tensor(self.parents, dtype=torch.long).cpu()
            self.depths = torch.as_tensor(self.depths, dtype=torch.long).cpu()
            _check_structure(self.tokens, self.parents, self.depths)
            self.mask = ancestor_mask(self.parents, int(self.depths.max()))
        if self.paths is None:
            self.paths = leaf_paths(self.mask, self.depths, self.parents)
        if self.draft_probs is not None and self.draft_probs.shape[0] != self.num_nodes:
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows but the tree has "
                             f"{self.num_nodes} nodes; give one q row per node (row 0 unused)")

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.paths.shape[1]) - 1

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i] = child node indices of node i, in index order (= drafter's preference order)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids

    def path_to(self, node: int) -> torch.Tensor:
        """Node indices [depth(node)+1] from the root to `node` (ancestor indices are ascending)."""
        return self.mask[node].nonzero().flatten()


def _check_structure(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> None:
    n = tokens.shape[0]
    if tokens.ndim != 1 or parents.shape != (n,) or depths.shape != (n,) or n == 0:
        raise ValueError(f"tokens, parents, depths must be 1-D of the same length N >= 1; got shapes "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(depths.shape)}")
    if int(parents[0]) != -1 or int(depths[0]) != 0:
        raise ValueError("node 0 must be the root: parents[0] == -1 and depths[0] == 0")
    idx = torch.arange(n)
    if n > 1:
        p = parents[1:]
        if bool(((p < 0) | (p >= idx[1:])).any()):
            raise ValueError("nodes must be in topological order: 0 <= parents[i] < i for every i >= 1 "
                             f"(got parents {parents.tolist()})")
        if not torch.equal(depths[1:], depths[p] + 1):
            raise ValueError(f"depths must equal depth(parent) + 1; got depths {depths.tolist()} "
                             f"for parents {parents.tolist()}")
    if bool((tokens < 0).any()):
        raise ValueError(f"tree tokens must be valid ids >= 0, got {tokens.tolist()} (did a pad value leak "
                         "in?)")


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [N] -> mask [N, N] bool, mask[i, j] = j is i or an ancestor of i.

    Climbs all nodes one generation per iteration (max_depth iterations, not N), so it stays cheap for
    wide dynamic trees built every step.
    """
    n = parents.shape[0]
    rows = torch.arange(n)
    mask = torch.eye(n, dtype=torch.bool)
    cur = rows.clone()  # cur[i] = the ancestor of i reached so far (or -1 once past the root)
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parents[cur.clamp(min=0)], cur)
        ok = cur >= 0
        mask[rows[ok], cur[ok]] = True
    return mask


def leaf_paths(mask: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """One row per leaf (in index order): node indices root first, padded with -1 -> [P, D+1]."""
    n = parents.shape[0]
    is_leaf = torch.ones(n, dtype=torch.bool)
    is_leaf[parents[parents >= 0]] = False
    leaves = is_leaf.nonzero().flatten()
    out = torch.full((leaves.shape[0], int(depths.max()) + 1), -1, dtype=torch.long)
    r, c = mask[leaves].nonzero(as_tuple=True)  # node c lies on leaf r's path, at column depth(c)
    out[r, depths[c]] = c
    return out


def chain_tree(root: int, drafts: Sequence[int] | torch.Tensor = ()) -> Tree:
    """A single path root -> drafts[0] -> drafts[1] ... (plain AR is chain_tree(root))."""
    toks = torch.cat([torch.tensor([root]), torch.as_tensor(drafts, dtype=torch.long).reshape(-1)])
    n = toks.shape[0]
    return Tree(toks, torch.arange(n) - 1, torch.arange(n))


# ---------------------------------------------------------------------------------------------------
# Static trees from Medusa "choices"
# ---------------------------------------------------------------------------------------------------

Choice = tuple[int, ...]

# Medusa's `mc_sim_7b_63` (FasterDecoding/Medusa, medusa/model/medusa_choices.py): 63 choices = 63
# draft nodes, 64 nodes with the root; depth 4, ranks 0..9 (top-10 per head).
MEDUSA_63: tuple[Choice, ...] = tuple(tuple(c) for c in [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9],
    [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5],
    [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9],
    [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5],
    [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
])
CHAIN_4: tuple[Choice, ...] = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))  # top-1 chain, 5 nodes
WIDE_2: tuple[Choice, ...] = ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))  # full binary, depth 2, 7 nodes
TREE_16: tuple[Choice, ...] = (  # 16 nodes, depth 4, biased to rank 0 like Medusa's trees
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0),
)
STATIC_TREES: dict[str, tuple[Choice, ...]] = {
    "chain4": CHAIN_4, "wide2": WIDE_2, "tree16": TREE_16, "medusa63": MEDUSA_63,
}


class StaticTree:
    """A fixed tree shape from Medusa-style choices; `fill` puts tokens in it every step.

    Choice (r_1, ..., r_k) is the node at depth k reached by taking rank r_1 at depth 1, ..., rank r_k
    at depth k. Heads are independent, so the node's token is topk_tokens[k-1, r_k] (its own rank at
    its own depth only). Nodes are ordered by (depth, ranks): parents first, siblings by rank.
    """

    def __init__(self, choices: Sequence[Sequence[int]]):
        chosen = [tuple(int(r) for r in c) for c in choices]
        if len(set(chosen)) != len(chosen):
            raise ValueError("tree choices contain duplicates; each rank path must appear once")
        for c in chosen:
            if len(c) == 0 or min(c) < 0:
                raise ValueError(f"bad choice {c}: a choice is a non-empty tuple of ranks >= 0")
            if len(c) > 1 and c[:-1] not in set(chosen):
                raise ValueError(f"choice {c} has no parent {c[:-1]} in the list; add every prefix")
        order = sorted(chosen, key=lambda c: (len(c), c))
        self.choices: tuple[Choice, ...] = tuple(order)
        index = {c: i + 1 for i, c in enumerate(order)}  # node index; the root is 0
        n = len(order) + 1
        self.depth = max((len(c) for c in order), default=0)
        self.topk = max((c[-1] for c in order), default=-1) + 1  # top-k needed per depth
        parents = torch.tensor([-1] + [index.get(c[:-1], 0) for c in order], dtype=torch.long)
        depths = torch.tensor([0] + [len(c) for c in order], dtype=torch.long)
        # Flat index into topk_tokens[:depth, :topk].reshape(-1) for nodes 1..N-1.
        self._gather = torch.tensor([(len(c) - 1) * self.topk + c[-1] for c in order], dtype=torch.long)
        template = Tree(torch.zeros(n, dtype=torch.long), parents, depths)  # validates the structure once
        self.parents, self.depths, self.mask, self.paths = parents, depths, template.mask, template.paths
        self.num_nodes = n

    def fill(self, root: int, topk_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> Tree:
        """root + topk_tokens [D', K'] (rank-ordered top-k per depth, D' >= depth, K' >= topk) -> Tree."""
        if topk_tokens.ndim != 2 or topk_tokens.shape[0] < self.depth or topk_tokens.shape[1] < self.topk:
            raise ValueError(f"topk_tokens must be [depth >= {self.depth}, k >= {self.topk}] for this tree, "
                             f"got {tuple(topk_tokens.shape)}; take more heads or a larger top-k")
        flat = topk_tokens[: self.depth, : self.topk].reshape(-1).cpu().long()
        tokens = torch.cat([torch.tensor([int(root)]), flat[self._gather]])
        return Tree(tokens, self.parents, self.depths, draft_probs, mask=self.mask, paths=self.paths)


# ---------------------------------------------------------------------------------------------------
# Dynamic trees from arbitrary candidate paths (ReDrafter §3 "dynamic tree attention")
# ---------------------------------------------------------------------------------------------------


def prefix_match(beams: torch.Tensor) -> torch.Tensor:
    """beams [P, L] -> prefix_match [P, L]: entry [i, j] = the smallest beam index k with
    beams[k, :j+1] == beams[i, :j+1] (tensor ops only, no trie).

    matches[i, k, j] = beams[i, j] == beams[k, j]; a prefix of length j+1 is shared iff the running
    count of matches along j equals j+1; argmax over k picks the first True (k = i always qualifies).
    """
    length = beams.shape[1]
    matches = beams[:, None, :] == beams[None, :, :]  # [P, P, L]
    shared = matches.long().cumsum(dim=2) == torch.arange(1, length + 1, device=beams.device)  # [P, P, L]
    return shared.int().argmax(dim=1)  # [P, L]; argmax returns the first maximal index


def tree_from_paths(root: int, paths: torch.Tensor, pad: int = -1,
                    draft_probs: torch.Tensor | None = None) -> Tree:
    """Deduplicate candidate continuations into one tree.

    paths [P, L] long: row i = drafts for depths 1..L after `root`; ragged rows end with `pad` (pad
    must be < 0 so it never equals a token). draft_probs [P, L, V] (optional): the q each path token
    was sampled from; a merged node keeps the row of its first occurrence.
    Node order is beam-major (beam i's new tokens after all of beam i-1's), which is topological and
    keeps each node's children in beam order.
    """
    if paths.ndim != 2:
        raise ValueError(f"paths must be [P, L], got shape {tuple(paths.shape)}")
    if pad >= 0:
        raise ValueError(f"pad must be negative so it can never match a token id, got {pad}")
    paths = paths.long().cpu()
    p, length = paths.shape
    real = paths != pad
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError("ragged paths must be padded at the end only (no token after a pad)")
    if bool((paths[real] < 0).any()):
        raise ValueError(f"path tokens must be >= 0 (or the pad value {pad})")
    if p == 0:
        return chain_tree(root)
    # Column 0 = the root, shared by every beam: then node 0 falls out as beam 0's first token.
    beams = torch.cat([torch.full((p, 1), int(root), dtype=torch.long), paths], dim=1)  # [P, L+1]
    real = torch.cat([torch.ones(p, 1, dtype=torch.bool), real], dim=1)
    match = prefix_match(beams)  # [P, L+1]
    keep = (match == torch.arange(p)[:, None]) & real  # first occurrence of each prefix
    node_id = keep.reshape(-1).long().cumsum(0).reshape(p, length + 1) - 1  # valid where keep
    bi, dj = keep.nonzero(as_tuple=True)  # row-major = node order
    tokens = beams[bi, dj]
    # Parent of (i, j): the node holding prefix beams[i, :j], i.e. (match[i, j-1], j-1).
    parents = torch.full_like(tokens, -1)
    inner = dj > 0
    parents[inner] = node_id[match[bi[inner], dj[inner] - 1], dj[inner] - 1]
    q = None
    if draft_probs is not None:
        if draft_probs.shape[:2] != (p, length):
            raise ValueError(f"draft_probs must be [P={p}, L={length}, V], got {tuple(draft_probs.shape)}")
        q = torch.zeros((tokens.shape[0], draft_probs.shape[2]), dtype=draft_probs.dtype,
                        device=draft_probs.device)
        q[1:] = draft_probs[bi[1:].to(q.device), (dj[1:] - 1).to(q.device)]
    return Tree(tokens, parents, dj.clone(), q)


def tree_from_paths_reference(root: int, paths: torch.Tensor, pad: int = -1) -> Tree:
    """Slow twin of `tree_from_paths`: a Python trie, nodes numbered in first-insertion order."""
    tokens, parents, depths = [int(root)], [-1], [0]
    trie: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for row in paths.tolist():
        node = 0
        for tok in row:
            if tok == pad:
                break
            if (node, tok) not in trie:
                trie[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                depths.append(depths[node] + 1)
            node = trie[(node, tok)]
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def chain_choices(depth: int) -> list[list[int]]:
    """The top-1 chain of `depth` drafts as tree choices: [[0], [0, 0], ...]."""
    return [[0] * j for j in range(1, depth + 1)]
