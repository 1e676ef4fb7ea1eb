"""transformers `generate` baselines, timed the same way as our decoder (docs/concepts.md#baselines).

Both functions return `TimedGeneration(tokens, seconds, prefill_seconds)`:
  tokens: the new token ids, including the eos token when generation stopped on one (the same
    convention as our decoder, so lossless checks compare like with like);
  prefill_seconds: a separate `generate(max_new_tokens=1)` call on the same prompt (prompt forward +
    choosing the first token, plus generate's fixed per-call overhead);
  seconds: wall time of the full call minus prefill_seconds, i.e. decode time, so tokens/s here
    means the same thing as the decoder's "prefill excluded" tokens/s. Subtracting a separate call
    (instead of timestamping inside the call) also removes generate's set-up overhead, which our
    decoder's decode timer does not include either.
On CUDA every timer is bracketed by `torch.cuda.synchronize`, so queued kernels are counted.
Call `warmup` first: the first calls pay for kernel selection, allocator growth and lazy init.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from transformers import GenerationConfig


class TimedGeneration(NamedTuple):
    tokens: list[int]
    seconds: float
    prefill_seconds: float

    @property
    def total_seconds(self) -> float:
        return self.seconds + self.prefill_seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _greedy_config(max_new_tokens: int, eos_ids: Iterable[int], pad_id: int | None,
                   **extra) -> GenerationConfig:
    """Plain greedy decoding settings (see `_without_model_defaults` for why that is not enough)."""
    eos = sorted({int(e) for e in eos_ids})
    if not eos:
        raise ValueError("eos_ids is empty; pass the base tokenizer's end-of-turn id(s) (e.g. <|im_end|>)")
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                            eos_token_id=eos, pad_token_id=eos[0] if pad_id is None else pad_id,
                            use_cache=True, **extra)


@contextmanager
def _without_model_defaults(model):
    """Hide the model's own generation_config for the call.

    transformers 5 fills every field our config leaves unset (None) from `model.generation_config`,
    so a checkpoint's repetition_penalty, no_repeat_ngram_size, bad_words_ids, ... would silently
    change the "greedy" baseline (a test caught repetition_penalty doing exactly that).
    """
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@torch.inference_mode()
def _timed_generate(model, input_ids: Sequence[int], config: GenerationConfig) -> tuple[list[int], float]:
    device = model.device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    with _without_model_defaults(model):
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _sync(device)
        seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds


def _run(model, input_ids: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int],
         pad_id: int | None, **extra) -> TimedGeneration:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; need at least 1")
    if len(input_ids) == 0:
        raise ValueError("empty prompt: input_ids must hold at least one token (render the chat template)")
    eos_ids = list(eos_ids)
    _, prefill = _timed_generate(model, input_ids, _greedy_config(1, eos_ids, pad_id))
    config = _greedy_config(max_new_tokens, eos_ids, pad_id, **extra)
    tokens, total = _timed_generate(model, input_ids, config)
    # Clamped: on a very short generation timer noise can make the difference slightly negative.
    return TimedGeneration(tokens, max(total - prefill, 0.0), prefill)


def hf_generate_timed(model, input_ids: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int], *,
                      pad_id: int | None = None) -> TimedGeneration:
    """Greedy `model.generate(do_sample=False, num_beams=1)`; see the module docstring for timing."""
    return _run(model, input_ids, max_new_tokens, eos_ids, pad_id)


def prompt_lookup_generate_timed(model, input_ids: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int],
                                 *, prompt_lookup_num_tokens: int = 10, max_matching_ngram_size: int = 2,
                                 pad_id: int | None = None) -> TimedGeneration:
    """Greedy generate with transformers' prompt lookup decoding (n-gram drafts copied from the
    prompt + output, verified by the model): the off-the-shelf n-gram baseline.

    prompt_lookup_num_tokens: tokens drafted per step; max_matching_ngram_size: longest n-gram
    matched against the context (transformers' default is 2). Greedy verification keeps the output
    equal to plain greedy decoding up to floating-point ties.
    """
    if prompt_lookup_num_tokens < 1:
        raise ValueError(f"prompt_lookup_num_tokens={prompt_lookup_num_tokens}; need at least 1")
    return _run(model, input_ids, max_new_tokens, eos_ids, pad_id,
                prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                max_matching_ngram_size=max_matching_ngram_size)


def warmup(model, input_ids: Sequence[int], eos_ids: Iterable[int], *, max_new_tokens: int = 16,
           repeats: int = 2, prompt_lookup: bool = False) -> None:
    """Run a few untimed generations so later timings exclude one-off start-up costs."""
    for _ in range(repeats):
        hf_generate_timed(model, input_ids, max_new_tokens, eos_ids)
        if prompt_lookup:
            prompt_lookup_generate_timed(model, input_ids, max_new_tokens, eos_ids)
