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

from models.export.schema import check_sha256
from models.export.specdraft import read_export_config, read_tensors


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


def load_initial_weights(draft: nn.Module, export_dir: str | Path, family: str, d2t: torch.Tensor | None,
                         base_fingerprint: str | None) -> dict:
    """Copy the export's tensors into `draft` (built from this run's config). Returns the export's config.
    Raises ValueError naming train.init_from and what differs."""
    export_dir = Path(export_dir)
    config = _same_family(export_dir, family)
    where = f"train.init_from={export_dir}"
    if base_fingerprint is not None and config.get("base_fingerprint") not in (None, base_fingerprint):
        raise ValueError(f"{where} was trained on base {config.get('base_model')!r} (fingerprint "
                         f"{config['base_fingerprint']}), not on this run's base ({base_fingerprint})")
    path = export_dir / "model.safetensors"
    tensors = read_tensors(path)
    check_sha256(path, config.get("model_sha256"))
    theirs = tensors.get("d2t")
    if (theirs is None) != (d2t is None) or (d2t is not None and not torch.equal(theirs.long(), d2t.cpu().long())):
        raise ValueError(f"{where}: its draft vocabulary ({_vocab(theirs)}) is not this run's ({_vocab(d2t)}); the "
                         "LM head's rows would stand for other tokens (the run takes the export's map: "
                         "initial_vocab)")
    own = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in tensors.items() if k in own or k != "d2t"}
    missing, extra = sorted(set(own) - set(found)), sorted(set(found) - set(own))
    shapes = [f"{k} {list(found[k])} (here {list(own[k])})" for k in sorted(set(own) & set(found))
              if found[k] != own[k]]
    if missing or extra or shapes:
        problems = [f"{name} {items[:6]}" for name, items in
                    (("missing", missing), ("unexpected", extra), ("wrong shape:", shapes)) if items]
        raise ValueError(f"{where}: its tensors do not match this run's {family} draft ({'; '.join(problems)}); "
                         "set the draft keys it was trained with (its config.json), or start fresh")
    draft.load_state_dict({k: v for k, v in tensors.items() if k in own}, strict=True)
    return config


def _same_family(export_dir: Path, family: str) -> dict:
    """The export's config.json, once its family is this run's."""
    config = read_export_config(export_dir)
    if config["family"] != family:
        raise ValueError(f"train.init_from={export_dir} holds a {config['family']} draft, but this run trains "
                         f"{family}; start from an export of a {family} run, or leave train.init_from empty")
    return config


def _vocab(d2t: torch.Tensor | None) -> str:
    return "the full vocabulary" if d2t is None else f"a {d2t.numel()}-token map"


def _vocab_size(n: int) -> str:
    return "the full vocabulary" if n == 0 else f"a {n}-token draft vocabulary"
