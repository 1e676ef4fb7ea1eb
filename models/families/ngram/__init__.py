"""N-gram: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/ngram.md)."""

from __future__ import annotations

from models.families.ngram.export_vllm import export_vllm_ngram
from models.families.ngram.model import facts
from models.family import FamilySpec

spec = FamilySpec(__name__, facts,
                  writers={"vllm": export_vllm_ngram})
