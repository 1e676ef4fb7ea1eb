"""DSpark in the `speculators` format, the one vLLM serves with `method: dspark` (docs/families/dspark.md#export).

Layout (read from speculators `models/dspark/{config,core,model_definitions}.py` and vLLM 0.32
`model_executor/models/qwen3_dspark.py`, `transformers_utils/configs/speculators/algos.py: update_dspark`,
`v1/worker/gpu/spec_decode/dspark/speculator.py`):

    model.safetensors
        DFlash's tensors (fc, hidden_norm, layers.{i}.*, norm, lm_head [N, d] rows sorted by target id, d2t / t2d
        with a draft vocabulary; models/families/dflash/export_speculators.py), plus
        markov_head.markov_w1.weight     [V, r]     indexed by the previous token's base (target) id
        markov_head.markov_w2.weight     [N, r]     rows in the lm_head's order (sorted by target id)
        confidence_head.proj.weight      [1, d + r] over [norm(h) ; markov_w1[prev]]
        confidence_head.proj.bias        [1]
      (no embed_tokens, no mask embedding: vLLM's DSpark loader shares the base's embedding and "masks via the
      vocab row", embed_tokens[mask_token_id], which is what our DSpark trains with)
    config.json
        speculators_model_type "dspark", architectures ["Qwen3DSparkModel"] (what update_dspark selects),
        transformer_layer_config (the Qwen3 config of DFlash's export), draft_vocab_size, block_size,
        target_hidden_size, aux_hidden_state_layer_ids (vLLM: target_layer_ids = id - 1), mask_token_id,
        sample_from_anchor true (every slot drafts, the root's included: vLLM queries block_size slots and drafts
        block_size tokens; update_dspark's default is false, so it is written), markov_rank, markov_head_type
        "vanilla", enable_confidence_head true, confidence_head_with_markov true, sliding_window_non_causal true,
        speculators_config {algorithm dspark, greedy proposal of block_size tokens, verifier}.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView
from models.export.speculators import block_draft_config, load_strict, read_speculators_tensors, speculators_tensors
from models.families.dspark.model import DSparkDraft

MODEL_TYPE = "dspark"


def dspark_speculators_config(draft: DSparkDraft, verifier: str, speculative_tokens: int | None = None) -> dict:
    return {**block_draft_config(draft, MODEL_TYPE, "Qwen3DSparkModel", verifier, speculative_tokens),
            "markov_rank": draft.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True}


def dspark_speculators_tensors(draft: DSparkDraft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' / vLLM's names; with a draft vocabulary markov_w2's rows follow the
    lm_head's (sorted by target id)."""
    out = speculators_tensors(draft, dtype, skip=("d2t", "mask_embedding"))
    if draft.d2t is not None:
        order = torch.sort(draft.d2t.cpu()).indices
        out["markov_head.markov_w2.weight"] = out["markov_head.markov_w2.weight"][order].contiguous()
    return out


def export_dspark_speculators(draft: DSparkDraft, out_dir: Path, verifier: str, *,
                              speculative_tokens: int | None = None, dtype: torch.dtype | None = None,
                              extra_files: dict | None = None) -> Path:
    """Write `draft` as a speculators DSpark checkpoint. extra_files: more {name: writer(path)} entries written into
    the same directory atomically."""
    if getattr(draft, "family", None) != "dspark":
        raise ValueError(f"the DSpark export needs a DSpark draft, this run is {getattr(draft, 'family', None)!r}")
    config = dspark_speculators_config(draft, verifier, speculative_tokens)
    tensors = dspark_speculators_tensors(draft, dtype)
    return write_dir_atomic(Path(out_dir), {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
        **(extra_files or {}),
    })


def load_dspark_speculators(export_dir: Path, base: BaseView) -> DSparkDraft:
    """Read a speculators DSpark checkpoint back into a DSparkDraft on `base` (the round trip); refuses the variants
    specdraft does not implement (the anchor as a bonus token, other Markov heads, no confidence head)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    if config.get("speculators_model_type") != MODEL_TYPE:
        raise ValueError(f"{export_dir} is not a speculators DSpark checkpoint "
                         f"(speculators_model_type={config.get('speculators_model_type')!r})")
    wanted = {"sample_from_anchor": True, "markov_head_type": "vanilla", "enable_confidence_head": True,
              "confidence_head_with_markov": True}
    other = {k: config.get(k) for k, v in wanted.items() if config.get(k, v) != v}
    if other:
        raise ValueError(f"{export_dir}: {other} is a DSpark variant specdraft does not implement (it has {wanted})")
    layer = config["transformer_layer_config"]
    tensors, view = read_speculators_tensors(export_dir, config, base)
    draft = DSparkDraft(view, config["aux_hidden_state_layer_ids"], int(layer["num_hidden_layers"]),
                        int(config["block_size"]), int(config["mask_token_id"]),
                        markov_rank=int(config["markov_rank"]), init_weights=False)
    tensors["mask_embedding"] = draft.mask_embedding.detach().clone()  # the base's row of the mask token
    return load_strict(draft, tensors, export_dir)
