"""Randomly initialised LLaMA bases for timing on the GPU machine (docs/howto/gpu_kit.md: for speed, a random-init model
of SmolLM2's exact config behaves like the real one; an 8B LLaMA shape shows the large-base regime).

- `random_llama(config, dtype=, device=)`: the model in memory, initialised directly on `device` (an 8B model
  is drawn on the GPU in seconds, never materialised in fp32 on the host).
- `write_random_base(meta_dir, out_dir)`: an HF directory (config.json from `meta_dir`, random safetensors,
  the tokenizer files copied from `meta_dir`) that `load_base(out_dir)` and `specdraft train base.path=...`
  take like any other base. `meta_dir` is launch/pack_data.py's .gpudata/meta (SmolLM2's config + tokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# LLaMA-3-8B's shape (GQA 32/8, SwiGLU 14336, vocab 128256, RoPE theta 5e5, untied head).
LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def _llama_config(config: dict, overrides: dict | None = None):
    from transformers import LlamaConfig

    fields = {k: v for k, v in {**config, **(overrides or {})}.items() if k not in ("architectures", "torch_dtype",
                                                                                    "dtype", "transformers_version")}
    cfg = LlamaConfig(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def random_llama(config: dict, *, overrides: dict | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0):
    """A LlamaForCausalLM of `config` (+ `overrides`) with transformers' own random init (std
    initializer_range), built directly in `dtype` on `device`; frozen, eval mode."""
    from transformers import LlamaForCausalLM

    from models.base import freeze

    cfg = _llama_config(config, overrides)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            if torch.device(device).type == "cuda":
                torch.cuda.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    return freeze(model)


def write_random_base(meta_dir: str | Path, out_dir: str | Path, *, overrides: dict | None = None,
                      seed: int = 0) -> Path:
    """An HF base directory: `meta_dir`'s config.json (+ `overrides`) with random fp32 weights and
    `meta_dir`'s tokenizer files. Returns `out_dir` (complete when its config.json exists)."""
    meta_dir, out_dir = Path(meta_dir), Path(out_dir)
    config_path = meta_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: write the meta folder with "
                                "`python launch/pack_data.py --only meta` (SmolLM2's config + tokenizer)")
    model = random_llama(json.loads(config_path.read_text()), overrides=overrides, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (meta_dir / name).is_file():
            shutil.copyfile(meta_dir / name, out_dir / name)
    model.save_pretrained(out_dir)  # config.json + model.safetensors
    (out_dir / "random_init.json").write_text(json.dumps({"from": str(config_path), "overrides": overrides or {},
                                                          "seed": seed}) + "\n")
    return out_dir
