"""DFlash: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/dflash.md)."""

from __future__ import annotations

from models.families.dflash.export_vllm import export_vllm_dflash
from models.families.dflash.model import DFlashDraft
from models.family import FamilySpec, FieldRun

spec = FamilySpec(__name__, DFlashDraft.facts, model=DFlashDraft,
                  writers={"vllm": export_vllm_dflash}, field_runs=(
    FieldRun("dflash", "DFlash", "configs/dflash.yaml draft.share_lm_head=false train.lr=6e-4 "
             "draft.dflash.num_anchors=32 draft.dflash.block_size=8 draft.num_heads=7", ("chain",), queue=7),))
