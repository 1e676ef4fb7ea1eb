"""The field benchmark's simulated acceptance equals decoding step for step (eval/field/simulation.py), for the families
the shared family decoding helper (tests/helpers/decoding.py: assert_simulation_exact) does not already cover:
Medusa and Hydra static trees, ReDrafter beams, the CTC drafter and N-gram drafts (context n-grams, which read the
committed ids). Drafts are trained briefly on the base's own greedy continuations, so steps accept several tokens
(an untrained draft would make every step 1 and prove nothing)."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_draft
from helpers.decoding import assert_simulation_exact
from helpers.drafts import greedy_continuation_batch

from eval.engine.backends.hf import HFBackend
from eval.engine.backends.replay import ReplayBackend, ReplayError
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter
from eval.harness.config import EvalConfig
from models.draft import BaseView
from models.families.ctc.model import CTCOptions
from models.families.ngram.drafter import NgramDrafter
from models.registry import DRAFT_MODELS
from train.config import DraftSection, LossSection

FAMILIES = {
    "medusa": dict(family="medusa", num_heads=4),
    "hydra": dict(family="hydra", num_heads=4),
    "redrafter": dict(family="redrafter", num_heads=4),
    "ctc": dict(family="ctc", num_heads=4, ctc=CTCOptions(num_frames=5)),
}
NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, busy CPU


@pytest.mark.parametrize("family", list(FAMILIES))
def test_simulated_acceptance_equals_decoded(model, prompts, family):
    view = BaseView.from_model(model)
    torch.manual_seed(0)
    draft = DRAFT_MODELS[FAMILIES[family]["family"]].from_config(DraftSection(**FAMILIES[family]), view)
    batch = greedy_continuation_batch(model, prompts, [1], NEW + 8)  # aux unused here
    fit_draft(draft, [batch], view, LossSection(), steps=60, lr=5e-3)
    draft.eval()
    drafter, _ = build_drafter(draft, {"family": FAMILIES[family]["family"], **draft.export_config()}, EvalConfig())
    backend = HFBackend(model)
    lengths = []
    for prompt in prompts:
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert_simulation_exact(backend, drafter, prompt, got)
        lengths.append(got.acceptance_length)
    assert max(lengths) > 1.5, lengths  # the draft accepts: equal step lengths are not all 1


def test_ngram_simulated_acceptance_equals_decoded(model):
    backend = HFBackend(model)
    prompt = torch.tensor([5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9])  # repeats: the base's loops give n-gram hits
    drafter = NgramDrafter(k=4, w=4, q=1, strategy="context")
    got = speculative_generate(backend, drafter, prompt, max_new_tokens=120)
    assert got.acceptance_length > 1.0, got.accepted_lengths  # some steps accept n-gram drafts
    assert_simulation_exact(backend, drafter, prompt, got)


def test_replay_refuses_to_leave_the_stored_answer():
    """A tree deeper than the stored tail, or a root that is not the stored token: an error, never a guess."""
    seq = torch.tensor([1, 2, 3, 4])
    rb = ReplayBackend(seq, torch.zeros(4, 2), vocab_size=8)
    rb.reset(8)
    rb.prefill(torch.tensor([1, 2]))
    with pytest.raises(ReplayError, match="root"):
        rb.forward_tree(torch.tensor([7]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ReplayError, match="tail"):
        rb.forward_tree(torch.tensor([3, 4]), torch.tensor([0, 1]), torch.tensor([[1, 0], [1, 1]], dtype=torch.bool))
