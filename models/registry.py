"""Draft families by name, read from their one registration (models/families/__init__.py: BUILT_IN and
register_family): the trainable models (DRAFT_MODELS), every family's facts (FAMILIES), learning-free ones included,
and what the rest of the code derives from them. Adding a family: docs/howto/add_a_family.md.
"""

from __future__ import annotations

from models.families import DRAFT_MODELS, FAMILIES, SPECS, register_family  # noqa: F401  (callers import them here)
from models.family import FamilyFacts, FamilySpec, FieldRun


def family_spec(name: str) -> FamilySpec:
    """The registration of `name`: its package (where the layers above find its role modules) and its writers."""
    if name not in SPECS:
        raise ValueError(f"unknown draft family {name!r}; known: {', '.join(SPECS)}")
    return SPECS[name]


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
    """vLLM methods whose proposer drafts the count scheduled per step (FamilyFacts.vllm_schedule; vLLM 0.32:
    v1/spec_decode/llm_base_proposer.py: propose(num_speculative_tokens, ...), 0 returning no drafts). Medusa's
    proposer asserts the configured count (v1/spec_decode/medusa.py), so a Medusa export never gets a schedule."""
    return tuple(dict.fromkeys(f.vllm_method for f in FAMILIES.values() if f.vllm_schedule))


def _declared_runs():
    """(spec, run) of every run the families declare, in registration order (an undeclared trainable family: one
    run as itself; an undeclared learning-free one: none)."""
    for spec in SPECS.values():
        own = spec.field_runs or ((FieldRun(spec.name, spec.facts.title, f"configs/{spec.name}.yaml"),)
                                  if spec.facts.trainable else ())
        for run in own:
            yield spec, run


def field_runs() -> dict[str, FieldRun]:
    """Run name -> its run of the field-families experiment (FamilySpec.field_runs), in queue order (ties: the order
    registered). A trainable family that declares none runs once as itself: its title, configs/<name>.yaml with no
    overrides, one shape ("default": its drafter's default options), queued after the declared runs; a learning-free
    one without a declaration has no run (nothing to train, no script to judge it). One run at most is the reference."""
    runs: dict[str, FieldRun] = {}
    for spec, run in _declared_runs():
        if run.name in runs:
            raise ValueError(f"field run {run.name!r} of family {spec.name!r} is declared already")
        runs[run.name] = run
    refs = [name for name, run in runs.items() if run.reference]
    if len(refs) > 1:
        raise ValueError(f"field runs {', '.join(refs)} are each declared the reference (FieldRun.reference): one "
                         "run is the one the others are paired with")
    return dict(sorted(runs.items(), key=lambda kv: kv[1].queue))


def field_run_packages() -> dict[str, str]:
    """Run name -> the package of the family that declares it (where its role modules hang: `lockstep`, ...)."""
    return {run.name: spec.package for spec, run in _declared_runs()}
