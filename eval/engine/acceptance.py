"""Which drafted nodes the base accepts: pure functions over (tree, base logits at every node).

logits[i] [V] is the base's prediction for the token *after* node i, so a child c of node i is judged
against logits[i]. Every rule returns an `Accepted`: the node path root first (always starts with
node 0, the root, which the base itself chose) and the bonus token (the base's next token after the
last accepted node, which becomes the next step's root).

- greedy     accept c iff tokens[c] == argmax logits[parent]; lossless w.r.t. greedy decoding.
- typical    Medusa's rule p(x) > min(eps, delta * exp(-H(p))); fast, not lossless.
- rejection  speculative sampling, lossless for T > 0 (chain = Leviathan / Chen; tree = recursive
             per-node residual over siblings, SpecInfer-style).
Each fast rule has a slow reference twin used by the parity tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eval.engine.sampling import sample, uniform, warped_probs
from eval.engine.tree import Tree


@dataclass
class Accepted:
    path: torch.Tensor  # [m] long, node indices root first (m - 1 accepted drafts)
    bonus: int  # next token after the last path node

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (the root is not a draft)."""
        return int(self.path.shape[0]) - 1


def _check(tree: Tree, logits: torch.Tensor) -> None:
    if logits.ndim != 2 or logits.shape[0] != tree.num_nodes:
        raise ValueError(f"logits must be [N={tree.num_nodes}, V] (one row per tree node), got "
                         f"{tuple(logits.shape)}")


# ---------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------


def _longest_accepted(tree: Tree, ok: torch.Tensor, score: torch.Tensor | None = None) -> int:
    """ok [N] bool per node (its own test passed; ok[0] must be True) -> the deepest node whose whole
    path passed; ties broken by the larger `score` [N], then by the smaller index."""
    passed = ~(tree.mask & ~ok[None, :]).any(dim=1)  # [N]: every ancestor-or-self passed
    depth = torch.where(passed, tree.depths, torch.full_like(tree.depths, -1))
    best_depth = int(depth.max())
    cand = (depth == best_depth).nonzero().flatten()
    if score is not None and cand.numel() > 1:
        return int(cand[score[cand].argmax()])
    return int(cand[0])


def greedy_accept(tree: Tree, logits: torch.Tensor) -> Accepted:
    """Longest path whose every draft equals the base argmax at its parent; bonus = argmax at its end."""
    _check(tree, logits)
    top = logits.argmax(dim=-1).cpu()  # [N]
    ok = torch.ones(tree.num_nodes, dtype=torch.bool)
    ok[1:] = tree.tokens[1:] == top[tree.parents[1:]]
    best = _longest_accepted(tree, ok)
    return Accepted(tree.path_to(best), int(top[best]))


def greedy_accept_reference(tree: Tree, logits: torch.Tensor) -> Accepted:
    """Slow twin: walk down from the root, recursing into every matching child, keep the longest."""
    top = logits.argmax(dim=-1).tolist()
    toks = tree.tokens.tolist()

    def longest(node: int) -> list[int]:
        best: list[int] = []
        for c in tree.children[node]:
            if toks[c] == top[node]:
                sub = longest(c)
                if len(sub) > len(best):
                    best = sub
        return [node] + best

    path = longest(0)
    return Accepted(torch.tensor(path), top[path[-1]])


# ---------------------------------------------------------------------------------------------------
# typical acceptance (Medusa)
# ---------------------------------------------------------------------------------------------------


def typical_threshold(probs: torch.Tensor, eps: float, delta: float) -> torch.Tensor:
    """probs [..., V] -> min(eps, delta * exp(-H(p))) [...]: accept x iff p(x) > this."""
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
    return torch.minimum(torch.full_like(entropy, eps), delta * torch.exp(-entropy))


def typical_accept(tree: Tree, logits: torch.Tensor, *, temperature: float, top_p: float = 1.0,
                   eps: float = 0.09, delta: float = 0.3,
                   generator: torch.Generator | None = None) -> Accepted:
    """Medusa's typical acceptance: longest path where every draft x has p(x) > min(eps, delta e^{-H(p)}),
    p = warped base distribution at the parent; ties go to the most likely path (sum of log p).
    At T == 0 p is one-hot, so this is exactly greedy. Bonus: argmax (T == 0) or a sample of p at the
    last accepted node."""
    _check(tree, logits)
    probs = warped_probs(logits, temperature, top_p)  # [N, V]
    thresh = typical_threshold(probs, eps, delta).cpu()  # [N]
    n = tree.num_nodes
    cand_p = torch.ones(n)
    if n > 1:
        par = tree.parents[1:]
        cand_p[1:] = probs[par.to(probs.device), tree.tokens[1:].to(probs.device)].cpu()
    ok = cand_p > torch.cat([torch.zeros(1), thresh[tree.parents[1:]]])
    loglik = tree.mask.float() @ cand_p.clamp_min(1e-30).log()  # [N] log-likelihood of each node's path
    best = _longest_accepted(tree, ok, loglik)
    bonus = int(probs[best].argmax()) if temperature == 0 else sample(probs[best], generator)
    return Accepted(tree.path_to(best), bonus)


