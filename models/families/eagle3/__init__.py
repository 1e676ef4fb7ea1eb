"""EAGLE-3: the family's registration (models/families/__init__.py); every file only about it is in this
folder (docs/families/eagle3.md)."""

from __future__ import annotations

from models.families.eagle3.export_speculators import write_speculators
from models.families.eagle3.export_vllm import export_vllm_eagle3
from models.families.eagle3.model import Eagle3Draft
from models.family import FamilySpec, FieldRun

# Its field shapes (chain first) and its runs of the field-families experiment: EAGLE-3 the one every other run is
# paired with; P-EAGLE, parallel drafting (4 tokens from one forward), on request only.
SHAPES = ("chain4 extra.eagle3_mode=chain extra.num_speculative_tokens=4",
          "tree16 extra.eagle3_mode=tree extra.tree_nodes=16")
spec = FamilySpec(__name__, Eagle3Draft.facts, model=Eagle3Draft,
                  writers={"speculators": write_speculators, "vllm": export_vllm_eagle3}, field_runs=(
    FieldRun("eagle3", "EAGLE-3", "configs/eagle3.yaml draft.share_lm_head=false train.lr=2e-3", SHAPES, queue=5,
             reference=True),
    FieldRun("peagle", "P-EAGLE", "configs/eagle3.yaml draft.share_lm_head=false train.lr=2e-3 "
             "draft.eagle3.parallel_drafting=true draft.eagle3.ttt_steps=4", SHAPES, default=False, queue=5)))
