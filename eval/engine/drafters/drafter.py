"""The drafting interface: every family turns a `DecodeState` into a `Tree` (docs/concepts.md#the-offset-rule,
#verification).

Timeline of one decode step, t = index of the last committed token:
    committed ids x_1..x_t are in the base KV cache; the base already chose root = x_{t+1} from h_t;
    drafter.propose(state) -> Tree with node 0 = root and depth-k nodes = drafts of x_{t+1+k};
    the base verifies the tree, commits root + accepted drafts, and its bonus token is the next root.
So a drafter predicting "k tokens ahead of h_t" fills depth k; it never has to predict the root.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from eval.engine.tree import Tree, chain_tree


@dataclass
class DecodeState:
    """What a drafter may read at one step (batch size 1).

    ids         [L] long: committed tokens (prompt + generated so far), all in the base KV cache
    root        int: x_{L+1}, chosen by the base, not yet in the cache; must be the tree's node 0
    new_hidden  [n, d]: base hidden states (post final norm) of the tokens committed since the last
                propose() call; after prefill that is the whole prompt. new_hidden[-1] = h_L, the state
                whose distribution produced `root`. Drafters with their own KV cache (Hydra++ prefix
                layer, CTC attention module) append exactly these rows.
    new_ids     [n] long: the tokens of those rows (= ids[-n:])
    new_aux     [n, k*d] or None: the same rows' residual stream after the base layers the drafter lists in
                its `aux_layers` (EAGLE-3); None for drafters without aux_layers
    temperature, top_p, generator: the sampling setup, for drafters that sample their drafts
                (they must warp with eval.engine.sampling.warp and put q in Tree.draft_probs)
    """

    ids: torch.Tensor
    root: int
    new_hidden: torch.Tensor
    new_ids: torch.Tensor
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    new_aux: torch.Tensor | None = None

    @property
    def last_hidden(self) -> torch.Tensor:
        """h_L [d]: the base state that predicted the root."""
        return self.new_hidden[-1]


class Drafter(ABC):
    """One draft family at inference. `max_nodes` bounds every tree's size (the decoder reserves that
    much KV room)."""

    name: str = "drafter"
    max_nodes: int = 1

    def reset(self) -> None:  # noqa: B027 - optional hook, stateless drafters need nothing
        """Forget per-sequence state (own KV caches, n-gram tables of the previous prompt). Called once
        before each prompt's prefill."""

    @abstractmethod
    def propose(self, state: DecodeState) -> Tree:
        """Return the tree to verify: tokens[0] == state.root, depth-k nodes draft x_{t+1+k}."""


class NoDrafter(Drafter):
    """No drafts: a 1-node tree (the root), so plain AR decoding runs through the same engine."""

    name = "ar"
    max_nodes = 1

    def __init__(self) -> None:
        self._shape = chain_tree(0)  # structure built and validated once; only the token changes

    def propose(self, state: DecodeState) -> Tree:
        s = self._shape
        return Tree(torch.tensor([int(state.root)]), s.parents, s.depths, mask=s.mask, paths=s.paths)
