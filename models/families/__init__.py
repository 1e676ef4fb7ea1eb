"""The draft families, registered here, once: one package per family (models/families/<name>/), holding every file
that is only about it, and BUILT_IN, the one tuple of them. `register_family(spec)` adds a family from anywhere (a
test registers a toy one from a temporary folder); models/registry.py reads the result.

A family's files and their layers (tests/test_layers.py gives each its layer by its role):
    __init__.py           `spec = FamilySpec(...)` (models/family.py): its facts, its model class, its export writers
    model.py              the DraftModel with its `facts` and its options (a learning-free family: module-level facts)
    export_*.py           its export writers (vllm, speculators, ...)                             the models layer
    drafter.py, tune.py   its drafter declaration (eval/engine/drafters/registry.py), tune's shapes   eval.engine
    lockstep.py           its batched field path, run_lockstep (EAGLE-3)                              eval.engine
    sweep.py              a learning-free family's option sweep, eval --method X sweep_* (N-gram)    eval.harness
    gguf.py               `converter_input`: what llama.cpp's converter reads (eval/serving)          eval.serving
The layers above models import a role module by its fixed name (`<spec.package>.drafter`), so nothing below them
names one. Adding a family: docs/howto/add_a_family.md.
"""

from __future__ import annotations

from models.families import ctc, dflash, domino, dspark, eagle3, hydra, medusa, ngram, redrafter
from models.family import FamilyFacts, FamilySpec

SPECS: dict[str, FamilySpec] = {}  # name -> registration, in the order registered (the built-in ones by name)
FAMILIES: dict[str, FamilyFacts] = {}  # name -> facts of every family, learning-free ones included
DRAFT_MODELS: dict[str, type] = {}  # name -> model class of every trainable family


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add a family to the registry (the same spec twice is a no-op; another one under a taken name fails)."""
    if SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"a family named {spec.name!r} is registered already ({SPECS[spec.name].package})")
    SPECS[spec.name], FAMILIES[spec.name] = spec, spec.facts
    if spec.model is not None:
        DRAFT_MODELS[spec.name] = spec.model
    return spec


BUILT_IN = (ctc, dflash, domino, dspark, eagle3, hydra, medusa, ngram, redrafter)
for _package in BUILT_IN:
    register_family(_package.spec)
