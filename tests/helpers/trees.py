"""Random draft trees for the backend parity tests, and the slow reference their tree steps are checked
against: a plain causal forward over one root-to-node path, recomputed from scratch."""

from __future__ import annotations

import torch

from models.tiny import TINY_VOCAB_SIZE


def random_tree(n: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Random tree of n nodes in topological order: node 0 is the root, node i's parent < i.
    Returns (parents, depths [n], ancestor-or-self mask [n, n])."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    depths = torch.zeros(n, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return parents, depths, mask


def root_path(parents: list[int], i: int) -> list[int]:
    """Node indices from the root down to node i."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def deepest_path(parents: list[int]) -> list[int]:
    """The root path of the deepest node (the last of equally deep ones): usually not the first m nodes, so a
    commit of it must gather K/V slots."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return root_path(parents, max(range(len(parents)), key=lambda i: (depth[i], i)))


def full_forward(model, ids: list[int], device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V] in fp32, hidden [T, d]) of one plain causal forward of the transformers model over `ids`
    (on `device`; None: the CPU), no cache."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids], device=device)).last_hidden_state[0]
        return model.lm_head(hidden).float(), hidden


def same_tree_steps(first, second, prompt: torch.Tensor, sizes, gen: torch.Generator) -> list[tuple[tuple, tuple]]:
    """The same calls on two backends: prefill `prompt`, then for each n in `sizes` a random tree of n tokens
    (tiny vocabulary, drawn from gen) and a commit of its deepest path. Returns, for the prefill and each tree,
    ((logits, hidden) of `first`, (logits, hidden) of `second`)."""
    outs = [(first.prefill(prompt), second.prefill(prompt))]
    for n in sizes:
        tokens = torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=gen)
        parents, depths, mask = random_tree(n, gen)
        outs.append(tuple(b.forward_tree(tokens, depths, mask) for b in (first, second)))
        keep = torch.tensor(deepest_path(parents))
        for b in (first, second):
            b.commit(keep)
    return outs
