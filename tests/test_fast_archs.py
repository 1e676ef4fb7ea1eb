"""`fast` backend beyond LLaMA (Qwen2, Qwen3, Mistral; sliding windows): logits / hidden / committed
K/V parity with the `hf` backend step by step, eager and static (padded-bucket) modes, with windows small
enough (4 / 8 tokens) that the prompt and trees cross them; and `supports()` decisions."""

from __future__ import annotations

import pytest
import torch
from helpers.trees import same_tree_steps

from eval.engine.backends.fast import FastBackend, supports
from eval.engine.backends.hf import HFBackend
from models.tiny import tiny_config, tiny_model

ATOL = 5e-5  # diverse weights give logits of ~6: fp32 reorderings differ by ~5e-6; any real bug by >1e-2
# (arch, extra config): default tiny models, small windows, a Qwen2 mixing full and sliding layers.
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "mistral-w4": ("mistral", {"sliding_window": 4}),
    "qwen2-mixed-w4": ("qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3-mixed-w8": ("qwen3", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}),
    "gemma3": ("gemma3", {}),
    "gemma3-w4": ("gemma3", {"sliding_window": 4}),
}


def _model(name: str):
    arch, extra = CASES[name]
    model = tiny_model(arch, seed=3, diverse=True, **extra)
    with torch.no_grad():  # give the (zero-initialised) Qwen2 biases values: a dropped bias must show
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("name", list(CASES))
def test_fast_matches_hf_backend_step_by_step(name, static):
    model = _model(name)
    assert supports(model.config)[0]
    gen = torch.Generator().manual_seed(3)
    fast, hf = FastBackend(model, max_len=64, static=static), HFBackend(model)
    for b in (fast, hf):
        b.reset(64)
    prompt = torch.randint(3, 320, (7,), generator=gen)
    steps = same_tree_steps(fast, hf, prompt, (6, 1, 4, 9, 1, 5), gen)
    for step, ((f_logits, f_hidden), (h_logits, h_hidden)) in enumerate(steps):
        torch.testing.assert_close(f_logits, h_logits, atol=ATOL, rtol=0, msg=f"step {step} logits")
        torch.testing.assert_close(f_hidden, h_hidden, atol=ATOL, rtol=0, msg=f"step {step} hidden")
    length = fast.cache_len
    assert length == hf.cache_len and length > 20  # several windows' worth
    for layer, (k, v) in enumerate(hf.committed_kv()):  # a sliding hf layer holds only its last W-1
        s = k.shape[1]
        torch.testing.assert_close(fast._core.k_cache[layer, :, length - s:length], k, atol=ATOL, rtol=0)
        torch.testing.assert_close(fast._core.v_cache[layer, :, length - s:length], v, atol=ATOL, rtol=0)


def test_supports_decisions():
    assert supports(tiny_config("llama"))[0] and supports(tiny_config("mistral"))[0]
    cfg = tiny_config("gemma3")
    cfg.attn_logit_softcapping = 50.0
    ok, why = supports(cfg)
    assert not ok and "attn_logit_softcapping" in why and "backend=hf" in why
    cfg = tiny_config("llama")
    cfg.model_type = "gpt_neox"
    ok, why = supports(cfg)
    assert not ok and "gemma3_text" in why and "not 'gpt_neox'" in why
    cfg = tiny_config("qwen2")
    cfg.hidden_act = "gelu"
    ok, why = supports(cfg)
    assert not ok and "hidden_act='gelu' is not implemented" in why and "backend=hf" in why
    cfg = tiny_config("qwen2")
    cfg.layer_types = ["full_attention", "linear_attention"]
    ok, why = supports(cfg)
    assert not ok and "linear_attention" in why
