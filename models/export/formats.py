"""`specdraft export --format F`: the writer of each format, one signature, so the command looks the format up
instead of branching on it. Which family may use which format is the family's own declaration
(FamilyFacts.export_formats, checked by the command first). `specdraft` is ours, the same for every family; the
formats whose files differ per family (models.family.OWN_FORMATS: vllm, speculators, the Medusa layout,
TensorRT-LLM's ReDrafter layout) are written by the writer the family registers (FamilySpec.writers, in its
package), each of which also refuses a draft it cannot write. `gguf` goes through llama.cpp's converter
(eval/serving/llamacpp_gguf.py), a layer above this one, so the command composes it itself.

    writer(loaded, out_dir) -> the written directory      loaded: models.export.load.LoadedExport
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from models.draft import BaseView
from models.family import OWN_FORMATS
from models.registry import FAMILIES, family_spec


def _specdraft(loaded, out: Path) -> Path:
    from models.export.specdraft import export_specdraft

    draft, config = loaded.draft, loaded.config
    extra = {k: v for k, v in config.items() if k not in draft.export_config()}  # tree, tuning keys, ...
    return export_specdraft(draft, out, config["base_model"], loaded.base.fingerprint, extra=extra)


def export_own(fmt: str, draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """Hand a trained draft to its family's writer of `fmt` (FamilySpec.writers), or fail naming the formats it
    has."""
    family = export_cfg.get("family", getattr(draft, "family", "?"))
    spec = family_spec(family) if family in FAMILIES else None
    if spec is None or spec.model is None or fmt not in spec.writers:
        have = ", ".join(spec.facts.export_formats if spec else ("specdraft",))
        if fmt != "vllm":
            raise ValueError(f"--format {fmt}: a {family!r} draft exports as {have}")
        servable = ", ".join(n for n, f in FAMILIES.items() if f.trainable and f.vllm_method)
        free = ", ".join(n for n, f in FAMILIES.items() if not f.trainable and f.vllm_method)
        raise ValueError(f"vLLM cannot serve a {family!r} draft (vLLM 0.32 serves {servable} drafts and its own "
                         f"{free}); formats for {family}: {have} (`specdraft export --format ...`), and our decoder "
                         "(`specdraft eval`) runs it")
    return spec.writers[fmt](draft, out_dir, export_cfg, base)


def export_vllm(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """The directory vLLM serves (models/export/vllm.py), written by the family's own vLLM writer."""
    return export_own("vllm", draft, out_dir, export_cfg, base)


def _own(fmt: str) -> Callable[[object, Path], Path]:
    return lambda loaded, out: export_own(fmt, loaded.draft, out, loaded.config, loaded.view)


FORMAT_WRITERS: dict[str, Callable[[object, Path], Path]] = {
    "specdraft": _specdraft, **{fmt: _own(fmt) for fmt in OWN_FORMATS}}
