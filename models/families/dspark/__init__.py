"""DSpark: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/dspark.md)."""

from __future__ import annotations

from models.families.dspark.export_vllm import export_vllm_dspark
from models.families.dspark.model import DSparkDraft
from models.family import FamilySpec

spec = FamilySpec(__name__, DSparkDraft.facts, model=DSparkDraft,
                  writers={"vllm": export_vllm_dspark})
