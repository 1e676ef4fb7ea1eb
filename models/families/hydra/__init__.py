"""Hydra: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/hydra.md)."""

from __future__ import annotations

from models.families.hydra.model import HydraDraft
from models.family import FamilySpec

spec = FamilySpec(__name__, HydraDraft.facts, model=HydraDraft)
