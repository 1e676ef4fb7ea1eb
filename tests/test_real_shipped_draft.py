"""The shipped draft (drafts/smollm2-eagle3-store) loads through models/export/load.py on the real base and decodes
losslessly with a working acceptance, and its run's config.yaml (the flat keys of its time) loads as a training
config with the same EAGLE-3 options its export records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-eagle3-store"


def test_the_shipped_draft_loads_and_decodes_losslessly():
    from eval.engine.backends.hf import HFBackend
    from eval.engine.decoder import autoregressive_generate, speculative_generate
    from eval.engine.drafters.registry import build_drafter
    from eval.harness.config import EvalConfig
    from models.export.load import load_export
    from train.config import load_train_config

    loaded = load_export(SHIPPED / "export", dtype="fp32")
    assert loaded.family == "eagle3" and loaded.draft.ttt_steps == loaded.config["ttt_steps"] == 3
    cfg = load_train_config([str(SHIPPED / "config.yaml")])
    assert cfg.draft.eagle3.ttt_steps == loaded.draft.ttt_steps
    assert cfg.draft.vocab_size == loaded.draft.draft_vocab_size

    tok = loaded.base.tokenizer
    backend = HFBackend(loaded.base.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for extra in ({}, {"eagle3_mode": "chain"}):
            drafter, _ = build_drafter(loaded.draft, loaded.config, EvalConfig(extra=extra))
            steps = []
            for text in ("Write a haiku about the sea.", "What is 12 times 7? Explain."):
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
                )
                ids = (ids["input_ids"] if hasattr(ids, "keys") else ids)[0]
                res = speculative_generate(backend, drafter, ids, max_new_tokens=24, eos_ids=None)
                assert res.tokens == autoregressive_generate(backend, ids, max_new_tokens=24, eos_ids=None).tokens
                steps += res.accepted_lengths
            assert sum(steps) / len(steps) > 1.3, (extra, steps)  # a draft that loaded wrong accepts ~nothing
    finally:
        torch.set_num_threads(threads)
