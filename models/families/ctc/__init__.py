"""CTC drafter: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/ctc.md)."""

from __future__ import annotations

from models.families.ctc.model import CTCDraft
from models.family import FamilySpec, FieldRun

spec = FamilySpec(__name__, CTCDraft.facts, model=CTCDraft, field_runs=(
    FieldRun("ctc", "CTC", "configs/ctc.yaml train.lr=2e-3",
             ("chain extra.ctc_num_paths=1", "paths8 extra.ctc_num_paths=8"), queue=2,
             diagnostics="recipes/ctc_diagnostics.py"),))
