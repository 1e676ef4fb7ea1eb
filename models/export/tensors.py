"""A draft's tensors out and back: what every export writer (ours and the families' own) shares. Safetensors only:
reading never unpickles. Below the registry, so a family's writers import it without an import circle."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from models.export.schema import safetensors_shapes


def draft_tensors(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent state of the draft (parameters + persistent buffers), contiguous CPU copies."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in draft.state_dict().items()}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors_shapes(path)  # a damaged file is a clear error naming it, not a raw SafetensorError
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
