"""Base-model fingerprints: a short hash of a model's config and sampled weights, the same whether it is
computed from the loaded model (`fingerprint_model`) or from its saved safetensors (`fingerprint_checkpoint`,
which reads only the sampled rows). Caches, exports and serve-check use it to refuse a draft or a cache made
for another base."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
from torch import nn

_FINGERPRINT_FULL = 65_536  # tensors up to this many elements are hashed whole
_FINGERPRINT_ROWS = 64  # larger ones: this many evenly spaced rows (first dim)
# Config fields that define the computation; dtype, paths and versions are left out on purpose.
_FINGERPRINT_CONFIG_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "hidden_act",
    "rms_norm_eps", "layer_norm_epsilon", "max_position_embeddings",
)


def _config_fields(config) -> dict:
    fields = {k: getattr(config, k) for k in _FINGERPRINT_CONFIG_KEYS if getattr(config, k, None) is not None}
    # transformers 5 moved rope_theta into rope_parameters; read either so 4.x/5.x agree.
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
    if theta is not None:
        fields["rope_theta"] = float(theta)
    return fields


def _sample_rows(n_rows: int) -> list[int]:
    """Evenly spaced row indices including the first and last; integer math so every reader agrees."""
    k = min(n_rows, _FINGERPRINT_ROWS)
    return sorted({(i * (n_rows - 1)) // max(k - 1, 1) for i in range(k)})


def _fingerprint(config_fields: dict, tensors: Iterable[tuple[str, tuple[int, ...], Callable]]) -> str:
    """tensors: (name, shape, sample()) where sample() returns the values to hash (any dtype)."""
    h = hashlib.sha256(json.dumps(config_fields, sort_keys=True).encode())
    for name, shape, sample in sorted(tensors, key=lambda item: item[0]):
        h.update(f"{name}:{list(shape)};".encode())
        h.update(sample().detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _tensor_sample(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    if t.numel() <= _FINGERPRINT_FULL or t.dim() == 0:
        return lambda: t.reshape(-1)
    return lambda: t[torch.tensor(_sample_rows(t.shape[0]), device=t.device)].reshape(-1)


def fingerprint_model(model: nn.Module) -> str:
    """Fingerprint of an in-memory model: its distinct parameters (tied weights once, under the name
    that owns them -- the same set save_pretrained writes for LLaMA). Equals `fingerprint_checkpoint`
    of its saved directory when the model holds the stored values (loaded in the stored dtype or
    upcast); a downcast copy (fp32 checkpoint loaded in bf16) gets a different value."""
    params = model.named_parameters(remove_duplicate=True)
    return _fingerprint(_config_fields(model.config),
                        [(n, tuple(p.shape), _tensor_sample(p)) for n, p in params])


def _safetensors_files(directory: Path) -> list[Path] | None:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else None


def _whole_from_file(f, name: str) -> torch.Tensor:
    return f.get_tensor(name).reshape(-1)


def _rows_from_slice(sl, rows: list[int]) -> torch.Tensor:
    return torch.cat([sl[r:r + 1].reshape(-1) for r in rows])  # reads only these rows from disk


def fingerprint_checkpoint(directory: str | os.PathLike, config=None) -> str | None:
    """Fingerprint of an HF directory's safetensors weights (reads only the sampled rows).
    None if the directory has no safetensors (e.g. only pytorch_model.bin)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    directory = Path(directory)
    files = _safetensors_files(directory)
    if files is None:
        return None
    config = config or AutoConfig.from_pretrained(directory, local_files_only=True)
    with contextlib.ExitStack() as stack:
        entries = []
        for file in files:
            f = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in f.keys():
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if math.prod(shape) <= _FINGERPRINT_FULL or not shape:
                    entries.append((name, shape, partial(_whole_from_file, f, name)))
                else:
                    entries.append((name, shape, partial(_rows_from_slice, sl, _sample_rows(shape[0]))))
        return _fingerprint(_config_fields(config), entries)
