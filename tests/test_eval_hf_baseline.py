"""HF generate baselines: greedy tokens equal a cache-free argmax loop, eos stops, timing is sane."""

import pytest
import torch
from transformers import LlamaForCausalLM

from eval.harness.hf_baseline import TimedGeneration, hf_generate_timed, prompt_lookup_generate_timed, warmup
from eval.harness.prompts import render_chat
from models.tiny import tiny_llama_config, tiny_tokenizer

MAX_NEW = 16


@pytest.fixture(scope="module")
def model():
    # Wider init than the default: the default tiny model just repeats "\n" forever (tied embeddings
    # echo the last input token), which would make the token comparisons vacuous.
    config = tiny_llama_config()
    config.initializer_range = 0.3
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompt():
    return render_chat(tiny_tokenizer(), [{"role": "user", "content": "Write a haiku about the sea."}])


@torch.no_grad()
def manual_greedy(model, ids, max_new, eos_ids):
    """Reference twin: full recompute every step (no KV cache), argmax, stop after an eos token."""
    seq, out = list(ids), []
    for _ in range(max_new):
        nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
        if nxt in eos_ids:
            break
    return out


def test_greedy_matches_manual_loop_and_is_timed(model, prompt):
    expected = manual_greedy(model, prompt, MAX_NEW, {2})
    assert len(set(expected)) > 3, "fixture model degenerate: the comparison would prove little"
    result = hf_generate_timed(model, prompt, MAX_NEW, [2])
    assert isinstance(result, TimedGeneration)
    tokens, seconds, prefill = result  # unpacks as the 3-tuple of the contract
    assert tokens == expected
    assert seconds >= 0 and prefill > 0
    assert result.total_seconds == pytest.approx(seconds + prefill)


def test_stops_at_eos_and_keeps_it(model, prompt):
    free = manual_greedy(model, prompt, MAX_NEW, set())
    # An eos id that first appears mid-sequence, so stopping there is observable.
    cut = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    eos = free[cut]
    tokens, _, _ = hf_generate_timed(model, prompt, MAX_NEW, [eos, 2])
    assert tokens == free[:cut + 1]
    assert tokens[-1] == eos


def test_prompt_lookup_is_greedy(model, prompt):
    expected = manual_greedy(model, prompt, MAX_NEW, {2})
    tokens, seconds, prefill = prompt_lookup_generate_timed(model, prompt, MAX_NEW, [2],
                                                            prompt_lookup_num_tokens=3)
    assert tokens == expected
    assert seconds >= 0 and prefill > 0


def test_model_generation_config_does_not_leak(model, prompt):
    # A sampling default on the model must not turn the greedy baseline into sampling.
    saved = model.generation_config
    try:
        model.generation_config = type(saved)(do_sample=True, temperature=5.0, top_k=0,
                                              repetition_penalty=3.0)
        assert hf_generate_timed(model, prompt, MAX_NEW, [2]).tokens == manual_greedy(model, prompt,
                                                                                       MAX_NEW, {2})
    finally:
        model.generation_config = saved


def test_bad_arguments(model, prompt):
    with pytest.raises(ValueError, match="eos_ids"):
        hf_generate_timed(model, prompt, 4, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf_generate_timed(model, prompt, 0, [2])
    with pytest.raises(ValueError, match="empty prompt"):
        hf_generate_timed(model, [], 4, [2])
    warmup(model, prompt, [2], max_new_tokens=2, repeats=1, prompt_lookup=True)  # smoke: runs
