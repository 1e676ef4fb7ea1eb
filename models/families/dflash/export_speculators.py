"""DFlash in the `speculators` format, the one vLLM serves with `method: dflash` (docs/families/dflash.md#export).

Layout (checked against speculators 0.9.0 `models/dflash/{config,core,model_definitions}.py` and vLLM 0.32
`model_executor/models/qwen3_dflash.py`, `transformers_utils/configs/speculators/algos.py: update_dflash`,
`v1/spec_decode/dflash.py`):

    model.safetensors
        fc.weight                                  [d, k*d]  over the aux layers side by side, in aux order
        hidden_norm.weight                         [d]       on fc's output: the context features
        layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight        [d]
        layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight [hd]
        layers.{i}.mlp.{gate,up,down}_proj.weight
        norm.weight                                [d]
        lm_head.weight                             [N, d]    N = draft_vocab_size, rows sorted by target id
        d2t [N] int64 (target_id - draft_id), t2d [V] bool   only with a draft vocabulary (as EAGLE-3's)
      (no embed_tokens: vLLM and speculators take the base's)
    mask_embedding.pt   {"mask_token_id": id, "embedding": [d]}: the learned mask embedding, which vLLM's
                        DFlash loader reads from this file (torch.load weights_only) and substitutes for
                        embed_tokens[mask_token_id]; absent when the mask is the base's own row
    config.json
        speculators_model_type "dflash", architectures ["DFlashSpeculator"], transformer_layer_config (a Qwen3
        config of the base's dimensions with num_hidden_layers = the draft's layers: vLLM's DFlash layers are
        Qwen3-shaped, q_norm / k_norm included, whatever the base's architecture), draft_vocab_size,
        block_size, target_hidden_size, aux_hidden_state_layer_ids (HF hidden-state ids; vLLM maps them to
        eagle_aux_hidden_state_layer_ids and to dflash_config.target_layer_ids = id - 1), mask_token_id,
        sliding_window_non_causal true (vLLM: dflash_config.causal = not it; our layers are full attention and
        bidirectional inside the block), sample_from_anchor false (slot 0 is the root, γ-1 drafts),
        speculators_config {algorithm dflash, greedy proposal of γ-1 tokens, verifier}.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView
from models.export.speculators import block_draft_config, load_strict, read_speculators_tensors, speculators_tensors
from models.families.dflash.model import DFlashDraft

MASK_EMBEDDING_FILE = "mask_embedding.pt"
def dflash_speculators_config(draft: DFlashDraft, verifier: str, speculative_tokens: int | None = None) -> dict:
    return block_draft_config(draft, "dflash", "DFlashSpeculator", verifier, speculative_tokens)


def dflash_speculators_tensors(draft: DFlashDraft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' / vLLM's names (the mask embedding travels in its own file)."""
    return speculators_tensors(draft, dtype, skip=("d2t", "mask_embedding"))


def mask_embedding_bytes(draft: DFlashDraft, dtype: torch.dtype | None = None) -> bytes:
    """mask_embedding.pt as vLLM reads it: a dict with the mask token id and the [d] embedding."""
    emb = draft.mask_embedding.detach().cpu()
    buf = io.BytesIO()
    torch.save({"mask_token_id": draft.mask_token_id, "embedding": emb.to(dtype) if dtype else emb.clone()}, buf)
    return buf.getvalue()


def export_dflash_speculators(draft: DFlashDraft, out_dir: Path, verifier: str, *,
                              speculative_tokens: int | None = None, dtype: torch.dtype | None = None,
                              extra_files: dict | None = None) -> Path:
    """Write `draft` as a speculators DFlash checkpoint (+ mask_embedding.pt when the mask was learned).
    extra_files: more {name: writer(path)} entries written into the same directory atomically."""
    if getattr(draft, "family", None) != "dflash":
        raise ValueError(f"the DFlash export needs a DFlash draft, this run is {getattr(draft, 'family', None)!r}")
    config = dflash_speculators_config(draft, verifier, speculative_tokens)
    tensors = dflash_speculators_tensors(draft, dtype)
    files = {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
        **(extra_files or {}),
    }
    if draft.learned_mask:
        data = mask_embedding_bytes(draft, dtype)
        files[MASK_EMBEDDING_FILE] = lambda p: p.write_bytes(data)
    return write_dir_atomic(Path(out_dir), files)


def load_dflash_speculators(export_dir: Path, base: BaseView) -> DFlashDraft:
    """Read a speculators DFlash checkpoint back into a DFlashDraft on `base` (the round trip). The mask embedding
    file is read with torch.load(weights_only=True): tensors and plain containers only, never arbitrary objects."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    if config.get("speculators_model_type") != "dflash":
        raise ValueError(f"{export_dir} is not a speculators DFlash checkpoint "
                         f"(speculators_model_type={config.get('speculators_model_type')!r})")
    if config.get("sample_from_anchor") or config.get("sliding_window_non_causal") is False:
        raise ValueError(f"{export_dir}: sample_from_anchor / causal blocks are DFlash variants specdraft does not "
                         "implement")
    layer = config["transformer_layer_config"]
    if any(t != "full_attention" for t in layer.get("layer_types") or []):
        raise ValueError(f"{export_dir}: sliding-window draft layers are not implemented in specdraft")
    tensors, view = read_speculators_tensors(export_dir, config, base)
    mask_file = export_dir / MASK_EMBEDDING_FILE
    draft = DFlashDraft(view, config["aux_hidden_state_layer_ids"], int(layer["num_hidden_layers"]),
                        int(config["block_size"]), int(config["mask_token_id"]), learned_mask=mask_file.is_file(),
                        init_weights=False)
    if mask_file.is_file():
        state = torch.load(mask_file, weights_only=True)
        tensors["mask_embedding"] = state["embedding"] if isinstance(state, dict) else state
    else:
        tensors["mask_embedding"] = draft.mask_embedding.detach().clone()  # the base's row of the mask token
    return load_strict(draft, tensors, export_dir)
