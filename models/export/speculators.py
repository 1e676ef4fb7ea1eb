"""The speculators format's pieces every family that writes it shares (EAGLE-3, DFlash, DSpark; each family's
layout is in its own package: models/families/<name>/export_speculators.py): the verifier path, the tensors under
speculators' names with the draft vocabulary as speculators stores it, the Qwen3 layer config of a block-parallel
draft, and reading the tensors back.

Draft-id order: speculators builds its LM head as W[t2d] (rows in ascending target id), so the rows are written
sorted by target id; d2t offsets are then increasing and both readers agree. Our own draft vocabulary keeps "most
frequent first"; the permutation is undone on reading (read_speculators_tensors).
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.draft import BaseView
from models.export.tensors import read_tensors


def verifier_path(base_name: str) -> str:
    """What vLLM loads as the target: the cached HF directory for "smollm2", the name itself otherwise."""
    if base_name == "smollm2":
        from models.smollm2_gguf import smollm2_cache_path

        return str(smollm2_cache_path())
    return base_name


def speculators_tensors(draft, dtype: torch.dtype | None = None, skip: tuple[str, ...] = ("d2t",)
                        ) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names (EAGLE-3, DFlash), minus `skip`; with a draft vocabulary the LM
    head's rows sorted by target id, `d2t` as speculators' offsets and the `t2d` mask."""
    out = {}
    for name, value in draft.state_dict().items():
        if name in skip:
            continue
        value = value.detach().to("cpu")
        out[name] = (value.to(dtype) if dtype is not None and value.is_floating_point() else value).contiguous()
    if draft.d2t is not None:
        ids, order = torch.sort(draft.d2t.cpu())
        out["lm_head.weight"] = out["lm_head.weight"][order].contiguous()
        out["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        t2d = torch.zeros(draft.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return {k: v.clone() for k, v in out.items()}


_DROP_QWEN3_LAYER_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                          "auto_map", "quantization_config", "_commit_hash", "model_type", "layer_types",
                          "pretraining_tp", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers")


def qwen3_layer_config(draft) -> dict:
    """The base's dimensions as the Qwen3 config vLLM builds the layers of a block-parallel draft from
    (`transformer_layer_config` of DFlash and DSpark; draft: models.components.BlockDraft)."""
    layer = draft.layer_config.to_dict()
    for key in _DROP_QWEN3_LAYER_KEYS:
        layer.pop(key, None)
    attn = draft.layers[0].self_attn
    n = draft.num_layers
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        layer["rope_parameters"] = rope["full_attention"]  # per-layer-type RoPE (Gemma 3): the draft is full attention
    layer.pop("hidden_activation", None)
    layer.update(model_type="qwen3", num_hidden_layers=n, head_dim=attn.head_dim, tie_word_embeddings=False,
                 hidden_act="silu",  # the draft's MLP is Qwen3's SiLU-gated one, whatever the base's activation
                 vocab_size=draft.vocab_size, use_sliding_window=False, sliding_window=None, max_window_layers=n,
                 layer_types=["full_attention"] * n)
    return layer


def read_speculators_tensors(export_dir: Path, config: dict, base: BaseView) -> tuple[dict, BaseView]:
    """(tensors, the view on `base` with the draft vocabulary) of a speculators checkpoint (EAGLE-3, DFlash):
    speculators' `d2t` offsets become target ids under "d2t", the `t2d` mask is dropped."""
    tensors = read_tensors(export_dir / "model.safetensors")
    n = int(config["draft_vocab_size"])
    d2t = None
    if "d2t" in tensors:
        d2t = tensors.pop("d2t") + torch.arange(n)  # offsets -> target ids
        tensors.pop("t2d", None)
        tensors["d2t"] = d2t
    elif n != base.vocab_size:
        raise ValueError(f"{export_dir}: draft_vocab_size={n} < V={base.vocab_size} but no d2t tensor")
    view = BaseView(base.lm_head_weight, base.embed_weight, base.hidden_size, base.vocab_size, base.model, d2t)
    return tensors, view
