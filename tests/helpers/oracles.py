"""Drafters that know the answer: they propose the true greedy continuation part of the way, so every
acceptance length gets exercised without training a draft."""

from __future__ import annotations

import torch

from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import Tree, tree_from_paths
from models.tiny import TINY_VOCAB_SIZE


class NoisyPathsOracle(Drafter):
    """`num_paths` random paths of `length` drafts that follow the true continuation (`reference`: prompt +
    greedy tokens) up to a random point, then go random (tiny-vocabulary ids): accepted lengths vary from 0 to
    the full depth, and commit must gather off-first-branch paths. ragged=True also cuts each path to a random
    length (padded with -1), so the tree's leaves sit at uneven depths."""

    def __init__(self, reference: list[int], num_paths: int = 4, length: int = 4, seed: int = 0,
                 ragged: bool = False):
        self.ref, self.p, self.len, self.ragged = reference, num_paths, length, ragged
        self.gen = torch.Generator().manual_seed(seed)
        self.max_nodes = 1 + num_paths * length

    def propose(self, state: DecodeState) -> Tree:
        n = state.ids.numel()
        true = torch.tensor([self.ref[n + j] if n + j < len(self.ref) else 0 for j in range(1, self.len + 1)])
        paths = torch.randint(3, TINY_VOCAB_SIZE, (self.p, self.len), generator=self.gen)
        follow = torch.randint(0, self.len + 1, (self.p,), generator=self.gen)
        keep_true = torch.arange(self.len)[None] < follow[:, None]
        paths = torch.where(keep_true, true[None].expand_as(paths), paths)
        if self.ragged:
            lengths = torch.randint(1, self.len + 1, (self.p,), generator=self.gen)
            paths[torch.arange(self.len)[None] >= lengths[:, None]] = -1
        return tree_from_paths(state.root, paths)
