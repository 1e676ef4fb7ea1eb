"""Draft families by name. Adding a family = one file in models/ and one line here."""

from __future__ import annotations

from models.ctc import CTCDraft
from models.hydra import HydraDraft
from models.medusa import MedusaDraft
from models.redrafter import ReDrafterDraft

DRAFTERS = {
    "medusa": MedusaDraft,
    "redrafter": ReDrafterDraft,
    "ctc": CTCDraft,
    "hydra": HydraDraft,
}
