"""One way to get a trained draft back: `load_export(dir)` reads the export's config.json, loads the base it was
trained on (or the one asked for), rebuilds the draft on it (fingerprint and draft vocabulary checked) and puts
the draft on the base's device and dtype. Every command that decodes, searches trees, serves or converts an
export starts here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from models.base import LoadedBase, load_base
from models.draft import BaseView, DraftModel
from models.export.specdraft import load_draft, read_export_config


@dataclass
class LoadedExport:
    base: LoadedBase  # the frozen base the draft runs on
    draft: DraftModel  # eval mode, on the base's device and in its dtype
    config: dict  # the export's config.json
    view: BaseView  # the base tensors the draft reads (BaseView.from_model(base.model))

    @property
    def family(self) -> str:
        return self.config["family"]


def load_export(export_dir: str | os.PathLike, *, base: LoadedBase | None = None, base_path: str = "",
                dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                chat_template: str = "") -> LoadedExport:
    """base: an already loaded base to put the draft on (several drafts sharing one base); else the base named by
    `base_path`, or by the export's `base_model`, is loaded in `dtype` on `device` with `chat_template` (default:
    the template the draft was trained with)."""
    export_dir = Path(export_dir)
    config = read_export_config(export_dir)
    if base is None:
        base = load_base(base_path or config["base_model"], dtype=dtype, device=device,
                         chat_template=chat_template or config.get("chat_template") or None)
    view = BaseView.from_model(base.model)
    draft, config = load_draft(export_dir, view, base.fingerprint)
    param = next(base.model.parameters())
    draft = draft.to(device=param.device, dtype=param.dtype)
    return LoadedExport(base=base, draft=draft, config=config, view=view)
