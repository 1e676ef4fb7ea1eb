"""Draft families by name. Adding a family = one file in models/ and one line here."""

from __future__ import annotations

from models.ctc import CTCDraft
from models.eagle3 import Eagle3Draft
from models.hydra import HydraDraft
from models.medusa import MedusaDraft
from models.redrafter import ReDrafterDraft

DRAFT_MODELS = {
    "medusa": MedusaDraft,
    "redrafter": ReDrafterDraft,
    "ctc": CTCDraft,
    "hydra": HydraDraft,
    "eagle3": Eagle3Draft,
}
