"""`specdraft export --format F`: the writer of each format models/export holds, one signature, so the command
looks the format up instead of branching on it. Which family may use which format is the family's own
declaration (FamilyFacts.export_formats, checked by the command first); each writer also refuses a draft it
cannot write. `gguf` goes through llama.cpp's converter (eval/serving/llamacpp_gguf.py), a layer above this one,
so the command composes it itself.

    writer(loaded, out_dir) -> the written directory      loaded: models.export.load.LoadedExport
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _specdraft(loaded, out: Path) -> Path:
    from models.export.specdraft import export_specdraft

    draft, config = loaded.draft, loaded.config
    extra = {k: v for k, v in config.items() if k not in draft.export_config()}  # tree, tuning keys, ...
    return export_specdraft(draft, out, config["base_model"], loaded.base.fingerprint, extra=extra)


def _medusa(loaded, out: Path) -> Path:
    from models.export.medusa import export_medusa

    return export_medusa(loaded.draft, out, loaded.config["base_model"], loaded.view)


def _redrafter_trtllm(loaded, out: Path) -> Path:
    from models.export.redrafter_trtllm import export_redrafter_trtllm

    return export_redrafter_trtllm(loaded.draft, out, loaded.config["base_model"], loaded.view)


def _speculators(loaded, out: Path) -> Path:
    """EAGLE-3 as vLLM serves it (method eagle3); tune's vLLM choice (config.json, when speculating won) is the
    default proposal, as with --format vllm."""
    from models.export.speculators import export_speculators
    from models.export.vllm import TUNED_TOKENS_KEY

    return export_speculators(loaded.draft, out, loaded.config["base_model"],
                              speculative_tokens=loaded.config.get(TUNED_TOKENS_KEY))


def _vllm(loaded, out: Path) -> Path:
    from models.export.vllm import export_vllm

    return export_vllm(loaded.draft, out, loaded.config, loaded.view)


FORMAT_WRITERS: dict[str, Callable[[object, Path], Path]] = {
    "specdraft": _specdraft, "medusa": _medusa, "redrafter-trtllm": _redrafter_trtllm,
    "speculators": _speculators, "vllm": _vllm,
}
