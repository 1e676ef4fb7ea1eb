"""Hydra: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/hydra.md)."""

from __future__ import annotations

from models.families.hydra.model import HydraDraft
from models.family import FamilySpec, FieldRun

# Its runs of the field-families experiment: Hydra++ (configs/hydra_pp.yaml: the prefix layer) is one of its own.
SHAPES = ("chain4 tree=chain4", "tree16 tree=tree16")
spec = FamilySpec(__name__, HydraDraft.facts, model=HydraDraft, field_runs=(
    FieldRun("hydra_pp", "Hydra++", "configs/hydra_pp.yaml train.lr=2e-3", SHAPES, queue=4),
    FieldRun("hydra", "Hydra", "configs/hydra.yaml train.lr=5e-3", SHAPES, queue=6)))
