"""The base the regeneration tests answer with: a tiny random LLaMA whose greedy answers vary, in fp32 (so batched
and unbatched decodes agree exactly), with the byte-level tiny tokenizer."""

from types import SimpleNamespace

from models.base import fingerprint_model
from models.tiny import diverse_tiny_llama, tiny_tokenizer

SHAREGPT_FIXTURE = "tests/fixtures/sharegpt_tiny.json"


def regen_base() -> SimpleNamespace:
    """.model / .tokenizer / .fingerprint / .name, as data/self_distill.py reads a models.base.LoadedBase."""
    model = diverse_tiny_llama(0)
    for p in model.parameters():
        p.requires_grad_(False)
    return SimpleNamespace(model=model, tokenizer=tiny_tokenizer(), fingerprint=fingerprint_model(model), name="tiny")
