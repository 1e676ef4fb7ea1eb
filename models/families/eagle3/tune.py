"""EAGLE-3's declarations for `specdraft tune` and the results tables, read by eval/engine/drafters/registry.py
beside those of models/families/eagle3/drafter.py (kept apart while that module has another owner; they belong there).

    tune_shapes   draft -> (label, eval knobs) of the EAGLE-2 trees tune sweeps besides the chains
    target_key    report extra -> the acceptance-target key of docs/lab/results.md (chain and tree rows apart)
"""

from __future__ import annotations

from models.families.eagle3.drafter import Options

DEFAULT_DEPTH = Options.tree_depth
# EAGLE-2 trees as (nodes with the root, draft steps): where verifying up to ~5 tokens costs about one AR step (a
# 2-core CPU, docs/lab/benchmarks.md) a 4-node tree can win, and 2 draft steps are all its 3 drafted nodes use; the
# larger trees keep the drafter's default depth.
TUNE_TREES = ((4, 2), (8, DEFAULT_DEPTH), (16, DEFAULT_DEPTH), (32, DEFAULT_DEPTH))


def tune_shapes(draft) -> list[tuple[str, dict]]:
    if getattr(draft, "parallel_drafting", False):
        return []  # a P-EAGLE draft drafts chains only (one forward, its mask slots): tune sweeps its chains
    shapes = []
    for n, depth in TUNE_TREES:
        label = f"EAGLE-2 tree, {n} nodes" + (f", depth {depth}" if depth != DEFAULT_DEPTH else "")
        shapes.append((label, {"extra": {"eagle3_mode": "tree", "tree_nodes": n, "tree_depth": depth}}))
    return shapes


def target_key(extra: dict) -> str:
    return "eagle3-chain" if extra.get("eagle3_mode") == "chain" else "eagle3-tree"
