"""What the family decoding tests (tests/test_*_decoding.py) check of a trained draft, written once."""

from __future__ import annotations

from eval.engine.decoder import speculative_generate

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
    assert min(lengths) > 2.0  # memorised continuations: most steps accept several drafts
