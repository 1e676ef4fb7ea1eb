"""Medusa: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/medusa.md)."""

from __future__ import annotations

from models.families.medusa.export_medusa import export_medusa
from models.families.medusa.export_vllm import export_vllm_medusa
from models.families.medusa.model import MedusaDraft
from models.family import FamilySpec, FieldRun

spec = FamilySpec(__name__, MedusaDraft.facts, model=MedusaDraft,
                  writers={"medusa": export_medusa, "vllm": export_vllm_medusa}, field_runs=(
    FieldRun("medusa", "Medusa", "configs/medusa.yaml train.lr=5e-3", ("chain4 tree=chain4", "tree16 tree=tree16"),
             queue=1),))
