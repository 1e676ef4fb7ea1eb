"""Medusa as vLLM serves it (`specdraft export --format vllm`, method medusa; models/export/vllm.py holds what every
vLLM writer shares).

Medusa, read from vLLM 0.32's `model_executor/models/medusa.py` + `transformers_utils/configs/medusa.py`:
    model.safetensors
        blocks.{h}.layers.{l}.weight [d, d], .bias [d]   ResBlock l of head h: x + SiLU(W x + b)
        lm_heads.{h}.weight [V, d]                       own LM head per head, or
        lm_head.weight [V or N, d]                       one shared head (config original_lm_head: true)
        token_map [N] int64                              draft vocabulary: draft id -> base id (d2t)
    config.json  model_type "medusa", num_heads, num_hidden_layers (ResBlocks per head), hidden_size,
                 vocab_size (the base's V), truncated_vocab_size (N, = V without a draft vocabulary),
                 medusa_fc_bias: true (our ResBlocks have a bias), original_lm_head
vLLM drafts a chain of each head's top-1 (no tree): head h's argmax is the token at depth h+1, so its
per-position acceptance equals our decoder's with the chain tree of the same length.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView
from models.export.tensors import draft_tensors
from models.export.vllm import ENGINE_ARGS_FILE, SPECULATIVE_CONFIG_FILE, draft_vocabulary, speculative_tokens

# vLLM 0.32 Medusa + token_map: load_weights reads the map but does not report it loaded (module docstring).
MEDUSA_TOKEN_MAP_ENGINE_ARGS = {"model_loader_extra_config": {"enable_weights_track": False}}


def medusa_vllm_tensors(draft, base: BaseView, d2t: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Our Medusa state dict -> vLLM's Medusa tensor names (see the module docstring)."""
    ours = draft_tensors(draft)
    out: dict[str, torch.Tensor] = {}
    for h in range(draft.num_heads):
        for i in range(draft.num_layers):
            out[f"blocks.{h}.layers.{i}.weight"] = ours[f"heads.{h}.{i}.linear.weight"]  # [d, d]
            out[f"blocks.{h}.layers.{i}.bias"] = ours[f"heads.{h}.{i}.linear.bias"]  # [d]
    if draft.share_lm_head:
        w = base.lm_head_weight.detach().cpu()  # [V, d], the frozen base head the heads were trained on
        out["lm_head.weight"] = (w if d2t is None else w.index_select(0, d2t)).contiguous().clone()  # [V|N, d]
    else:
        if d2t is not None:
            raise ValueError(
                f"this Medusa draft has {draft.num_heads} own LM heads over a draft vocabulary of {d2t.numel()} "
                "tokens; vLLM 0.32 reads a draft vocabulary (token_map) only with one shared LM head (it sizes "
                "per-head LM heads by the full vocabulary). Train with draft.share_lm_head=true, or without a "
                "draft vocabulary, or use --format specdraft / medusa with our decoder")
        for h in range(draft.num_heads):
            out[f"lm_heads.{h}.weight"] = ours[f"heads.{h}.{draft.num_layers}.weight"]  # [V, d]
    if d2t is not None:
        out["token_map"] = d2t  # [N] int64
    return out


def medusa_vllm_config(draft, base: BaseView, d2t: torch.Tensor | None, export_cfg: dict) -> dict:
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": base.hidden_size,
        "vocab_size": base.vocab_size,  # vLLM scatters draft-vocabulary logits back into a [V] row
        "truncated_vocab_size": base.vocab_size if d2t is None else int(d2t.numel()),
        "num_heads": draft.num_heads,
        "num_hidden_layers": draft.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": bool(draft.share_lm_head),
        # Provenance (vLLM ignores unknown keys): serve-check compares the fingerprint with the base it serves.
        "base_model_name_or_path": export_cfg.get("base_model"),
        "base_fingerprint": export_cfg.get("base_fingerprint"),
        "specdraft_family": "medusa",
    }


def export_vllm_medusa(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    d2t = draft_vocabulary(draft, export_cfg, base.vocab_size)
    tensors = medusa_vllm_tensors(draft, base, d2t)
    config = medusa_vllm_config(draft, base, d2t, export_cfg)
    out_dir = Path(out_dir)
    spec = {"method": "medusa", "model": str(out_dir.resolve()),
            "num_speculative_tokens": speculative_tokens(export_cfg, draft.num_heads)}
    files = {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
        SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(json.dumps(spec, indent=2) + "\n"),
    }
    if d2t is not None:
        files[ENGINE_ARGS_FILE] = lambda p: p.write_text(json.dumps(MEDUSA_TOKEN_MAP_ENGINE_ARGS, indent=2) + "\n")
    return write_dir_atomic(out_dir, files)