def typical_accept_reference(tree: Tree, logits: torch.Tensor, *, temperature: float, top_p: float = 1.0,
                             eps: float = 0.09, delta: float = 0.3,
                             generator: torch.Generator | None = None) -> Accepted:
    """Slow twin: enumerate every root-to-node path and test each draft with the formula directly."""
    probs = warped_probs(logits, temperature, top_p)
    rows = probs.double().tolist()
    toks = tree.tokens.tolist()
    best, best_key = 0, (0, 0.0)
    for node in range(1, tree.num_nodes):
        path = tree.path_to(node).tolist()
        loglik, good = 0.0, True
        for parent, child in zip(path[:-1], path[1:]):
            p = rows[parent]
            h = -sum(v * math.log(v) for v in p if v > 0)
            px = p[toks[child]]
            if not px > min(eps, delta * math.exp(-h)):
                good = False
                break
            loglik += math.log(px)
        key = (len(path) - 1, loglik)
        if good and (key[0] > best_key[0] or (key[0] == best_key[0] and key[1] > best_key[1])):
            best, best_key = node, key
    bonus = int(probs[best].argmax()) if temperature == 0 else sample(probs[best], generator)
    return Accepted(tree.path_to(best), bonus)


# ---------------------------------------------------------------------------------------------------
# rejection sampling (lossless for T > 0)
# ---------------------------------------------------------------------------------------------------


def _normalise(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = r.sum()
    # Zero mass only happens through float round-off (a rejected draft had r(x) ~ 1); fall back.
    return r / total if float(total) > 0 else fallback


def _accept_one(r: torch.Tensor, x: int, q: torch.Tensor | None, generator: torch.Generator | None
                ) -> tuple[bool, torch.Tensor]:
    """One speculative-sampling test of draft x against target r [V].

    q None: x was a deterministic pick (q = point mass on x): accept w.p. r(x), else r(x) <- 0.
    q [V]:  x was sampled from q: accept w.p. min(1, r(x)/q(x)), else r <- max(0, r - q).
    Returns (accepted, new unnormalised-then-normalised residual).
    """
    u = uniform(generator, r.device)
    rx = float(r[x])
    if q is None:
        if u < rx:
            return True, r
        res = r.clone()
        res[x] = 0.0
        return False, _normalise(res, r)
    qx = float(q[x])
    if qx <= 0:
        raise ValueError(f"draft token {x} has q(x) = 0: the drafter's draft_probs are not the distribution "
                         "its tokens were sampled from (warp them with eval.engine.sampling.warp like the base)")
    if u * qx < rx:  # u < r(x) / q(x), no division
        return True, r
    return False, _normalise((r - q.to(r.device)).clamp_min(0.0), r)


def rejection_tree(tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None) -> Accepted:
    """Recursive rejection sampling over a tree of drafts.

    probs [N, V]: the target (warped base) distribution after each node. tree.draft_probs [N, V] or None
    (see `Tree`). At node i: r <- probs[i]; try children in order with `_accept_one`, updating the
    residual r after each rejection; go down the first accepted child; if all are rejected (or i is a
    leaf) the bonus is a sample of r. Siblings must be independent draws given the parent (top-k /
    beam picks are, as point masses; i.i.d. samples from q are).
    """
    if probs.ndim != 2 or probs.shape[0] != tree.num_nodes:
        raise ValueError(f"probs must be [N={tree.num_nodes}, V], got {tuple(probs.shape)}")
    toks = tree.tokens.tolist()
    q = tree.draft_probs
    node, path = 0, [0]
    while True:
        r = probs[node]
        nxt = None
        for c in tree.children[node]:
            ok, r = _accept_one(r, toks[c], None if q is None else q[c], generator)
            if ok:
                nxt = c
                break
        if nxt is None:
            return Accepted(torch.tensor(path), sample(r, generator))
        node = nxt
        path.append(node)


def rejection_chain(drafts: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """Reference twin for a single chain (Leviathan et al. / Chen et al.).

    drafts [k] tokens; probs [k+1, V]: target after the root and after each draft; draft_probs [k, V]
    (q_i that drafts[i] was sampled from) or None for point masses. Returns (accepted drafts n, bonus):
    the bonus is sampled from norm(max(0, p_n - q_n)) on a rejection, from p_k if all were accepted.
    Consumes the generator exactly like `rejection_tree` on the same chain (for the parity test).
    """
    for i, x in enumerate(drafts.tolist()):
        p = probs[i]
        u = uniform(generator, p.device)
        if draft_probs is None:
            accept = u < float(p[x])
            residual = p.clone()
            residual[x] = 0.0
        else:
            qi = draft_probs[i]
            accept = u < min(1.0, float(p[x]) / float(qi[x]))
            residual = (p - qi).clamp_min(0.0)
        if not accept:
            return i, sample(residual / residual.sum(), generator)
    return len(drafts), sample(probs[len(drafts)], generator)


def rejection_accept(tree: Tree, logits: torch.Tensor, *, temperature: float, top_p: float = 1.0,
                     generator: torch.Generator | None = None) -> Accepted:
    """Rejection sampling on base logits: warp them like the drafter warped q, then `rejection_tree`.
    temperature must be > 0 (at T == 0 use greedy_accept, its limit)."""
    _check(tree, logits)
    if temperature <= 0:
        raise ValueError("rejection sampling needs temperature > 0; use greedy acceptance for T == 0")
    return rejection_tree(tree, warped_probs(logits, temperature, top_p), generator)
