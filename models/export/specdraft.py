"""Export trained drafts and load them back. Safetensors only: loading never unpickles.

specdraft format (runs/<run>/export/):
    model.safetensors   the draft's trainable tensors only (no base weights), plus `d2t` [N] int64 when the
                        draft has a draft vocabulary (models/vocab_map.py)
    config.json         {"family", dims, "draft_vocab_size" (0 = full), "base_model", "base_fingerprint", ...}

The original Medusa layout is models/families/medusa/export_medusa.py (`export_medusa`, also importable from here).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from core.checksum import file_sha256
from models.draft import BaseView
from models.export.schema import (
    ExportError,
    check_export_config,
    check_sha256,
    check_tensors,
    read_json_file,
    upgrade_keys,
)
from models.export.tensors import draft_tensors, read_tensors  # noqa: F401  (callers import them from here)
from models.families.medusa.export_medusa import export_medusa  # noqa: F401  (callers import it from here)
from models.registry import DRAFT_MODELS
from models.vocab_map import check_fits

FORMAT_VERSION = 1


def export_specdraft(draft, out_dir: Path, base_name: str, base_fingerprint: str, extra: dict | None = None) -> Path:
    config = {"format": "specdraft", "format_version": FORMAT_VERSION, **draft.export_config(),
              "base_model": base_name, "base_fingerprint": base_fingerprint, **(extra or {})}
    config.pop("model_sha256", None)  # a re-export records its own file's hash
    tensors = draft_tensors(draft)

    def write_config(path: Path) -> None:  # after model.safetensors: records the sha256 of its bytes
        sha = file_sha256(path.parent / "model.safetensors")
        path.write_text(json.dumps({**config, "model_sha256": sha}, indent=2) + "\n")

    return write_dir_atomic(out_dir, {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"family": config["family"]}),
        "config.json": write_config,
    })


def read_export_config(export_dir: Path) -> dict:
    """config.json of a specdraft export, checked against the typed schema (models/export/schema.py)."""
    path = Path(export_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no config.json in {export_dir}: pass the export directory of a finished run "
            f"(runs/<run>/export), which `specdraft train` writes at the end")
    config = upgrade_keys(read_json_file(path, "the export's config.json"), str(path))
    if not isinstance(config, dict) or config.get("format") != "specdraft":
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ExportError(f"{path} is not a specdraft export (format={found!r}); pass runs/<run>/export")
    family = config.get("family")
    if family not in DRAFT_MODELS:
        raise ExportError(f"{path}: unknown draft family {family!r}; known: {', '.join(DRAFT_MODELS)}")
    facts = DRAFT_MODELS[family].facts
    return check_export_config(config, path, facts.export_keys, facts.export_key_types)


def load_draft(export_dir: Path, base: BaseView, base_fingerprint: str | None = None):
    """Rebuild a draft from its export on top of an already loaded base. Returns (draft, config).

    Every file is checked before it is used: config.json against the schema, model.safetensors against the sha256
    the export recorded and its header against the tensors the configured draft needs."""
    config = read_export_config(export_dir)
    if base_fingerprint is not None and config.get("base_fingerprint") not in (None, base_fingerprint):
        raise ValueError(
            f"{export_dir} was trained on base {config.get('base_model')!r} with fingerprint "
            f"{config['base_fingerprint']}, but the loaded base has fingerprint {base_fingerprint}; "
            f"load the base it needs: base_path={config.get('base_model')} for eval, serve-check and tune, "
            f"base.path={config.get('base_model')} for train")
    family = config["family"]
    path = Path(export_dir) / "model.safetensors"
    tensors = read_tensors(path)  # a damaged header is named here, damaged data by the sha256 below
    check_sha256(path, config.get("model_sha256"))
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    base = _with_export_map(export_dir, config, tensors, base)
    draft = DRAFT_MODELS[family].from_export_config(config, base)
    check_tensors(path, found, {k: tuple(v.shape) for k, v in draft.state_dict().items()})
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{export_dir}: tensors do not match a {family} draft with this config "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    return draft.eval(), config


def _with_export_map(export_dir, config: dict, tensors: dict, base: BaseView) -> BaseView:
    """The base view the export's draft is built on: with a draft vocabulary, its d2t (checked against the
    base's vocabulary: a map for another tokenizer is a clear error) in view.draft_vocab."""
    n = int(config.get("draft_vocab_size", 0) or 0)
    if n == 0:
        return base
    if "d2t" not in tensors:
        raise ValueError(f"{export_dir}: config.json says draft_vocab_size={n} but model.safetensors has no `d2t` "
                         "tensor; the export is incomplete (re-export the run)")
    d2t = tensors["d2t"].to(torch.long)
    check_fits(d2t, base.vocab_size, f"{export_dir} (d2t, draft_vocab_size={n})")
    if d2t.numel() != n:
        raise ValueError(f"{export_dir}: d2t has {d2t.numel()} entries but config.json says draft_vocab_size={n}; "
                         "the export is inconsistent (re-export the run)")
    return replace(base, draft_vocab=d2t)
