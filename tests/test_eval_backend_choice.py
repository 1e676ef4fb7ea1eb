"""backend=auto: the fast backend where eval.engine.backends.fast.supports the base, the hf backend otherwise; the
report says which and why."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, OlmoConfig, OlmoForCausalLM

from core.config_loader import ConfigError
from eval.engine.backends.choice import choose_backend, make_backend
from eval.engine.backends.fast import FastBackend, supports
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.harness.config import EvalConfig, load_eval_config
from eval.harness.runner import run_context
from models.tiny import diverse_tiny_llama


@pytest.fixture(scope="module")
def gpt2():
    """A random tiny GPT-2: a causal LM the fast backend does not implement (absolute positions, GELU)."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=320, n_positions=256, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def olmo():
    """A random tiny OLMo: LLaMA-like layout (so the hf backend drives it) but not a fast-backend architecture."""
    torch.manual_seed(0)
    cfg = OlmoConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    return OlmoForCausalLM(cfg).eval()


def test_auto_is_the_default_and_validated():
    assert EvalConfig().backend == "auto"
    assert load_eval_config(["configs/eval/demo.yaml"]).backend == "auto"
    with pytest.raises(ConfigError, match="backend"):
        load_eval_config(None, ["backend=fastest"])


def test_tiny_llama_gets_the_fast_backend(model):
    ok, why = supports(model.config)
    assert ok and "llama" in why
    kind, reason = choose_backend("auto", model)
    assert kind == "fast" and reason.startswith("auto:")
    assert isinstance(make_backend("auto", model), FastBackend)


def test_gpt2_gets_the_hf_backend(gpt2):
    ok, why = supports(gpt2.config)
    assert not ok and "gpt2" in why
    kind, reason = choose_backend("auto", gpt2)
    assert kind == "hf" and "gpt2" in reason
    with pytest.raises(ValueError, match="backend=hf"):  # asked for explicitly, fast still refuses clearly
        FastBackend(gpt2)


def test_a_non_llama_base_decodes_through_auto_losslessly(olmo):
    assert choose_backend("auto", olmo)[0] == "hf"
    backend = make_backend("auto", olmo)
    assert isinstance(backend, HFBackend)
    prompt = torch.randint(3, 320, (9,), generator=torch.Generator().manual_seed(1))
    ar = autoregressive_generate(backend, prompt, max_new_tokens=12)

    class Oracle:  # drafts the true continuation (2 tokens): a multi-node tree through the hf backend
        name, max_nodes = "oracle", 3

        def reset(self):
            pass

        def propose(self, state):
            from eval.engine.tree import chain_tree

            i = len(state.ids) - prompt.numel()  # index of the root in ar.tokens
            return chain_tree(state.root, ar.tokens[i + 1: i + 3] or [0])

    spec = speculative_generate(backend, Oracle(), prompt, max_new_tokens=12)
    assert spec.tokens == ar.tokens and spec.acceptance_length > 1.5


def test_explicit_choice_is_kept(model):
    assert choose_backend("hf", model) == ("hf", "backend=hf was asked for")
    assert isinstance(make_backend("hf", model), HFBackend)


def test_report_records_the_choice(gpt2):
    base = types.SimpleNamespace(model=gpt2, fingerprint="f" * 16)
    ctx = run_context(EvalConfig(), base, [], 0)
    assert ctx["backend"] == "hf" and "gpt2" in ctx["backend_reason"]
    ctx = run_context(EvalConfig(), types.SimpleNamespace(model=diverse_tiny_llama(0), fingerprint="0" * 16), [], 0)
    assert ctx["backend"] == "fast"
