"""Start a run from a trained draft instead of the family's initialisation (train.init_from = an export directory):
train a shipped or earlier draft further, on more data or for more epochs, with a fresh optimizer and LR schedule.

The export must be of the same family and shape as the configured draft (its tensors are loaded strictly) and trained
on this base (its fingerprint). With a draft vocabulary the run takes the export's token map (`initial_vocab`)
instead of building one from its own data: the LM head's rows stand for the export's tokens. A resumed run
(resume=auto with a checkpoint) continues from its checkpoint instead: the checkpoint is newer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from models.draft import BaseView
from models.export.specdraft import load_draft, read_export_config, read_tensors


def initial_vocab(export_dir: str | Path, family: str, built: torch.Tensor | None) -> torch.Tensor | None:
    """The draft vocabulary a run of `family` started from `export_dir` trains with: the export's map `d2t` [N] when
    it has one, of the size the run asks for (`built`: the map the run built, or None without a draft vocabulary)."""
    export_dir = Path(export_dir)
    config = _same_family(export_dir, family)
    n = int(config.get("draft_vocab_size", 0) or 0)
    want = 0 if built is None else built.numel()
    if n != want:
        raise ValueError(f"train.init_from={export_dir} drafts over {_vocab_size(n)}, this run over "
                         f"{_vocab_size(want)}: set draft.vocab_size={n or 0} to train it further")
    return None if n == 0 else read_tensors(export_dir / "model.safetensors")["d2t"].long().to(built.device)


def load_initial_weights(draft: nn.Module, export_dir: str | Path, family: str, view: BaseView,
                         base_fingerprint: str | None) -> dict:
    """Copy the export's tensors into `draft` (built from this run's config on `view`). Returns the export's config.
    The export is read and checked as every load does (models/export/specdraft.py: load_draft: schema, sha256, the
    base's fingerprint, its tensors); then its state must fit this run's draft key for key and shape for shape, its
    token map included. Raises ValueError naming train.init_from and what differs."""
    export_dir = Path(export_dir)
    _same_family(export_dir, family)
    where = f"train.init_from={export_dir}"
    try:
        trained, config = load_draft(export_dir, view, base_fingerprint)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    own, theirs = draft.state_dict(), trained.state_dict()
    missing, extra = sorted(set(own) - set(theirs)), sorted(set(theirs) - set(own))
    shapes = [f"{k} {list(theirs[k].shape)} (here {list(own[k].shape)})" for k in sorted(set(own) & set(theirs))
              if theirs[k].shape != own[k].shape]
    if missing or extra or shapes:
        problems = [f"{name} {items[:6]}" for name, items in
                    (("missing", missing), ("unexpected", extra), ("wrong shape:", shapes)) if items]
        raise ValueError(f"{where}: its tensors do not match this run's {family} draft ({'; '.join(problems)}); "
                         "set the draft keys it was trained with (its config.json), or start fresh")
    if "d2t" in own and not torch.equal(own["d2t"].cpu(), theirs["d2t"].cpu()):
        raise ValueError(f"{where}: its draft vocabulary is not this run's map; the LM head's rows would stand for "
                         "other tokens (the run takes the export's map: initial_vocab)")
    draft.load_state_dict(theirs, strict=True)
    return config


def _same_family(export_dir: Path, family: str) -> dict:
    """The export's config.json, once its family is this run's."""
    config = read_export_config(export_dir)
    if config["family"] != family:
        raise ValueError(f"train.init_from={export_dir} holds a {config['family']} draft, but this run trains "
                         f"{family}; start from an export of a {family} run, or leave train.init_from empty")
    return config


def _vocab_size(n: int) -> str:
    return "the full vocabulary" if n == 0 else f"a {n}-token draft vocabulary"
