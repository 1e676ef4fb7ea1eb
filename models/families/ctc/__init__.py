"""CTC drafter: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/ctc.md)."""

from __future__ import annotations

from models.families.ctc.model import CTCDraft
from models.family import FamilySpec

spec = FamilySpec(__name__, CTCDraft.facts, model=CTCDraft)
