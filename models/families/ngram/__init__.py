"""N-gram: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/ngram.md)."""

from __future__ import annotations

from models.families.ngram.export_vllm import export_vllm_ngram
from models.families.ngram.model import facts
from models.family import FamilySpec, FieldRun

# Learning-free: the field-families experiment judges it with recipes/field_ngram.py (a shape's overrides are
# that script's --shape: one prompt-lookup row of 4; 10 rows x 10 tokens of context + bigram table; 4 x 4, the
# learned families' 16-node budget).
spec = FamilySpec(__name__, facts, writers={"vllm": export_vllm_ngram}, field_runs=(
    FieldRun("ngram", "N-gram", "recipes/field_ngram.py",
             ("lookup4 --shape chain4", "mixed10x10 --shape tree", "mixed4x4 --shape rows4x4"), queue=10),))
