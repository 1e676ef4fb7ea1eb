"""EAGLE-3 in the `speculators` format, the one vLLM serves with `method: eagle3` (docs/concepts.md#draft-families;
the pieces every speculators writer shares are in models/export/speculators.py).

Layout (checked against speculators 0.9.0 `models/eagle3/{config,core,model_definitions}.py` and vLLM 0.32
`model_executor/models/llama_eagle3.py`, `transformers_utils/configs/speculators/{base,algos}.py`):

    model.safetensors
        fc.weight                     [d, k*d]   over the aux layers side by side, in eagle_aux_... order
        layers.0.input_layernorm.weight, layers.0.hidden_norm.weight, layers.0.post_attention_layernorm.weight
        layers.0.self_attn.{q,k,v}_proj.weight  [*, 2d]   input = [norm(embedding); norm(feature)]
        layers.0.self_attn.o_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight
        layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight
        layers.{i}.self_attn.{q,k,v,o}_proj.weight  [*, d]   layers.{i}.mlp.{gate,up,down}_proj.weight
                                      only a deeper draft (i = 1 .. num_layers - 1): plain decoder layers of the
                                      base's shape (speculators' later layers, vLLM's layer_idx > 0: d-wide q/k/v,
                                      no hidden_norm)
        norm.weight                   [d]
        lm_head.weight                [N, d]     N = draft_vocab_size
        input_norm.weight             [k*d]      only with norm_before_fc: one RMSNorm over the aux states before fc
        fc_norm.{i}.weight            [d]        only with fc_norm: an RMSNorm per aux layer before fc (EAGLE-3.1)
        d2t                           [N] int64  target_id - draft_id (vLLM: target = arange(N) + d2t)
        t2d                           [V] bool   which target ids are in the draft vocabulary
      (d2t / t2d only with a draft vocabulary; no embed_tokens: vLLM and speculators take the base's.)
    config.json
        speculators_model_type "eagle3", architectures ["Eagle3Speculator"], transformer_layer_config (the
        base's LlamaConfig with num_hidden_layers = the draft's decoder layers, draft.eagle3.num_layers, 1 by default),
        draft_vocab_size, the normalisation variants fc_norm,
        norm_before_fc, norm_output, norm_before_residual (each written, true or false: vLLM's reader defaults
        norm_before_residual to true, speculators to false; models/families/eagle3/model.py: NORM_VARIANTS),
        eagle_aux_hidden_state_layer_ids,
        target_hidden_size, speculators_config {algorithm, proposal_methods [greedy, speculative_tokens],
        default_proposal_method, verifier {name_or_path, architectures}}.

P-EAGLE (an EAGLE-3 draft with parallel_drafting; speculators 0.9.0 `models/peagle/{config,core}.py`, vLLM 0.32
`transformers_utils/configs/speculators/algos.py: update_peagle`, `model_executor/models/llama_eagle3.py`): the same
files plus
        mask_hidden                   [1, 1, k*d]  the mask slots' feature before fc (vLLM: a [1, k*d] buffer)
    and in config.json speculators_model_type "peagle", architectures ["PEagleSpeculator"], mask_token_id (vLLM's
    pard_token: the mask slots' input id), speculators_config.algorithm "peagle". vLLM reads it as method eagle3
    with parallel_drafting: true and speculative_tokens drafts from one forward (PeagleLlamaForCausalLM, registered
    as its Eagle3LlamaForCausalLM).

Draft-id order: speculators builds its LM head as W[t2d] (rows in ascending target id), so the rows are
written sorted by target id; d2t offsets are then increasing and both readers agree. Our own draft
vocabulary keeps "most frequent first"; the permutation is undone by `load_speculators`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView
from models.export.speculators import load_strict, read_speculators_tensors, speculators_tensors, verifier_path
from models.export.vllm import TUNED_TOKENS_KEY
from models.families.eagle3.model import MAX_LAYERS, NORM_VARIANTS, Eagle3Draft

# speculators' name for the EAGLE-3 layout (config.json's speculators_model_type; DFlash's: models/families/dflash)
MODEL_TYPE = "eagle3"
PARALLEL_MODEL_TYPE = "peagle"  # the same layout drafting in parallel (P-EAGLE): + mask_hidden, mask_token_id
_DROP_LAYER_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                    "auto_map", "quantization_config", "_commit_hash")


def speculators_config(draft: Eagle3Draft, verifier: str, speculative_tokens: int) -> dict:
    layer = draft.layer_config.to_dict()
    arch = list(layer.get("architectures") or ["LlamaForCausalLM"])
    for key in _DROP_LAYER_KEYS:
        layer.pop(key, None)
    layer.update(num_hidden_layers=int(getattr(draft, "num_layers", 1)), tie_word_embeddings=False,
                 vocab_size=draft.vocab_size)
    parallel = bool(getattr(draft, "parallel_drafting", False))
    variants = draft.norm_variants()
    config = {
        "speculators_model_type": PARALLEL_MODEL_TYPE if parallel else MODEL_TYPE,
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": draft.draft_vocab_size or draft.vocab_size,
        # written explicitly, true or false: vLLM's reader defaults norm_before_residual to true, speculators to false
        **{key: bool(variants.get(key, False)) for key in NORM_VARIANTS},
        "target_hidden_size": draft.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(draft.aux_layers),
        "speculators_config": {
            "algorithm": PARALLEL_MODEL_TYPE if parallel else MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": arch},
        },
    }
    if parallel:
        config["mask_token_id"] = int(draft.mask_token_id)
    return config


def export_speculators(draft, out_dir: Path, base_name: str, *, verifier: str | None = None,
                       speculative_tokens: int | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write `draft` (an EAGLE-3 draft) as a speculators checkpoint that vLLM serves with method eagle3.

    verifier: the target model vLLM / speculators load (default: `verifier_path(base_name)`);
    speculative_tokens: the chain length written as the default proposal (default: the draft's ttt_steps);
    dtype: cast floating tensors (e.g. torch.bfloat16 for serving); None keeps the training dtype.
    """
    # The layout is EAGLE-3's (fc, layers.0, d2t / t2d): the one family that declares the speculators format.
    if "speculators" not in getattr(getattr(draft, "facts", None), "export_formats", ()):
        raise ValueError(f"--format speculators needs an EAGLE-3 draft, this run is {getattr(draft, 'family', None)!r}")
    config = speculators_config(draft, verifier or verifier_path(base_name),
                                speculative_tokens or draft.ttt_steps)
    tensors = speculators_tensors(draft, dtype)
    return write_dir_atomic(Path(out_dir), {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
    })


