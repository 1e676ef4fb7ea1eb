"""Data-driven static tree search (Hydra §4, docs/howto/tree_search.md): grow a tree node by node from rank statistics,
then pick its size by measured throughput (the measuring part lives in eval/harness/tree_search_cli.py).

Why rank statistics are enough under greedy decoding. At a decode step with committed ids[..t] and root
ids[t+1] (the base's own token), the static-tree node with rank path (r_1..r_k) is accepted iff for every
j <= k the base's true next token ids[t+1+j] has rank r_j among the drafter's depth-j candidates (given
the true path, for path-dependent drafters such as Hydra). Ranks are unique per depth, so at most one node
per depth is hit and the hit nodes form one path from the root: accepted drafts at that step = number of
tree nodes hit. Hence, with P(c) = fraction of positions t where node c is hit,

    expected acceptance length of a tree = 1 + sum_{c in tree} P(c),

with t running over the base's OWN greedy continuations of held-out prompts (what greedy speculative
decoding sees). Adding a node adds exactly its P, and P(child) <= P(parent) (hits are nested), so the
greedy growth below (add the frontier node with the largest P) yields, for every size n, an n-node tree
with the largest estimated acceptance of all n-node trees.

Positions are weighted uniformly; a real decode only drafts at its step boundaries (which depend on the
tree). The estimate is therefore exact per step and equal in expectation, not per sequence.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.config_loader import ConfigError, load_typed

Choice = tuple[int, ...]


@dataclass
class TreeSearchConfig:
    """`specdraft tree-search`; YAML delta configs/eval/tree_search.yaml, `key=value` overrides."""

    # Tuning data: held-out ShareGPT prompts (never the eval set), the base's own greedy continuations.
    dataset: str = "sharegpt"  # sharegpt (held-out part) | a .jsonl of prompts
    num_prompts: int = 16  # tuning prompts whose rank statistics grow the tree
    new_tokens: int = 64  # greedy continuation per prompt = number of positions per prompt
    max_prompt_tokens: int | None = 512  # longer prompts are skipped
    heldout_skip: int | None = None  # None = the conversations the draft trained on (export's train_data)
    exclude_eval: str = "configs/eval/sharegpt.yaml"  # this eval config's prompts are never tuning prompts
    seed: int = 1  # prompt draw (the eval configs use seed 0)
    # Growth.
    max_nodes: int = 64  # tree nodes besides the root
    max_depth: int | None = None  # None = every depth the draft predicts (Medusa: num_heads)
    max_rank: int = 10  # candidates per depth considered (ranks >= max_rank never enter a tree)
    # Throughput: sizes timed with real decode steps on this machine.
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    timing_prompts: int = 2  # the first N tuning prompts
    timing_new_tokens: int = 48  # tokens per timing run (with timing_prompts, timing_repeats)
    timing_repeats: int = 2  # timed passes per size; the fastest counts (robust to other processes' noise)
    warmup_tokens: int = 8  # one untimed generation per size first
    backend: str = "auto"  # auto (fast where supported, else hf) | fast | hf
    dtype: str = "fast"  # base dtype to tune for: bf16 where the hardware runs it fast, else fp32 (fast_dtype)
    device: str = "auto"  # auto = cuda if available, else cpu
    base_path: str = ""  # "" = the base named in the export's config.json
    num_threads: int = 0  # CPU threads; 0 = torch's default
    out_dir: str = ""  # "" = <export>/../tree_search
    write_export: bool = True  # store the chosen tree as "tree" in the export's config.json


def validate_tree_search(cfg: TreeSearchConfig) -> TreeSearchConfig:
    def fail(key, value, fix):
        raise ConfigError(f"invalid value {key}={value!r}: {fix}")

    for key in ("num_prompts", "new_tokens", "max_nodes", "max_rank", "timing_prompts", "timing_new_tokens",
                "timing_repeats"):
        if getattr(cfg, key) < 1:
            fail(key, getattr(cfg, key), "use a positive count")
    if cfg.warmup_tokens < 0:
        fail("warmup_tokens", cfg.warmup_tokens, "use 0 (no warm-up) or a positive count")
    if cfg.max_depth is not None and cfg.max_depth < 1:
        fail("max_depth", cfg.max_depth, "use None (every head) or at least 1")
    if not cfg.sizes or min(cfg.sizes) < 1:
        fail("sizes", cfg.sizes, "give a non-empty list of tree sizes >= 1 (nodes besides the root)")
    if cfg.timing_prompts > cfg.num_prompts:
        fail("timing_prompts", cfg.timing_prompts, f"use at most num_prompts={cfg.num_prompts}")
    if cfg.backend not in ("auto", "fast", "hf"):
        fail("backend", cfg.backend, "use auto (fast where supported, else hf), fast or hf")
    if cfg.dtype not in ("fp32", "bf16", "fp16", "auto", "fast"):
        fail("dtype", cfg.dtype, "use fp32, bf16, fp16, auto (fp32 on CPU) or fast (bf16 where the hardware "
             "runs it fast, else fp32)")
    if cfg.heldout_skip is not None and cfg.heldout_skip < 0:
        fail("heldout_skip", cfg.heldout_skip, "use None (from the export) or a count of conversations >= 0")
    return cfg


def load_tree_search_config(config_paths: list[str] | None = None,
                            overrides: list[str] | None = None) -> TreeSearchConfig:
    return validate_tree_search(load_typed(TreeSearchConfig, config_paths, overrides))


# ---------------------------------------------------------------------------------------------------
# Rank statistics -> node hit counts
# ---------------------------------------------------------------------------------------------------


def hit_path(row: Sequence[int], max_rank: int) -> Choice:
    """The deepest node hit at one position: the ranks of one row up to the first unknown (-1) or
    out-of-range (>= max_rank) entry. Every prefix of it is hit too, and nothing else."""
    path = []
    for r in row:
        if r < 0 or r >= max_rank:
            break
        path.append(int(r))
    return tuple(path)


def node_hit_counts(ranks: torch.Tensor, max_rank: int) -> Counter:
    """ranks [N, D] long (one row per position, see `true_path_ranks`) -> Counter {choice: positions
    where that node is hit}. Only nodes with at least one hit appear."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        path = hit_path(row, max_rank)
        for k in range(1, len(path) + 1):
            counts[path[:k]] += 1
    return counts


