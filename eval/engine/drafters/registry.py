"""Trained draft (from its export) -> the drafter the decoder drives. One entry per family."""

from __future__ import annotations

from eval.engine.drafters.ctc import CTCDrafter
from eval.engine.drafters.eagle3 import Eagle3Drafter
from eval.engine.drafters.hydra import HydraDrafter
from eval.engine.drafters.medusa import MedusaDrafter
from eval.engine.drafters.redrafter import ReDrafterDrafter
from eval.engine.tree import STATIC_TREES, StaticTree

# The static tree each tree-based family uses when neither the eval config nor the export names one.
# tree16: on this project's 2-core CPU a bf16 base verifies up to ~16 tree tokens for about the price of
# one (oneDNN's small-N GEMMs are memory-bound), while 64 nodes cost ~2x; on a GPU medusa63 is the usual
# choice (docs/benchmarks.md). The Hydra issue's tree search will pick sizes by measured throughput.
DEFAULT_TREE = {"medusa": "tree16", "hydra": "tree16"}


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


def _static_tree(family: str, drafter_cls):
    """Builder for the static-tree families (Medusa, Hydra): the tree from resolve_tree (the tree search
    stores its pick as the export's `tree`), checked against the number of heads."""
    def build(draft, export_cfg: dict, eval_cfg):
        tree_name, tree = resolve_tree(family, export_cfg, eval_cfg)
        if tree.depth > draft.num_heads and tree_name == DEFAULT_TREE[family] and eval_cfg.tree == "auto":
            # Nobody asked for this tree: a draft with fewer heads (the demo's one-head Hydra) gets the default
            # tree's first num_heads levels instead of an error.
            tree = StaticTree([c for c in tree.choices if len(c) <= draft.num_heads])
            tree_name = f"{tree_name}[:{draft.num_heads}]"
        if tree.depth > draft.num_heads:
            raise ValueError(f"tree {tree_name!r} is {tree.depth} deep but the draft has {draft.num_heads} heads; "
                             f"pick a shallower tree (tree=...)")
        return drafter_cls(draft, tree), {"tree": tree_name, "tree_nodes": tree.num_nodes}

    return build


def _redrafter(draft, export_cfg: dict, eval_cfg):
    """Beam shape from eval extra.beam_width / extra.beam_length, else the export's defaults. The tree is
    built per step from the beams, so eval's `tree` / `tree_choices` do not apply (and are ignored)."""
    width = int(eval_cfg.extra.get("beam_width", export_cfg.get("beam_width", draft.beam_width)))
    length = int(eval_cfg.extra.get("beam_length", export_cfg.get("beam_length", draft.beam_length)))
    drafter = ReDrafterDrafter(draft, width, length)
    return drafter, {"beam_width": width, "beam_length": length, "max_nodes": drafter.max_nodes}


def _ctc(draft, export_cfg: dict, eval_cfg):
    """Raw candidates from eval extra (ctc_search static|joint, ctc_paths = rank tuples over the frames,
    ctc_num_paths, ctc_topk), else the export's, else 24 static paths over the top-4 per frame. The tree
    is built per step from the collapsed candidates, so eval's `tree` / `tree_choices` do not apply."""
    def opt(key, default):
        return eval_cfg.extra.get(key, export_cfg.get(key, default))

    search = str(opt("ctc_search", "static"))
    paths = opt("ctc_paths", None)
    drafter = CTCDrafter(draft, [tuple(c) for c in paths] if paths else None, search=search,
                         num_paths=int(opt("ctc_num_paths", 24)), topk=int(opt("ctc_topk", 4)))
    return drafter, {"ctc_search": search, "ctc_num_paths": drafter.num_paths, "ctc_topk": drafter.topk,
                     "max_nodes": drafter.max_nodes}


def _eagle3(draft, export_cfg: dict, eval_cfg):
    """eval extra: eagle3_mode chain|tree (default tree), chain_length K (default 4), tree_topk / tree_depth /
    tree_nodes (default 4 / 4 / 16, root counted: the size tree16 has on this CPU), else the export's keys.
    The tree is built per step from the draft's scores, so eval's `tree` / `tree_choices` do not apply."""
    def opt(key, default):
        return eval_cfg.extra.get(key, export_cfg.get(key, default))

    drafter = Eagle3Drafter(draft, mode=str(opt("eagle3_mode", "tree")), chain_length=int(opt("chain_length", 4)),
                            tree_topk=int(opt("tree_topk", 4)), tree_depth=int(opt("tree_depth", 4)),
                            tree_nodes=int(opt("tree_nodes", 16)))
    info = {"eagle3_mode": drafter.mode, "max_nodes": drafter.max_nodes}
    info.update({"chain_length": drafter.chain_length} if drafter.mode == "chain" else
                {"tree_topk": drafter.tree_topk, "tree_depth": drafter.tree_depth, "tree_nodes": drafter.tree_nodes})
    return drafter, info


DRAFTER_BUILDERS = {"medusa": _static_tree("medusa", MedusaDrafter), "hydra": _static_tree("hydra", HydraDrafter),
                    "redrafter": _redrafter, "ctc": _ctc, "eagle3": _eagle3}


def build_drafter(draft, export_cfg: dict, eval_cfg):
    family = export_cfg["family"]
    if family not in DRAFTER_BUILDERS:
        raise ValueError(f"no decoder support for draft family {family!r} yet; known: {sorted(DRAFTER_BUILDERS)}")
    return DRAFTER_BUILDERS[family](draft, export_cfg, eval_cfg)
