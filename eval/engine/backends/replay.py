"""`ReplayBackend`: the base replayed from its stored greedy answer, for exact simulated acceptance
(eval/field/simulation.py; docs/concepts.md#simulated-acceptance).

Under greedy verification, a decode step accepts the longest path of the drafted tree whose tokens equal the base's
own greedy continuation, and that continuation is fixed by the prompt. So with the base's answer stored (its greedy
tokens) and one teacher-forced forward over prompt + answer (every hidden state a drafter reads), the unchanged
decoder loop (eval/engine/decoder.py: speculative_generate) can run any drafter against this backend instead of the
base: per step, the drafter proposes from exactly the rows decoding would hand it, and acceptance is a lookup. The
per-step accepted lengths are those of decoding, for every family (chains, static and dynamic trees, beams, blocks,
n-grams), at the drafter's cost only.

What it returns for a tree (tokens [N], depths [N], mask [N, N]) after `cache_len` committed tokens:
  on the stored path: node i whose root-to-i tokens equal seq[cache_len : cache_len + depth_i + 1]
  logits [N, V]  row i one-hot at seq[cache_len + depth_i + 1] (the base's greedy next token) for an on-path node,
                 zero elsewhere: off-path rows are never read (greedy acceptance descends only through matches)
  hidden [N, d]  the teacher-forced h at position cache_len + depth_i for an on-path node, zero elsewhere (the decoder
                 hands the drafter only the accepted path's rows)
  last_aux       the same rows of the cached aux layers (EAGLE-3)
Prefill returns only the last row of logits ([1, V]; the decoder reads logits[-1]).
"""

from __future__ import annotations

import torch

from eval.engine.backends.backend import Backend


class ReplayError(RuntimeError):
    """The replay left its stored sequence (a drafter proposed a tree deeper than the stored tail, or a root that is
    not the stored token): the simulation cannot be exact there."""


class ReplayBackend(Backend):
    """seq [S] long: prompt + stored answer (the answer running TAIL tokens past where decoding stops);
    hidden [S, d]: the teacher-forced final-norm hidden states of seq; aux [S, k*d] or None: the residual stream
    after `aux_layers` at the same positions; vocab_size: the base's V."""

    def __init__(self, seq: torch.Tensor, hidden: torch.Tensor, vocab_size: int, aux: torch.Tensor | None = None,
                 aux_layers: tuple[int, ...] = ()):
        if hidden.shape[0] != seq.numel() or (aux is not None and aux.shape[0] != seq.numel()):
            raise ValueError(f"ReplayBackend: {seq.numel()} tokens but {hidden.shape[0]} hidden rows"
                             f"{'' if aux is None else f' and {aux.shape[0]} aux rows'}")
        self.seq, self._hidden, self._aux = seq.long().cpu(), hidden, aux
        self.vocab_size, self.hidden_size, self.device = int(vocab_size), int(hidden.shape[1]), hidden.device
        self._cached_aux_layers = tuple(aux_layers)
        self.aux_layers, self.last_aux, self._len = (), None, 0

    def set_aux_layers(self, ids) -> None:
        ids = tuple(int(i) for i in ids)
        if ids and ids != self._cached_aux_layers:
            raise ValueError(f"the drafter reads base layers {list(ids)} but the replay cache holds layers "
                             f"{list(self._cached_aux_layers)}: build the cache for this draft's aux layers")
        self.aux_layers, self.last_aux = ids, None

    def reset(self, max_len: int) -> None:
        self._len = 0

    @property
    def cache_len(self) -> int:
        return self._len

    def _rows(self, positions: torch.Tensor, on: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(positions.numel(), source.shape[1], dtype=source.dtype, device=source.device)
        idx = on.nonzero().flatten()
        out[idx] = source[positions[idx]]
        return out

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = input_ids.numel()
        if t >= self.seq.numel() or not torch.equal(input_ids.cpu().long(), self.seq[:t]):
            raise ReplayError("the prompt is not the stored sequence's prefix")
        self._len = t
        logits = torch.zeros(1, self.vocab_size)
        logits[0, self.seq[t]] = 1.0
        if self.aux_layers:
            self.last_aux = self._aux[:t]
        return logits.to(self.device), self._hidden[:t]

    def forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, depths, mask = tokens.cpu(), depths.cpu(), tree_mask.cpu()
        pos = self._len + depths  # [N] position of each node
        if int(pos.max()) + 1 >= self.seq.numel():
            raise ReplayError(f"a tree node at position {int(pos.max())} needs the base's token after it, but the "
                              f"stored sequence ends at {self.seq.numel()}: the stored tail is shorter than this "
                              "drafter's deepest tree")
        match = tokens == self.seq[pos]  # [N] node's own token is the stored one
        on = ~(mask & ~match[None, :]).any(dim=1)  # [N] every ancestor-or-self matches: on the stored path
        if not bool(on[0]):
            raise ReplayError(f"the tree's root {int(tokens[0])} is not the stored token {int(self.seq[self._len])}")
        logits = torch.zeros(tokens.numel(), self.vocab_size)
        idx = on.nonzero().flatten()
        logits[idx, self.seq[pos[idx] + 1]] = 1.0
        self._last_on, self._last_pos = on, pos
        if self.aux_layers:
            self.last_aux = self._rows(pos, on, self._aux)
        return logits.to(self.device), self._rows(pos, on, self._hidden)

    def commit(self, keep: torch.Tensor) -> None:
        keep = keep.cpu()
        if not bool(self._last_on[keep].all()):
            raise ReplayError("committed a node off the stored path (not greedy acceptance?)")
        self._len += keep.numel()
