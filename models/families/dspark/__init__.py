"""DSpark: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/dspark.md)."""

from __future__ import annotations

from models.families.dspark.export_vllm import export_vllm_dspark
from models.families.dspark.model import DSparkDraft
from models.family import FamilySpec, FieldRun

spec = FamilySpec(__name__, DSparkDraft.facts, model=DSparkDraft,
                  writers={"vllm": export_vllm_dspark}, field_runs=(
    FieldRun("dspark", "DSpark", "configs/dspark.yaml draft.share_lm_head=false train.lr=6e-4 "
             "draft.dspark.num_anchors=32", ("chain",), queue=8),))
