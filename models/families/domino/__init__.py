"""Domino: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/domino.md)."""

from __future__ import annotations

from models.families.domino.model import DominoDraft
from models.family import FamilySpec

spec = FamilySpec(__name__, DominoDraft.facts, model=DominoDraft)
