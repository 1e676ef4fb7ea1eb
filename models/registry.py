"""Draft families by name, found where they are declared: the trainable models (DRAFT_MODELS) and every family's
facts (FAMILIES), learning-free ones included. No list of families is written down here or anywhere else.

A module of models/ declares a family when it defines `facts = FamilyFacts(...)`: on its DraftModel subclass (a
trainable family: that class is its model) or at module level (a learning-free family, such as N-gram). The module
is named after the family (models/<name>.py), which is how the family's other files are found by its name
(eval/engine/drafters/<name>.py, configs/<name>.yaml, docs/families/<name>.md). Families are in name order.
Adding a family: docs/howto/add_a_family.md.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

from models.draft import DraftModel
from models.family import FamilyFacts

MODELS_DIR = Path(__file__).resolve().parent


def _declares_facts(path: Path) -> bool:
    """Whether the module assigns `facts` at its top level or in the body of one of its classes (read with ast, so
    the scan imports only the modules that declare a family)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bodies = [tree.body] + [node.body for node in tree.body if isinstance(node, ast.ClassDef)]
    return any(isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "facts" for t in stmt.targets)
               for body in bodies for stmt in body)


def _declaration(module: ModuleType) -> tuple[FamilyFacts, type | None]:
    """(facts, model class or None) of the family `module` declares; a wrong declaration fails naming the fix."""
    where = f"models/{module.__name__.rpartition('.')[2]}.py"
    classes = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, DraftModel)
               and v.__module__ == module.__name__ and "facts" in v.__dict__]
    if len(classes) > 1:
        raise ValueError(f"{where} declares facts on {len(classes)} classes; one family, one model module")
    model = classes[0] if classes else None
    facts = model.facts if model else vars(module).get("facts")
    if not isinstance(facts, FamilyFacts):
        raise ValueError(f"{where}: `facts` must be a FamilyFacts (models/family.py), got {type(facts).__name__}")
    if facts.trainable != (model is not None):
        raise ValueError(f"{where}: a trainable family declares its facts on its DraftModel class, a learning-free "
                         "one (trainable=False) at module level")
    if facts.name != module.__name__.rpartition(".")[2]:
        raise ValueError(f"{where} declares the family {facts.name!r}: name the module after its family "
                         f"(models/{facts.name}.py)")
    return facts, model


def _discover(models_dir: Path = MODELS_DIR) -> tuple[dict[str, FamilyFacts], dict[str, type]]:
    families, models = {}, {}
    for path in sorted(models_dir.glob("*.py")):
        if path.stem.startswith("_") or path.stem == "registry" or not _declares_facts(path):
            continue
        facts, model = _declaration(importlib.import_module(f"models.{path.stem}"))
        families[facts.name] = facts
        if model is not None:
            models[facts.name] = model
    return families, models


# Every family, learning-free ones included; and the model class of every trainable one.
FAMILIES, DRAFT_MODELS = _discover()


def family_facts(name: str) -> FamilyFacts:
    if name not in FAMILIES:
        raise ValueError(f"unknown draft family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def vllm_families() -> tuple[str, ...]:
    """Families vLLM serves (a `vllm_method` declared)."""
    return tuple(name for name, f in FAMILIES.items() if f.vllm_method)


def option_sections(section: str) -> dict[str, type]:
    """Family name -> the dataclass of its own options in a training-config section ("draft": facts.draft_options,
    "loss": facts.loss_options), for the families that have some; train/config.py nests each as <section>.<name>."""
    attr = {"draft": "draft_options", "loss": "loss_options"}[section]
    return {name: getattr(f, attr) for name, f in FAMILIES.items() if getattr(f, attr) is not None}


def config_key_owners() -> dict[str, str]:
    """Training-config key ("draft.eagle3.ttt_steps") -> the family whose own options it is (its draft_options /
    loss_options); keys several families read (draft.num_heads, draft.aux_layers) are shared, in no family's."""
    return {key: name for name, facts in FAMILIES.items() for key in facts.option_keys()}


def flat_key_owners() -> dict[str, str]:
    """Flat key of the time before family sections ("draft.ttt_steps") -> the family it moved into
    (FamilyFacts.flat_keys): old configs keep loading, read as draft.<family>.<key>."""
    owners: dict[str, str] = {}
    for name, facts in FAMILIES.items():
        for key in facts.flat_keys:
            if key in owners:
                raise ValueError(f"flat key {key} is declared by both {owners[key]} and {name}; an old key moved into "
                                 "one family's section")
            owners[key] = name
    return owners


def learning_free_families() -> tuple[str, ...]:
    """Families with nothing to train (`specdraft eval --method <name>`)."""
    return tuple(name for name, f in FAMILIES.items() if not f.trainable)


def learning_free_vllm_families() -> tuple[str, ...]:
    """Learning-free families vLLM serves (no export: `--method <name>` of serve-check and `export --format vllm`)."""
    return tuple(name for name in learning_free_families() if FAMILIES[name].vllm_method)


def llamacpp_families() -> tuple[str, ...]:
    """Families llama.cpp serves (a `llamacpp_spec_type` declared)."""
    return tuple(name for name, f in FAMILIES.items() if f.llamacpp_spec_type)


def chain_estimate_families() -> tuple[str, ...]:
    """Families whose loss the teacher-forced chain estimate can read (FamilyFacts.chain_estimate)."""
    return tuple(name for name, f in FAMILIES.items() if f.chain_estimate)


def vllm_schedule_methods() -> tuple[str, ...]:
    """vLLM methods whose proposer drafts the count scheduled per step (FamilyFacts.vllm_schedule)."""
    return tuple(dict.fromkeys(f.vllm_method for f in FAMILIES.values() if f.vllm_schedule))
