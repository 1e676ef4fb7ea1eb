"""DFlash as vLLM serves it (`specdraft export --format vllm`, method dflash; models/export/vllm.py holds what every
vLLM writer shares)."""

from __future__ import annotations

import json
from pathlib import Path

from models.draft import BaseView
from models.export.speculators import verifier_path
from models.export.vllm import SPECULATIVE_CONFIG_FILE, scheduled_config, speculative_tokens
from models.families.dflash.export_speculators import export_dflash_speculators


def export_vllm_dflash(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """DFlash in speculators format (export_speculators.py: Qwen3-shaped layers, d2t/t2d, the learned
    mask embedding in mask_embedding.pt), plus the speculative_config vLLM needs: method dflash, the block's
    block_size - 1 drafts (vLLM's query is the root + num_speculative_tokens mask slots)."""
    out_dir = Path(out_dir)
    spec = scheduled_config({"method": "dflash", "model": str(out_dir.resolve()),
                             "num_speculative_tokens": speculative_tokens(export_cfg, draft.block_size - 1)},
                            export_cfg)
    return export_dflash_speculators(draft, out_dir, verifier_path(export_cfg.get("base_model") or "base"),
                                     extra_files={SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(
                                         json.dumps(spec, indent=2) + "\n")})
