"""EAGLE-3 as vLLM serves it (`specdraft export --format vllm`, method eagle3; models/export/vllm.py holds what every
vLLM writer shares)."""

from __future__ import annotations

import json
from pathlib import Path

from models.draft import BaseView
from models.export.vllm import SPECULATIVE_CONFIG_FILE, scheduled_config, speculative_tokens
from models.families.eagle3.export_speculators import export_speculators


def export_vllm_eagle3(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """EAGLE-3 in speculators format (export_speculators.py; d2t/t2d carry the draft vocabulary), plus the
    speculative_config vLLM needs: method eagle3, a chain of ttt_steps drafts (what the draft was trained for).
    A P-EAGLE draft (parallel_drafting) is written as speculators' peagle and adds `parallel_drafting: true`: vLLM
    drafts its ttt_steps tokens from one forward (never on a per-batch-size schedule: not measured with it)."""
    n = speculative_tokens(export_cfg, draft.ttt_steps)
    out_dir = export_speculators(draft, Path(out_dir), export_cfg.get("base_model") or "base", speculative_tokens=n)
    spec = {"method": "eagle3", "model": str(Path(out_dir).resolve()), "num_speculative_tokens": n}
    if getattr(draft, "parallel_drafting", False):
        spec["parallel_drafting"] = True
    else:
        spec = scheduled_config(spec, export_cfg)
    (Path(out_dir) / SPECULATIVE_CONFIG_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    return Path(out_dir)
