"""ReDrafter: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/redrafter.md)."""

from __future__ import annotations

from models.families.redrafter.export_trtllm import export_redrafter_trtllm
from models.families.redrafter.model import ReDrafterDraft
from models.family import FamilySpec, FieldRun

spec = FamilySpec(__name__, ReDrafterDraft.facts, model=ReDrafterDraft,
                  writers={"redrafter-trtllm": export_redrafter_trtllm}, field_runs=(
    FieldRun("redrafter", "ReDrafter", "configs/redrafter.yaml train.lr=5e-3",
             ("chain extra.beam_width=1 extra.beam_length=5", "beam8x3 extra.beam_width=8 extra.beam_length=3"),
             queue=3),))
