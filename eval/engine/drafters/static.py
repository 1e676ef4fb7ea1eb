"""Static trees for the families whose heads give a top-k per depth (Medusa, Hydra): which tree a run uses, and
the chain serving engines draft (each depth's top-1)."""

from __future__ import annotations

from eval.engine.tree import STATIC_TREES, StaticTree, chain_choices

# The static tree each tree-based family uses when neither the eval config nor the export names one.
# tree16: on a 2-core CPU a bf16 base verifies up to ~16 tree tokens for about the price of one (oneDNN's small-N
# GEMMs are memory-bound), while 64 nodes cost ~2x; on a GPU medusa63 is the usual choice (docs/lab/benchmarks.md).
DEFAULT_TREE = "tree16"


def resolve_tree(export_cfg: dict, eval_cfg) -> tuple[str, StaticTree]:
    """Explicit choices > eval config's tree name > the export's stored tree > the default."""
    if eval_cfg.tree_choices:
        return "custom", StaticTree([tuple(c) for c in eval_cfg.tree_choices])
    if eval_cfg.tree != "auto":
        return eval_cfg.tree, StaticTree(STATIC_TREES[eval_cfg.tree])
    stored = export_cfg.get("tree")
    if isinstance(stored, list):
        return "export", StaticTree([tuple(c) for c in stored])
    name = stored if isinstance(stored, str) else DEFAULT_TREE
    return name, StaticTree(STATIC_TREES[name])


def build_static_tree_drafter(drafter_cls, draft, export_cfg: dict, eval_cfg):
    """The tree from resolve_tree (the tree search stores its pick as the export's `tree`), checked against the
    number of heads; returns (drafter, report info)."""
    tree_name, tree = resolve_tree(export_cfg, eval_cfg)
    if tree.depth > draft.num_heads and tree_name == DEFAULT_TREE and eval_cfg.tree == "auto":
        # Nobody asked for this tree: a draft with fewer heads (the demo's one-head Hydra) gets the default
        # tree's first num_heads levels instead of an error.
        tree = StaticTree([c for c in tree.choices if len(c) <= draft.num_heads])
        tree_name = f"{tree_name}[:{draft.num_heads}]"
    if tree.depth > draft.num_heads:
        raise ValueError(f"tree {tree_name!r} is {tree.depth} deep but the draft has {draft.num_heads} heads; "
                         f"pick a shallower tree (tree=...)")
    return drafter_cls(draft, tree), {"tree": tree_name, "tree_nodes": tree.num_nodes}


def static_tree_builder(drafter_cls):
    """The `build` of a static-tree family's declaration (its options are the eval config's tree keys)."""
    def build(draft, export_cfg: dict, eval_cfg, options):
        return build_static_tree_drafter(drafter_cls, draft, export_cfg, eval_cfg)
    return build


def static_chain(depth: int) -> dict:
    """Eval overrides that make a static-tree family draft the chain of each depth's top-1 (what engines run)."""
    return {"tree": "auto", "tree_choices": chain_choices(depth)}


def static_num_speculative_tokens(info: dict, drafter) -> int:
    choices = [tuple(c) for c in drafter.tree.choices]
    if not choices or choices != [(0,) * j for j in range(1, len(choices) + 1)]:
        raise ValueError("serving engines draft a chain of each head's top-1: give this row `eval: {tree: chain4}` "
                         "(or tree_choices [[0], [0, 0], ...])")
    return len(choices)


# The static trees `specdraft tune` sweeps besides the chains (chain4 is a chain, already swept).
TUNE_TREES = ("wide2", "tree16", "medusa63")


def static_tune_shapes(draft) -> list[tuple[str, dict]]:
    """(label, eval knobs) of each tuned static tree; one deeper than the draft's heads is left out when built."""
    return [(f"{name} ({len(STATIC_TREES[name])} nodes)", {"tree": name, "tree_choices": None}) for name in TUNE_TREES]


def heads_max_speculative_tokens(draft) -> int:
    """A static-tree draft with K heads drafts at most K tokens per step (one per head)."""
    return int(draft.num_heads)


def static_shape(info: dict) -> str:
    """The draft shape in a table cell, from the report info of a static-tree row."""
    if info.get("tree_search_nodes"):
        return f"searched, {info['tree_search_nodes']} nodes"
    if info.get("tree") == "export":  # the tree stored in the export (`specdraft tree-search` writes it), root included
        return f"export's tree, {info.get('tree_nodes', '?')} nodes"
    return f"{info.get('tree', '?')}, {info.get('tree_nodes', '?')} nodes"
