"""What the family decoding tests (tests/test_*_decoding.py) check of a trained draft, written once."""

from __future__ import annotations

import torch

from eval.engine.decoder import autoregressive_generate, speculative_generate

# Tokens each prompt is decoded for in the family decoding tests: what conftest's ar_outputs holds.
DECODE_NEW_TOKENS = 20


def assert_lossless_and_accepting(backend, drafter, prompts, ar_outputs, *, context_cache: bool = True) -> None:
    """Speculative decoding of each prompt (DECODE_NEW_TOKENS) with a draft that memorised the base's greedy
    continuations: exactly the plain greedy output `ar_outputs`, and every prompt's acceptance length > 2 (most
    steps accept several drafts). context_cache: the draft keeps its own cache of the committed context, which
    must hold exactly the positions committed before the last propose()."""
    lengths = []
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=DECODE_NEW_TOKENS)
        assert got.tokens == want
        lengths.append(got.acceptance_length)
        if context_cache:
            assert drafter._cache.length == prompt.numel() + sum(got.accepted_lengths[:-1])
        assert_simulation_exact(backend, drafter, prompt, got)
    assert min(lengths) > 2.0  # memorised continuations: most steps accept several drafts


def assert_simulation_exact(backend, drafter, prompt, decoded) -> None:
    """The field benchmark's simulated acceptance (eval/field/simulation.py) of `drafter` on `prompt` equals the
    decoded run `decoded` step for step: the base's greedy answer stored (with the tail past its end), one
    teacher-forced pass for the hidden states, the drafter replayed against it."""
    from eval.field.refs import TAIL
    from eval.field.simulation import simulate, teacher_forced

    n = len(decoded.tokens)
    answer = autoregressive_generate(backend, prompt, max_new_tokens=n + TAIL).tokens
    assert answer[:n] == decoded.tokens
    aux_layers = tuple(getattr(drafter, "aux_layers", None) or ())
    hidden, aux, _ = teacher_forced(backend, torch.cat([prompt.reshape(-1), torch.tensor(answer)]), aux_layers)
    sim = simulate(drafter, prompt.reshape(-1).tolist(), answer, n, hidden, aux, aux_layers, backend.vocab_size, [])
    assert sim.accepted_lengths == decoded.accepted_lengths, (sim.accepted_lengths, decoded.accepted_lengths)
    assert sim.accept_counts == decoded.accept_counts and sim.tree_nodes == decoded.tree_nodes
