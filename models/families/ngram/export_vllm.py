"""N-gram as vLLM serves it: vLLM's own method, so the export is its speculative_config only
(`specdraft export --format vllm --method ngram`).

N-gram: vLLM's `ngram` method is prompt lookup (one row of up to num_speculative_tokens tokens copied
after the earliest match of the longest suffix of n tokens, prompt_lookup_min <= n <= prompt_lookup_max).
Ours with strategy=longest_match (k=1) is that rule; our context ranking and model bigram rows have no vLLM
counterpart.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.atomic import write_dir_atomic
from models.export.vllm import SPECULATIVE_CONFIG_FILE, vllm_ngram_config


def export_vllm_ngram(options: dict, out_dir: Path) -> Path:
    spec = vllm_ngram_config(options)
    return write_dir_atomic(Path(out_dir), {
        SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(json.dumps(spec, indent=2) + "\n")})
