"""Draft families by name. Adding a family = one file in models/ and one line here."""

from __future__ import annotations

from models.medusa import MedusaDraft

DRAFTERS = {
    "medusa": MedusaDraft,
}
