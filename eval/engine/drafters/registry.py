"""Trained draft (from its export) -> the drafter the decoder drives, for every family the model registry knows.

Each family's drafter module is the role module `drafter` of its package (models/families/<name>/drafter.py,
`<FamilySpec.package>.drafter`; no list of them is kept here). It declares, next to its Drafter class:
    Options       the frozen dataclass of its eval options (EvalConfig.extra; unknown keys are an error). Drafts
                  per step, where a family has that knob, is `num_speculative_tokens` (vLLM's name) in every family,
                  its default the family's natural count: a number where it is fixed (EAGLE-3's chain: 4), else
                  None, which `build` reads as the draft's `max_speculative_tokens` (the block families: DFlash's
                  block_size - 1, DSpark's and Domino's block_size). Its older names are read as it, with a note
                  (models/export/schema.py: upgrade_keys, the one mapping of old keys)
    build         (draft, export_cfg, eval_cfg, options) -> (drafter, report info); a learning-free family's
                  (FamilyFacts.trainable = False): (base, extra) -> (drafter, report info), no export to build from
    chain         depth -> EvalConfig overrides that make it draft a chain of top-1 tokens, what serving engines run
    num_speculative_tokens  (report info, drafter) -> drafted tokens per step of a row shaped as that chain
                  (ValueError: how); where it is an option, the report info carries it under the same name
    shape         report info -> the draft's shape in a table cell ("tree16, 16 nodes", "8 beams × 3")
and, where the default does not fit (a module that leaves one out gets it):
    tune_shapes     draft -> (label, eval knobs) pairs `specdraft tune` sweeps besides the chains (default: none)
    searched_trees  True: tune also sweeps trees the tree search grows from the heads' ranks (default: False)
    max_speculative_tokens  draft -> the deepest chain it drafts, what serving engines are asked for at most
                    (default: None, any depth)
    target_key      report extra -> its acceptance-target key in docs/lab/results.md (default: the family name)
    run_lockstep    the field benchmark's batched path (eval/field/simulation.py): (drafter, prompts, load, n_of, eos,
                    done, *, width, redo) -> prompts redone, its prompts stepped together; load(ref) -> (the base's
                    rows the draft reads at every position: its aux layers where it lists aux_layers, else the final
                    hidden states; differs) (default: None, the per-prompt path)
The package's role modules `tune` and `lockstep` (models/families/<name>/tune.py, lockstep.py), where there are
some, add the optional declarations they hold (EAGLE-3's tune shapes and target key; the batched field paths of
EAGLE-3, Hydra, Medusa, DFlash, DSpark and Domino).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType

from eval.engine.drafters.options import option_names, parse_options
from models.registry import FAMILIES, SPECS, learning_free_families

OPTIONAL = ("tune_shapes", "searched_trees", "max_speculative_tokens", "target_key", "run_lockstep")
# role modules of a family's package that may add OPTIONAL declarations to its drafter's
MORE_ROLES = ("tune", "lockstep")


def _no_shapes(draft) -> list[tuple[str, dict]]:
    return []


def _any_depth(draft) -> int | None:
    return None


@dataclasses.dataclass(frozen=True)
class DrafterFamily:
    options: type
    build: Callable  # trained: (draft, export_cfg, eval_cfg, options); learning-free: (base, extra)
    chain: Callable[[int], dict]
    num_speculative_tokens: Callable[[dict, object], int]
    shape: Callable[[dict], str]
    tune_shapes: Callable[[object], list[tuple[str, dict]]] = _no_shapes
    searched_trees: bool = False
    max_speculative_tokens: Callable[[object], int | None] = _any_depth
    target_key: Callable[[dict], str] | None = None  # None: the family name
    run_lockstep: Callable | None = None  # None: the field judges it one prompt at a time

    @classmethod
    def of(cls, module: ModuleType, more: tuple[ModuleType, ...] = ()) -> DrafterFamily:
        """The declaration in `module` (and the optional ones in `more`, a family's further drafter modules)."""
        optional = {name: getattr(m, name) for m in (module, *more) for name in OPTIONAL if hasattr(m, name)}
        return cls(module.Options, module.build, module.chain, module.num_speculative_tokens, module.shape,
                   **optional)

    def option_names(self) -> list[str]:
        return option_names(self.options)


def _module(family: str, role: str) -> ModuleType | None:
    """The role module `<package>.<role>` of a family's package, or None where the package has none."""
    name = f"{SPECS[family].package}.{role}"
    return importlib.import_module(name) if importlib.util.find_spec(name) else None


def _load(family: str) -> DrafterFamily | None:
    module = _module(family, "drafter")
    if module is None:
        return None
    more = tuple(m for m in (_module(family, role) for role in MORE_ROLES) if m is not None)
    return DrafterFamily.of(module, more=more)


# Family -> its declaration, for every registered family whose package has a drafter module (a family without one
# fails tests/test_configs.py's completeness test, and `drafter_family` names the missing module).
DRAFTERS = {family: spec for family in FAMILIES if (spec := _load(family)) is not None}


def drafter_family(family: str) -> DrafterFamily:
    if family not in DRAFTERS and family in SPECS and (spec := _load(family)) is not None:
        DRAFTERS[family] = spec  # registered after this module loaded (register_family)
    if family not in DRAFTERS:
        known = f"known: {', '.join(DRAFTERS)}"
        if family in FAMILIES:
            raise ValueError(f"no decoder support for draft family {family!r}: its drafter module "
                             f"{SPECS[family].package}.drafter is missing ({known})")
        raise ValueError(f"no decoder support for draft family {family!r}; {known}")
    return DRAFTERS[family]


def lockstep_runner(drafter) -> Callable | None:
    """The batched field path its family declares for `drafter` (run_lockstep), or None (a family without one, or a
    drafter of no family: the autoregressive baseline)."""
    spec = DRAFTERS.get(getattr(drafter, "name", None))
    return None if spec is None else spec.run_lockstep


def build_drafter(draft, export_cfg: dict, eval_cfg):
    """(drafter, report info) for a loaded draft; the family's options are read from eval_cfg.extra (else the
    export's config.json, else their defaults) and checked first."""
    family = export_cfg["family"]
    spec = drafter_family(family)
    if not FAMILIES[family].trainable:
        raise ValueError(f"the {family} family is learning-free: run it with `--method {family}`, not from an export")
    options = parse_options(spec.options, family, eval_cfg.extra, export_cfg)
    return spec.build(draft, export_cfg, eval_cfg, options)


def method_options(method: str, extra: dict) -> dict:
    """A learning-free family's options (`--method <name>`: no export) read from EvalConfig.extra, defaults filled;
    an unknown method or key is an error."""
    free = learning_free_families()
    if method not in free:
        raise ValueError(f"unknown --method {method!r}; learning-free methods: {', '.join(free)} (trained drafts: "
                         "--draft runs/<run>/export)")
    return dataclasses.asdict(parse_options(drafter_family(method).options, method, extra))


def build_learning_free(method: str, base, extra: dict):
    """(drafter, report info) of a learning-free family on a loaded base (models.base.LoadedBase), its options read
    from EvalConfig.extra: the family's `build` (base, extra)."""
    method_options(method, extra)
    return drafter_family(method).build(base, extra)


def chain_overrides(family: str, depth: int) -> dict:
    """EvalConfig overrides that make `family` draft a chain of `depth` top-1 tokens (what serving engines run)."""
    return drafter_family(family).chain(depth)
