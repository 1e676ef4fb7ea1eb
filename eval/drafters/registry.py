"""Trained draft (from its export) -> the drafter the decoder drives. One entry per family."""

from __future__ import annotations

from eval.drafters.medusa import MedusaDrafter
from eval.tree import STATIC_TREES, StaticTree

# The static tree each tree-based family uses when neither the eval config nor the export names one.
# tree16: on this project's 2-core CPU a bf16 base verifies up to ~16 tree tokens for about the price of
# one (oneDNN's small-N GEMMs are memory-bound), while 64 nodes cost ~2x; on a GPU medusa63 is the usual
# choice (docs/benchmarks.md). The Hydra issue's tree search will pick sizes by measured throughput.
DEFAULT_TREE = {"medusa": "tree16"}


def resolve_tree(family: str, export_cfg: dict, eval_cfg) -> tuple[str, StaticTree]:
    """Explicit choices > eval config's tree name > the export's stored tree > the family default."""
    if eval_cfg.tree_choices:
        return "custom", StaticTree([tuple(c) for c in eval_cfg.tree_choices])
    if eval_cfg.tree != "auto":
        return eval_cfg.tree, StaticTree(STATIC_TREES[eval_cfg.tree])
    stored = export_cfg.get("tree")
    if isinstance(stored, list):
        return "export", StaticTree([tuple(c) for c in stored])
    name = stored if isinstance(stored, str) else DEFAULT_TREE[family]
    return name, StaticTree(STATIC_TREES[name])


def _medusa(draft, export_cfg: dict, eval_cfg):
    tree_name, tree = resolve_tree("medusa", export_cfg, eval_cfg)
    if tree.depth > draft.num_heads:
        raise ValueError(f"tree {tree_name!r} is {tree.depth} deep but the draft has {draft.num_heads} heads; "
                         f"pick a shallower tree (tree=...)")
    return MedusaDrafter(draft, tree), {"tree": tree_name, "tree_nodes": tree.num_nodes}


DRAFTER_BUILDERS = {"medusa": _medusa}


def build_drafter(draft, export_cfg: dict, eval_cfg):
    family = export_cfg["family"]
    if family not in DRAFTER_BUILDERS:
        raise ValueError(f"no decoder support for draft family {family!r} yet; known: {sorted(DRAFTER_BUILDERS)}")
    return DRAFTER_BUILDERS[family](draft, export_cfg, eval_cfg)
