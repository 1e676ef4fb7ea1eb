"""Shared fixtures: one smoke training run per test session (tiny random base, ShareGPT fixture)."""

import os

import pytest
import torch
from helpers.decoding import DECODE_NEW_TOKENS

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate
from models.base import load_base
from models.draft import BaseView
from models.tiny import diverse_tiny_llama
from train.config import load_train_config

SMOKE_RECIPE = ["configs/medusa.yaml", "configs/smoke.yaml"]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """(run_dir, base weights before training) of a 16-step smoke run, trained in this process (with a snapshot
    export at step 8)."""
    from train.loop import train

    run_dir = tmp_path_factory.mktemp("runs") / "smoke"
    base_before = {k: v.clone() for k, v in load_base("tiny").model.state_dict().items()}
    cfg = load_train_config(SMOKE_RECIPE, [f"run_dir={run_dir}", "train.max_steps=16", "train.lr=5e-3",
                                           "train.log_every=4", "train.export_every=8"])
    train(cfg)
    return run_dir, base_before


# An in-process run (smoke_run) leaves its 1-rank process-group variables in os.environ; a child process
# must not inherit them (it would try to bind the parent's MASTER_PORT).
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


@pytest.fixture
def clean_env():
    """Environment for `specdraft` subprocesses: this one's, minus process-group variables."""
    return child_env


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored afterwards): tiny tensors gain nothing from threads, and on a busy
    2-core box every threaded op pays a thread-pool handshake (a [3, 5] log_softmax measured 15 ms with 2 threads
    vs 1 us with 1). Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def model():
    """A tiny LLaMA whose greedy continuations vary (decoder losslessness tests; one per test module)."""
    return diverse_tiny_llama(0)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=gen) for n in (7, 12)]


@pytest.fixture(scope="module")
def view(model):
    """The frozen-base view of `model` that the module's drafts read (modules with their own base override it)."""
    return BaseView.from_model(model)


@pytest.fixture(scope="module")
def base4():
    """The four-layer tiny LLaMA (EAGLE-3 reads distinct aux layers of it), for modules whose drafts need one."""
    from helpers.drafts import four_layer_tiny_llama

    return four_layer_tiny_llama()


@pytest.fixture(scope="module")
def view4(base4):
    return BaseView.from_model(base4)


@pytest.fixture(scope="module")
def ar_outputs(model, prompts):
    """Plain greedy decoding of each prompt (DECODE_NEW_TOKENS, hf backend): what speculative decoding must equal."""
    backend = HFBackend(model)
    return [autoregressive_generate(backend, p, max_new_tokens=DECODE_NEW_TOKENS).tokens for p in prompts]


def fit_draft(draft, batches, view, loss_cfg, *, steps: int, lr: float):
    """Adam on draft.loss over fixed batches (the memorisation loop of the family tests).
    Returns (first loss, last DraftLossOutput)."""
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    first = out = None
    for _ in range(steps):
        for batch in batches:
            out = draft.loss(batch, view, loss_cfg)
            first = float(out.loss.detach()) if first is None else first
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    return first, out


def assert_chunked_matches_reference(draft, batch, view, **loss_kw) -> tuple[list, list]:
    """The fused chunked loss and the plain reference (loss.chunked=false) on one batch: same loss, same
    gradients (of the trainable parameters), same per-depth counts. Returns both paths' per-depth stats (DepthStats
    lists) for further checks; the reference ran last, so .grad holds its gradients."""
    from train.config import LossSection

    results = []
    for chunked in (True, False):
        draft.zero_grad()
        out = draft.loss(batch, view, LossSection(chunked=chunked, **loss_kw))
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in draft.parameters() if p.requires_grad],
                        out.per_depth))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for g1, g2 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    assert [s.count for s in results[0][2]] == [s.count for s in results[1][2]]
    return results[0][2], results[1][2]
