"""DSpark as vLLM serves it (`specdraft export --format vllm`, method dspark; models/export/vllm.py holds what every
vLLM writer shares)."""

from __future__ import annotations

import json
from pathlib import Path

from models.draft import BaseView
from models.export.speculators import verifier_path
from models.export.vllm import SPECULATIVE_CONFIG_FILE, speculative_tokens
from models.families.dspark.export_speculators import export_dspark_speculators


def export_vllm_dspark(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """DSpark in speculators format (export_speculators.py: DFlash's layers + the Markov and confidence
    heads), plus the speculative_config vLLM needs: method dspark, the block's block_size drafts (every slot drafts,
    the root's included: sample_from_anchor)."""
    out_dir = Path(out_dir)
    spec = {"method": "dspark", "model": str(out_dir.resolve()),
            "num_speculative_tokens": speculative_tokens(export_cfg, draft.block_size)}
    return export_dspark_speculators(draft, out_dir, verifier_path(export_cfg.get("base_model") or "base"),
                                     extra_files={SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(
                                         json.dumps(spec, indent=2) + "\n")})
