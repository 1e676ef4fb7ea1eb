"""Draft families by name: the trainable models (DRAFT_MODELS) and every family's declared facts (FAMILIES).

Adding a family: one file in models/, one line in DRAFT_MODELS (docs/howto/add_a_family.md has the checklist)."""

from __future__ import annotations

from models.ctc import CTCDraft
from models.dflash import DFlashDraft
from models.dspark import DSparkDraft
from models.eagle3 import Eagle3Draft
from models.family import FamilyFacts
from models.hydra import HydraDraft
from models.medusa import MedusaDraft
from models.ngram import NGRAM_FACTS
from models.redrafter import ReDrafterDraft

DRAFT_MODELS = {cls.facts.name: cls for cls in (MedusaDraft, HydraDraft, ReDrafterDraft, CTCDraft, Eagle3Draft,
                                                DFlashDraft, DSparkDraft)}

# Every family, learning-free ones included.
FAMILIES: dict[str, FamilyFacts] = {**{name: cls.facts for name, cls in DRAFT_MODELS.items()},
                                    NGRAM_FACTS.name: NGRAM_FACTS}


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


def learning_free_vllm_families() -> tuple[str, ...]:
    """Learning-free families vLLM serves (no export: `--method <name>` of serve-check and `export --format vllm`)."""
    return tuple(name for name, f in FAMILIES.items() if not f.trainable and f.vllm_method)


def llamacpp_families() -> tuple[str, ...]:
    """Families llama.cpp serves (a `llamacpp_spec_type` declared)."""
    return tuple(name for name, f in FAMILIES.items() if f.llamacpp_spec_type)
