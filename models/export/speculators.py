"""The speculators format's pieces every family that writes it shares (EAGLE-3, DFlash, DSpark; each family's
layout is in its own package: models/families/<name>/export_speculators.py): the verifier path, the tensors under
speculators' names with the draft vocabulary as speculators stores it, the Qwen3 layer config and the config.json of
a block-parallel draft (DFlash, DSpark: what they write alike; each adds its own keys), and reading the tensors back
into a draft.

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
    (`transformer_layer_config` of DFlash and DSpark; draft: models.block_draft.BlockDraft)."""
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


def block_draft_config(draft, model_type: str, architecture: str, verifier: str,
                       speculative_tokens: int | None = None) -> dict:
    """The config.json keys DFlash and DSpark write alike (draft: models.block_draft.BlockDraft): `model_type` is
    speculators_model_type and the algorithm, `architecture` the class vLLM builds; sample_from_anchor is whether the
    root's slot drafts too (BlockDraft.anchor_drafts); the greedy proposal drafts speculative_tokens (None: one per
    drafted slot, draft.num_heads). The family adds its own keys."""
    arch = list(draft.layer_config.to_dict().get("architectures") or ["LlamaForCausalLM"])
    tokens = int(speculative_tokens or draft.num_heads)
    return {
        "speculators_model_type": model_type,
        "architectures": [architecture],
        "transformer_layer_config": qwen3_layer_config(draft),
        "draft_vocab_size": draft.draft_vocab_size or draft.vocab_size,
        "block_size": draft.block_size,
        "target_hidden_size": draft.hidden_size,
        "aux_hidden_state_layer_ids": list(draft.aux_layers),
        "mask_token_id": draft.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": bool(draft.anchor_drafts),
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": arch},
        },
    }


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


def load_strict(draft, tensors: dict, export_dir: Path):
    """`draft` (built from the checkpoint's config.json) with the checkpoint's tensors, in eval mode; a tensor
    missing or left over is an error naming the first few of each."""
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{export_dir}: tensors do not match the {draft.facts.title} draft its config.json describes "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    return draft.eval()