def step_hits(choices: Sequence[Sequence[int]], row: Sequence[int]) -> int:
    """Slow twin, one position: the number of tree nodes whose rank path equals the row's prefix
    (= accepted drafts at a greedy step at this position). -1 entries never match."""
    return sum(1 for c in choices if len(c) <= len(row) and all(row[j] == c[j] for j in range(len(c))))


def tree_acceptance(choices: Sequence[Sequence[int]], counts: Counter, num_positions: int) -> float:
    """Predicted acceptance length 1 + sum_c P(c) of a static tree from node hit counts."""
    if num_positions < 1:
        raise ValueError("no positions to estimate from; generate longer continuations or more prompts")
    return 1.0 + sum(counts.get(tuple(c), 0) for c in choices) / num_positions


def tree_acceptance_reference(choices: Sequence[Sequence[int]], ranks: torch.Tensor) -> float:
    """Slow twin of `tree_acceptance`: check every node against every position's ranks."""
    rows = ranks.tolist()
    return 1.0 + sum(step_hits(choices, row) for row in rows) / len(rows)


# ---------------------------------------------------------------------------------------------------
# Greedy growth and size choice
# ---------------------------------------------------------------------------------------------------


@dataclass
class GrownNode:
    choice: Choice  # rank path from the root
    count: int  # positions where it is hit
    p_hit: float  # count / positions = its contribution to the expected acceptance length


def grow_tree(counts: Counter, num_positions: int, max_nodes: int) -> list[GrownNode]:
    """Greedy growth from the root: repeatedly add the child of a tree node (or of the root) with the
    most hits. Returns the nodes in insertion order; its first n entries are the n-node tree.

    Stops early when no candidate has a hit (a node never hit cannot raise acceptance, only cost).
    Ties go to the shallower, then lexicographically smaller, rank path, so runs are deterministic.
    """
    children: dict[Choice, list[Choice]] = {}
    for c in counts:
        children.setdefault(c[:-1], []).append(c)
    frontier = [(-counts[c], len(c), c) for c in children.get((), [])]
    heapq.heapify(frontier)
    grown: list[GrownNode] = []
    while frontier and len(grown) < max_nodes:
        neg, _, c = heapq.heappop(frontier)
        grown.append(GrownNode(c, -neg, -neg / num_positions))
        for child in children.get(c, []):
            heapq.heappush(frontier, (-counts[child], len(child), child))
    return grown


def acceptance_curve(grown: Sequence[GrownNode]) -> list[float]:
    """[n + 1] predicted acceptance of the first n grown nodes, n = 0 (root only: 1.0) .. len(grown)."""
    curve = [1.0]
    for node in grown:
        curve.append(curve[-1] + node.p_hit)
    return curve


def tree_choices(grown: Sequence[GrownNode], size: int) -> list[list[int]]:
    """The `size`-node tree as Medusa-style choices, sorted (depth, ranks) like StaticTree."""
    return [list(c) for c in sorted((n.choice for n in grown[:size]), key=lambda c: (len(c), c))]


def candidate_sizes(sizes: Sequence[int], num_grown: int) -> list[int]:
    """Sizes to time: the configured ones, capped at the grown tree's size (0 if nothing was ever hit)."""
    return sorted({min(int(s), num_grown) for s in sizes} - {0})


def pick_size(sizes: Sequence[int], predicted_acceptance: Sequence[float], step_times: Sequence[float]) -> int:
    """Index of the size with the best predicted throughput = acceptance / seconds per base step."""
    if not sizes:
        raise ValueError("no tree size to choose from")
    tps = [a / s for a, s in zip(predicted_acceptance, step_times, strict=True)]
    return max(range(len(sizes)), key=lambda i: (tps[i], -sizes[i]))  # a tie goes to the smaller tree
