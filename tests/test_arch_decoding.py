"""Greedy speculative decoding is lossless on every tiny architecture (fp32), with the `hf` backend
and, where it supports the architecture, the `fast` one: the output equals transformers' plain greedy
`generate` token for token. Sliding-window models run with 8-token windows that the 7/12-token
prompts + 24 new tokens cross many times, so the window masks and cache trimming are exercised."""

from __future__ import annotations

import pytest
import torch
from helpers.oracles import NoisyPathsOracle

from eval.engine.backends.fast import FastBackend, supports
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from models.tiny import TINY_ARCHS, tiny_config, tiny_model

NEW = 24
# (arch, window): every tiny architecture at its default (16-token windows) and two at 8 tokens.
CASES = [(a, None) for a in TINY_ARCHS] + [("mistral", 8), ("gemma3", 8)]
IDS = [a if w is None else f"{a}-w{w}" for a, w in CASES]


def make_model(arch: str, window: int | None):
    return tiny_model(arch, seed=0, diverse=True, **({} if window is None else {"sliding_window": window}))


def greedy_reference(model, prompt: torch.Tensor) -> list[int]:
    """prompt + NEW + 4 greedy tokens from transformers generate (its own cache and masks)."""
    with torch.inference_mode():
        out = model.generate(prompt[None], max_new_tokens=NEW + 4, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0].tolist()


def check_lossless(model, backend, prompts) -> None:
    for i, prompt in enumerate(prompts):
        ref = greedy_reference(model, prompt)
        want = ref[prompt.numel(): prompt.numel() + NEW]
        assert len(set(want)) > 4, "degenerate continuation: the check would be trivial"
        ar = autoregressive_generate(backend, prompt, max_new_tokens=NEW, eos_ids=None)
        assert ar.tokens == want
        res = speculative_generate(backend, NoisyPathsOracle(ref, seed=i), prompt, max_new_tokens=NEW, eos_ids=None)
        assert res.tokens == want
        assert res.acceptance_length > 1.5  # drafts really were accepted


@pytest.fixture(scope="module")
def arch_prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=gen) for n in (7, 12)]


@pytest.mark.parametrize(("arch", "window"), CASES, ids=IDS)
def test_hf_backend_greedy_lossless(arch, window, arch_prompts):
    model = make_model(arch, window)
    check_lossless(model, HFBackend(model), arch_prompts)


FAST_CASES = [(a, w) for a, w in CASES if supports(tiny_config(a))[0] and a != "llama"]  # llama: test_eval_decoder


@pytest.mark.parametrize(("arch", "window"), FAST_CASES, ids=[a if w is None else f"{a}-w{w}" for a, w in FAST_CASES])
def test_fast_backend_greedy_lossless(arch, window, arch_prompts):
    model = make_model(arch, window)
    check_lossless(model, FastBackend(model, max_len=64), arch_prompts)