def write_speculators(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """`specdraft export --format speculators` (FamilySpec.writers): tune's vLLM choice (config.json, when
    speculating won) is the default proposal, as with --format vllm."""
    return export_speculators(draft, out_dir, export_cfg["base_model"],
                              speculative_tokens=export_cfg.get(TUNED_TOKENS_KEY))


def load_speculators(export_dir: Path, base: BaseView) -> Eagle3Draft:
    """Read a speculators EAGLE-3 (or P-EAGLE) checkpoint back into an Eagle3Draft on `base` (the round trip; also
    loads checkpoints trained by speculators itself when they use this layout)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind not in (MODEL_TYPE, PARALLEL_MODEL_TYPE):
        raise ValueError(f"{export_dir} is not a speculators EAGLE-3 or P-EAGLE checkpoint "
                         f"(speculators_model_type={kind!r})")
    parallel = kind == PARALLEL_MODEL_TYPE
    if parallel and config.get("mask_token_id") is None:
        raise ValueError(f"{export_dir}: a peagle checkpoint needs mask_token_id (the mask slots' token)")
    if "norm_before_residual" not in config:  # the readers disagree on its default (vLLM true, speculators false)
        raise ValueError(f"{export_dir}: config.json has no norm_before_residual; write it (true or false) so every "
                         "engine reads the same layout")
    if config.get("fc_norm") and config.get("norm_before_fc"):
        raise ValueError(f"{export_dir}: fc_norm and norm_before_fc are both true; speculators allows one of them")
    layers = int(config["transformer_layer_config"].get("num_hidden_layers", 1))
    if not 1 <= layers <= MAX_LAYERS:
        raise ValueError(f"{export_dir}: transformer_layer_config.num_hidden_layers={layers}; specdraft's EAGLE-3 has "
                         f"1..{MAX_LAYERS} decoder layers")
    tensors, view = read_speculators_tensors(export_dir, config, base)
    steps = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    draft = Eagle3Draft(view, config["eagle_aux_hidden_state_layer_ids"], min(max(steps, 1), 7), init_from_base=False,
                        parallel_drafting=parallel, mask_token_id=config.get("mask_token_id"), num_layers=layers,
                        **{key: bool(config.get(key, False)) for key in NORM_VARIANTS})
    return load_strict(draft, tensors, export_dir)
