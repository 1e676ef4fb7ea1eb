"""EAGLE-3: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/eagle3.md)."""

from __future__ import annotations

from models.families.eagle3.export_speculators import write_speculators
from models.families.eagle3.export_vllm import export_vllm_eagle3
from models.families.eagle3.model import Eagle3Draft
from models.family import FamilySpec

spec = FamilySpec(__name__, Eagle3Draft.facts, model=Eagle3Draft,
                  writers={"speculators": write_speculators, "vllm": export_vllm_eagle3})
