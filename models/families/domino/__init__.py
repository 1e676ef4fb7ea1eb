"""Domino: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/domino.md)."""

from __future__ import annotations

from models.families.domino.model import DominoDraft
from models.family import FamilySpec, FieldRun

spec = FamilySpec(__name__, DominoDraft.facts, model=DominoDraft, field_runs=(
    FieldRun("domino", "Domino", "configs/domino.yaml draft.share_lm_head=false train.lr=6e-4 "
             "draft.domino.num_anchors=32", ("chain",), queue=9),))
