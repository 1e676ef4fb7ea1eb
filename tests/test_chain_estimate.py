"""The teacher-forced chain estimate (train/chain_estimate.py) replays greedy chain decoding: on the base's own
greedy text it equals the decoder's measured acceptance length, for a half-trained Medusa and EAGLE-3 draft."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fit_draft
from helpers.drafts import greedy_continuation_batch

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter, chain_overrides
from eval.harness.config import EvalConfig
from models.families.eagle3.model import Eagle3Draft
from models.families.medusa.model import MedusaDraft
from train.chain_estimate import chain_estimates, walk
from train.config import LossSection

NEW = 24


def test_walk_counts_tokens_and_steps_like_the_decoder():
    # answer of 8 tokens; x_P comes from the prefill. Root 0 accepts 2 drafts (+ bonus: 3 tokens, next root 3),
    # root 3 none (1 token, next root 4), root 4 accepts 3 but only 2 tokens are left before the answer ends.
    runs = [2, 9, 9, 0, 3, 9, 9, 9]
    assert walk(runs, 8) == (7, 3)
    assert walk([0] * 8, 8) == (7, 7)  # no draft ever right: plain decoding, AL 1


def _draft(family, view):
    torch.manual_seed(0)
    if family == "medusa":
        return MedusaDraft(num_heads=3, num_layers=1, base=view)
    return Eagle3Draft(view, ttt_steps=3)


@pytest.mark.parametrize("family", ["medusa", "eagle3"])
def test_chain_estimate_equals_the_decoded_chain(model, view, prompts, family):
    draft = _draft(family, view)
    batch = greedy_continuation_batch(model, prompts, getattr(draft, "aux_layers", None) or [0], NEW + 4)
    if family == "medusa":  # Medusa reads h alone
        batch = dataclasses.replace(batch, aux_hidden=None)
    # a few steps only: some depths right, some wrong, so the walk has real choices to make
    fit_draft(draft, [batch], view, LossSection(chunk_size=64), steps=12, lr=1e-2)
    draft.eval()
    export_cfg = {"family": family, **draft.export_config()}
    overrides = chain_overrides(family, 3)
    cfg = dataclasses.replace(EvalConfig(), **overrides)
    drafter, _ = build_drafter(draft, export_cfg, cfg)
    backend = HFBackend(model)
    tokens = steps = 0
    texts = []
    for p in prompts:
        g = speculative_generate(backend, drafter, p, max_new_tokens=NEW)
        tokens += len(g.tokens) - 1
        steps += g.base_steps
        texts.append((p.tolist() + g.tokens, p.numel()))
    decoded = tokens / steps
    assert 1.0 < decoded < 4.0  # neither plain decoding nor every draft right: the test has teeth
    est = chain_estimates(draft, model, view, texts, LossSection(chunk_size=64), "cpu", torch.float32)
    assert est["est_accept_len_chain"] == pytest.approx(decoded, abs=1e-9), (est, decoded)
    assert est["inconsistent_roots"] == 0
    assert est["roots"] == sum(len(ids) - n for ids, n in texts)  # roots P - 1 .. T - 2 of every text
