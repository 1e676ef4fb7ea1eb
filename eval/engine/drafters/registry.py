"""Trained draft (from its export) -> the drafter the decoder drives. One entry per family.

Each family's drafter module declares, next to its Drafter class:
    Options       the frozen dataclass of its eval options (EvalConfig.extra; unknown keys are an error)
    build         (draft, export_cfg, eval_cfg, options) -> (drafter, report info)
    chain         depth -> EvalConfig overrides that make it draft a chain of top-1 tokens, what serving engines run
    chain_depth   (report info, drafter) -> drafted tokens per step of a row shaped as that chain (ValueError: how)
    shape         report info -> the draft's shape in a table cell ("tree16, 16 nodes", "8 beams × 3")
and, where the default does not fit (a module that leaves one out gets it):
    tune_shapes     draft -> (label, eval knobs) pairs `specdraft tune` sweeps besides the chains (default: none)
    searched_trees  True: tune also sweeps trees the tree search grows from the heads' ranks (default: False)
    max_chain       draft -> the deepest chain it drafts, what serving engines are asked for at most (default:
                    None, any depth)
    target_key      report extra -> its acceptance-target key in docs/lab/results.md (default: the family name)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

from eval.engine.drafters import ctc, dflash, dspark, eagle3, eagle3_tune, hydra, medusa, ngram, redrafter
from eval.engine.drafters.options import option_names, parse_options


def _no_shapes(draft) -> list[tuple[str, dict]]:
    return []


def _any_depth(draft) -> int | None:
    return None


@dataclasses.dataclass(frozen=True)
class DrafterFamily:
    options: type
    build: Callable | None  # None: learning-free (no export to build from; ngram.build_ngram_drafter)
    chain: Callable[[int], dict]
    chain_depth: Callable[[dict, object], int]
    shape: Callable[[dict], str]
    tune_shapes: Callable[[object], list[tuple[str, dict]]] = _no_shapes
    searched_trees: bool = False
    max_chain: Callable[[object], int | None] = _any_depth
    target_key: Callable[[dict], str] | None = None  # None: the family name

    @classmethod
    def of(cls, module: ModuleType, trained: bool = True, more: ModuleType | None = None) -> DrafterFamily:
        """The declaration in `module` (and in `more`, for declarations kept in a second module)."""
        optional = {name: getattr(m, name) for m in (module, more) if m is not None
                    for name in ("tune_shapes", "searched_trees", "max_chain", "target_key") if hasattr(m, name)}
        return cls(module.Options, module.build if trained else None, module.chain, module.chain_depth, module.shape,
                   **optional)

    def option_names(self) -> list[str]:
        return option_names(self.options)


DRAFTERS = {
    "medusa": DrafterFamily.of(medusa),
    "hydra": DrafterFamily.of(hydra),
    "redrafter": DrafterFamily.of(redrafter),
    "ctc": DrafterFamily.of(ctc),
    "eagle3": DrafterFamily.of(eagle3, more=eagle3_tune),
    "dflash": DrafterFamily.of(dflash),
    "dspark": DrafterFamily.of(dspark),
    "ngram": DrafterFamily.of(ngram, trained=False),
}


def drafter_family(family: str) -> DrafterFamily:
    if family not in DRAFTERS:
        raise ValueError(f"no decoder support for draft family {family!r}; known: {', '.join(DRAFTERS)}")
    return DRAFTERS[family]


def build_drafter(draft, export_cfg: dict, eval_cfg):
    """(drafter, report info) for a loaded draft; the family's options are read from eval_cfg.extra (else the
    export's config.json, else their defaults) and checked first."""
    family = export_cfg["family"]
    spec = drafter_family(family)
    if spec.build is None:
        raise ValueError(f"the {family} family is learning-free: run it with `--method {family}`, not from an export")
    options = parse_options(spec.options, family, eval_cfg.extra, export_cfg)
    return spec.build(draft, export_cfg, eval_cfg, options)


def chain_overrides(family: str, depth: int) -> dict:
    """EvalConfig overrides that make `family` draft a chain of `depth` top-1 tokens (what serving engines run)."""
    return drafter_family(family).chain(depth)
