"""EAGLE-3 for llama.cpp (`specdraft export --format gguf`, eval/serving/llamacpp_gguf.py: draft_gguf): what its
converter, convert_hf_to_gguf.py, reads for an EAGLE-3 draft. A role module of the family's package, on the serving
layer (tests/test_layers.py), found by eval/serving by its fixed name."""

from __future__ import annotations

from pathlib import Path

from models.families.eagle3.export_speculators import export_speculators


def converter_input(draft, export_cfg: dict, base_dir: Path, out_dir: Path) -> Path:
    """What llama.cpp's converter reads for an EAGLE-3 draft: our speculators export (fp32 files), with the
    verifier pointing at the base directory the draft GGUF goes with."""
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
