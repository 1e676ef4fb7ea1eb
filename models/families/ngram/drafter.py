"""Learning-free N-gram drafts (N-grammys §4; docs/families/ngram.md): k rows of up to w tokens each,
verified in one pass as the paths of a prefix-merged tree (`eval.engine.tree.tree_from_paths`).

Row sources, all continuations AFTER the root (a depth-j node drafts x_{t+1+j}):
- context: earlier occurrences of the last q tokens of (committed ids + root); each match gives the
  (up to) w tokens that followed it. Distinct continuations are ranked by how often they occur, ties
  broken by recency (the latest occurrence wins) -- the paper's context n-gram;
- bigram: the top-k next tokens after the root from the model bigram table, each extended greedily
  to w tokens through the table's top-1 (the "extended bigram");
- unigram: the top-k model-unigram tokens, each extended the same way (paper §4.1; weak alone);
- mixed (default): context rows first, bigram rows fill up to k;
- longest_match: vLLM's prompt lookup (its `ngram` method): ONE row, copied after the EARLIEST earlier
  occurrence of the LONGEST suffix of (committed ids + root) with q_min <= length <= q; what
  `specdraft serve-check --method ngram` compares with vLLM token for token.
Rows that add no node (equal to, or a prefix of, an earlier row) are dropped before counting to k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.drafters.options import parse_options
from eval.engine.tree import Tree, chain_tree, tree_from_paths
from models.families.ngram.model import BigramTable, extend_bigram

STRATEGIES = ("mixed", "context", "bigram", "unigram", "longest_match")
PAD = -1


def context_rows(seq: torch.Tensor, q: int, w: int, limit: int) -> torch.Tensor:
    """seq [n] long (committed ids + root) -> up to `limit` rows [R, w], PAD-ended when a match sits
    near the end, ranked by (count desc, latest occurrence desc).

    Tensor path: unfold all q-grams, compare with the query, gather the continuations, group equal
    continuations with `unique` and rank by count * (n + 1) + latest start (starts are < n, so count
    dominates and each distinct row has its own latest start: the order is total).
    """
    n = seq.shape[0]
    if n <= q or limit <= 0:
        return torch.empty(0, w, dtype=torch.long)
    query = seq[n - q:]  # [q]
    grams = seq.unfold(0, q, 1)[: n - q]  # [n-q, q]: starts 0..n-q-1, each followed by >= 1 token
    starts = (grams == query).all(dim=1).nonzero().flatten()  # [M]
    if starts.numel() == 0:
        return torch.empty(0, w, dtype=torch.long)
    padded = torch.cat([seq, torch.full((w,), PAD, dtype=torch.long)])
    conts = padded[starts[:, None] + q + torch.arange(w)]  # [M, w]
    rows, inverse, counts = torch.unique(conts, dim=0, return_inverse=True, return_counts=True)
    latest = torch.full((rows.shape[0],), -1, dtype=torch.long).scatter_reduce(0, inverse, starts, "amax")
    order = (counts * (n + 1) + latest).argsort(descending=True)
    return rows[order[:limit]]


def context_rows_reference(seq: list[int], q: int, w: int, limit: int) -> list[list[int]]:
    """Slow twin of `context_rows`: a dict of continuation -> (count, latest start)."""
    n = len(seq)
    if n <= q:
        return []
    query = seq[n - q:]
    stats: dict[tuple[int, ...], list[int]] = {}
    for i in range(n - q):
        if seq[i:i + q] == query:
            cont = tuple(seq[i + q:i + q + w]) + (PAD,) * max(0, i + q + w - n)
            c = stats.setdefault(cont, [0, -1])
            c[0] += 1
            c[1] = i
    ranked = sorted(stats, key=lambda r: (stats[r][0], stats[r][1]), reverse=True)
    return [list(r) for r in ranked[:limit]]


def longest_match_row(seq: torch.Tensor, q_min: int, q_max: int, w: int) -> list[int]:
    """seq [n] long (committed ids + root) -> one row of up to w tokens, [] when nothing matches.

    vLLM's prompt lookup (vllm/v1/spec_decode/ngram_proposer.py: a KMP pass over the reversed sequence):
    the longest L in [q_min, q_max] whose last-L query occurs earlier (the occurrence ends before the last
    token), the earliest such occurrence, and the up to w tokens after it (fewer near the end of seq).
    """
    n = seq.shape[0]
    for L in range(min(q_max, n - 1), q_min - 1, -1):
        grams = seq.unfold(0, L, 1)[: n - L]  # [n-L, L]: starts 0..n-L-1, each followed by >= 1 token
        starts = (grams == seq[n - L:]).all(dim=1).nonzero().flatten()  # [M], ascending
        if starts.numel():
            s = int(starts[0]) + L
            return seq[s:s + w].tolist()
    return []


def longest_match_row_reference(seq: list[int], q_min: int, q_max: int, w: int) -> list[int]:
    """Slow twin of `longest_match_row`: every (length, start) pair in order, plain lists."""
    n = len(seq)
    for L in range(q_max, q_min - 1, -1):
        for start in range(0, n - L):  # the occurrence [start, start+L) ends at or before n-2
            if seq[start:start + L] == seq[n - L:]:
                return seq[start + L:start + L + w]
    return []


def _unpad(row: list[int]) -> tuple[int, ...]:
    return tuple(t for t in row if t != PAD)


def merge_rows(sources: list[list[list[int]]], k: int) -> list[tuple[int, ...]]:
    """Concatenate row sources in priority order, dropping empty rows and rows equal to or a prefix
    of an earlier kept row (they would add no tree node); stop at k rows."""
    kept: list[tuple[int, ...]] = []
    for rows in sources:
        for r in rows:
            r = _unpad(r)
            if r and not any(kr[:len(r)] == r for kr in kept):
                kept.append(r)
                if len(kept) == k:
                    return kept
    return kept


class NgramDrafter(Drafter):
    """k rows x w tokens from context / model n-grams; see the module docstring.

    bigram_table: needed by "mixed" and "bigram" (models.families.ngram.model.bigram_table_for); its top-k must
    hold at least k entries. unigram_tokens [V'] (ranked, models.families.ngram.model.model_unigram) for "unigram".
    """

    name = "ngram"

    def __init__(self, k: int = 10, w: int = 10, q: int = 1, strategy: str = "mixed",
                 bigram_table: BigramTable | None = None, unigram_tokens: torch.Tensor | None = None,
                 q_min: int | None = None):
        if k < 1 or w < 1 or q < 1:
            raise ValueError(f"ngram needs k >= 1 rows, w >= 1 tokens per row and q >= 1 query tokens; "
                             f"got k={k}, w={w}, q={q}")
        q_min = q if q_min is None else q_min
        if not 1 <= q_min <= q:
            raise ValueError(f"ngram q_min (the shortest query strategy=longest_match tries) must be in 1..q={q}; "
                             f"got q_min={q_min}")
        if strategy == "longest_match" and k != 1:
            raise ValueError(f"strategy 'longest_match' (vLLM's prompt lookup) proposes one row; set k=1, got k={k}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown ngram strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        if strategy in ("mixed", "bigram", "unigram") and bigram_table is None:
            raise ValueError(f"strategy {strategy!r} needs a bigram table (model.py: bigram_table_for); "
                             "or use strategy='context'")
        if bigram_table is not None and bigram_table.k < k:
            raise ValueError(f"the bigram table holds top-{bigram_table.k} but k={k}; rebuild it with k >= {k}")
        if strategy == "unigram" and unigram_tokens is None:
            raise ValueError("strategy 'unigram' needs unigram_tokens (models.families.ngram.model.model_unigram)")
        self.k, self.w, self.q, self.q_min, self.strategy = k, w, q, q_min, strategy
        self.max_nodes = 1 + k * w
        self.name = f"ngram-{strategy}"
        self._top = bigram_table.tokens[:, :k] if bigram_table is not None else None  # [V, k]
        # Greedy chain after each token: [V, w-1]; row a's bigram draft = [top[a, i], chain[top[a, i]]].
        self._chain = extend_bigram(bigram_table.tokens[:, 0], w - 1) if bigram_table is not None else None
        self._unigram = unigram_tokens[:k] if unigram_tokens is not None else None

    def _chained(self, first: torch.Tensor) -> list[list[int]]:
        """first [k] -> rows [k, w]: each first token followed by its greedy bigram chain."""
        return torch.cat([first[:, None], self._chain[first]], dim=1).tolist()

    def rows(self, ids: torch.Tensor, root: int) -> list[tuple[int, ...]]:
        """The (de-duplicated, at most k) rows this drafter proposes after `root`."""
        sources: list[list[list[int]]] = []
        if self.strategy in ("mixed", "context", "longest_match"):
            seq = torch.cat([ids.reshape(-1).long().cpu(), torch.tensor([int(root)])])  # committed ids + root
        if self.strategy == "longest_match":
            sources.append([longest_match_row(seq, self.q_min, self.q, self.w)])
        if self.strategy in ("mixed", "context"):
            # 2k candidates: some may be dropped as prefixes of others.
            sources.append(context_rows(seq, self.q, self.w, 2 * self.k).tolist())
        if self.strategy in ("mixed", "bigram"):
            sources.append(self._chained(self._top[int(root)]))
        if self.strategy == "unigram":
            sources.append(self._chained(self._unigram))
        return merge_rows(sources, self.k)

    def propose(self, state: DecodeState) -> Tree:
        rows = self.rows(state.ids, state.root)
        if not rows:
            return chain_tree(state.root)
        paths = torch.full((len(rows), self.w), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            paths[i, :len(r)] = torch.tensor(r)
        return tree_from_paths(int(state.root), paths, pad=PAD)


@dataclass(frozen=True)
class Options:
    """k rows of up to w tokens; context n-grams query the last q tokens (down to q_min, 0 = q); strategy mixed |
    context | bigram | unigram | longest_match (vLLM's prompt lookup with k=1); the model bigram table keeps the
    top table_k successors of every token, built in batches of batch_size forwards."""

    k: int = 10  # rows (candidate continuations) per step
    w: int = 10  # tokens per row
    q: int = 1  # longest context n-gram query, in tokens
    q_min: int = 0  # shortest query for longest_match; 0 = q
    strategy: str = "mixed"  # mixed | context | bigram | unigram | longest_match
    table_k: int = 32  # successors kept per token in the model bigram table
    batch_size: int = 256  # tokens per forward while building the bigram table


def ngram_options(extra: dict) -> dict:
    """EvalConfig.extra -> the N-gram options as a dict, defaults filled; unknown keys are an error (typos)."""
    return dataclasses.asdict(parse_options(Options, "ngram", extra))


def build_ngram_drafter(base, extra: dict, *, cache_dir=None) -> tuple[NgramDrafter, dict]:
    """(drafter, report info) for a models.base.LoadedBase from EvalConfig.extra options."""
    from models.families.ngram.model import bigram_table_for, model_unigram

    o = ngram_options(extra)
    table, info = None, {}
    if o["strategy"] not in ("context", "longest_match"):
        table, path, cached = bigram_table_for(base, max(int(o["table_k"]), int(o["k"])), cache_dir=cache_dir,
                                               batch_size=int(o["batch_size"]))
        # the file name only (in the bigram cache dir): reports are kept in the repository, a machine path is not
        info = {"bigram_table": Path(path).name, "bigram_table_cached": cached}
    unigram = model_unigram(base.model)[0] if o["strategy"] == "unigram" else None
    drafter = NgramDrafter(int(o["k"]), int(o["w"]), int(o["q"]), o["strategy"], table, unigram,
                           q_min=int(o["q_min"]) or None)  # 0 = q
    return drafter, {"k": drafter.k, "w": drafter.w, "q": drafter.q, "q_min": drafter.q_min,
                     "strategy": drafter.strategy,
                     "max_nodes": drafter.max_nodes, **info}


build = build_ngram_drafter  # a learning-free family's `build`: (base, extra) -> (drafter, info), no export


def chain(depth: int) -> dict:
    """One prompt-lookup row of up to `depth` tokens: what vLLM's and llama.cpp's n-gram methods draft."""
    return {"extra": {"k": 1, "strategy": "longest_match", "w": depth}}


def num_speculative_tokens(info: dict, drafter) -> int:
    if info.get("k") != 1 or info.get("strategy") != "longest_match":
        raise ValueError("serving engines' n-gram is one prompt-lookup row: give this row `eval: {extra: {k: 1, "
                         "strategy: longest_match, w: W, q: Q, q_min: QMIN}}`")
    return int(info["w"])


def shape(info: dict) -> str:
    return f"k={info.get('k', '?')} w={info.get('w', '?')}"
