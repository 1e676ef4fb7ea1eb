"""ReDrafter at inference: beam search against brute force and its slow twin, the packed dynamic tree against
the unpacked beams, greedy losslessness on a tiny LLaMA (random and briefly trained drafts), and rejection
sampling with ReDrafter trees reproducing the base distribution."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import fit_draft

import eval.engine.acceptance as acc
from eval.engine.backends.backend import Backend
from eval.engine.backends.hf import HFBackend
from eval.engine.beam_search import beam_search, beam_search_reference
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState
from eval.engine.drafters.registry import build_drafter
from models.draft import BaseView, DraftBatch
from models.families.redrafter.drafter import ReDrafterDrafter
from models.families.redrafter.model import ReDrafterDraft
from train.config import LossSection

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, busy CPU


def _toy_draft(vocab: int, d: int = 8, seed: int = 0, rnn: bool = True, std: float = 1.0, **kw) -> ReDrafterDraft:
    """A ReDrafter on a hand-made tiny base view, every weight random (peaked, tie-free distributions)."""
    gen = torch.Generator().manual_seed(seed)
    view = BaseView(torch.randn(vocab, d, generator=gen), torch.randn(vocab, d, generator=gen), d, vocab)
    draft = ReDrafterDraft(3, 2, view, rnn=rnn, **kw)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std / p.shape[-1] ** 0.5)
    return draft.eval()


def _sequence_logprob(draft, h, root, seq) -> float:
    """log q(seq | h, root) by running the recursion along seq (independent of the beam code)."""
    s = torch.zeros(1, draft.hidden_size)
    total, prev = 0.0, root
    for tok in seq:
        s = draft.rnn_step(s, draft.embed_tokens(torch.tensor([prev])))
        total += float(draft.logits(h[None], s).log_softmax(-1)[0, tok])
        prev = tok
    return total


@pytest.mark.parametrize("width", [6, 8])
@pytest.mark.parametrize("rnn", [True, False])
def test_beam_search_equals_exhaustive_search_when_nothing_is_pruned(width, rnn):
    """V=6, L=3 (2 drafts), W >= V: every first token survives step 1, so the W beams must be exactly the
    W most likely 2-token sequences of all V**2, with their cumulative log-probs."""
    vocab, length = 6, 3
    with torch.no_grad():
        for seed in range(3):
            draft = _toy_draft(vocab, seed=seed, rnn=rnn)
            h = torch.randn(8, generator=torch.Generator().manual_seed(10 + seed))
            allseq = list(itertools.product(range(vocab), repeat=length - 1))
            scored = sorted(((_sequence_logprob(draft, h, 2, s), s) for s in allseq), reverse=True)[:width]
            res = beam_search(draft, h, 2, width, length)
            assert res.beams[:, 0].tolist() == [2] * width
            assert [tuple(b) for b in res.beams[:, 1:].tolist()] == [s for _, s in scored]
            torch.testing.assert_close(res.scores, torch.tensor([lp for lp, _ in scored]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(res.token_logprobs.sum(1), res.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rnn", [True, False])
def test_beam_search_matches_slow_twin_with_pruning(rnn):
    """W < V, L=4: pruning happens; the batched search equals the per-beam Python twin. The first step
    expands the root only: its beams are the root's top-W tokens."""
    for seed in range(4):
        draft = _toy_draft(7, seed=seed, rnn=rnn)
        h = torch.randn(8, generator=torch.Generator().manual_seed(seed))
        fast = beam_search(draft, h, 1, 3, 4)
        slow = beam_search_reference(draft, h, 1, 3, 4)
        assert fast.beams.tolist() == slow.beams.tolist()
        torch.testing.assert_close(fast.scores, slow.scores, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast.token_logprobs, slow.token_logprobs, rtol=1e-5, atol=1e-5)
        assert len({tuple(b) for b in fast.beams.tolist()}) == 3  # distinct beams
        assert bool((fast.scores[:-1] >= fast.scores[1:]).all())  # best first
        first = beam_search(draft, h, 1, 3, 2)
        with torch.no_grad():
            s1 = draft.rnn_step(torch.zeros(1, 8), draft.embed_tokens(torch.tensor([1])))
            top = draft.logits(h[None], s1)[0].topk(3).indices
        assert first.beams[:, 1].tolist() == top.tolist()


def test_packed_tree_mask_equals_unpacked_beam_mask():
    """Each beam token's node attends to exactly the nodes holding its own beam prefix (and so sees the
    same tokens at the same positions as in the unpacked [W*L] layout); shared prefixes compress."""
    vocab, width, length = 3, 4, 4  # a tiny vocabulary makes beams share prefixes
    packed = unpacked = 0
    for seed in range(5):
        draft = _toy_draft(vocab, seed=seed)
        drafter = ReDrafterDrafter(draft, width, length)
        h = torch.randn(1, 8, generator=torch.Generator().manual_seed(seed))
        tree = drafter.propose(DecodeState(torch.tensor([1]), 0, h, torch.tensor([1])))
        beams = drafter.last_beams.beams  # [W, L], column 0 = root
        assert drafter.max_nodes == 1 + width * (length - 1)
        assert drafter.total_tokens_unpacked == 1 + width * (length - 1)
        assert drafter.total_tokens_packed == tree.num_nodes
        packed, unpacked = packed + tree.num_nodes, unpacked + drafter.total_tokens_unpacked
        node_of = {}
        for i, j in itertools.product(range(width), range(length)):
            prefix = beams[i, : j + 1].tolist()
            nodes = [n for n in range(tree.num_nodes) if tree.tokens[tree.path_to(n)].tolist() == prefix]
            assert len(nodes) == 1  # one node per distinct prefix
            node_of[i, j] = nodes[0]
            assert int(tree.depths[nodes[0]]) == j  # position = cache_len + j, as unpacked
        for i, j in itertools.product(range(width), range(length)):
            own = {node_of[i, jj] for jj in range(j + 1)}  # the unpacked mask: own beam, causal
            assert set(tree.mask[node_of[i, j]].nonzero().flatten().tolist()) == own
        assert set(node_of.values()) == set(range(tree.num_nodes))  # nothing else in the tree
        assert drafter.compression_ratio == drafter.total_tokens_unpacked / tree.num_nodes
    assert packed < unpacked  # 3 tokens, 4 beams: first drafts must repeat


def test_builder_reads_beam_shape_from_eval_extra_then_export():
    draft = _toy_draft(6, beam_width=5, beam_length=3)
    cfg = SimpleNamespace(extra={}, tree="tree16", tree_choices=None)
    drafter, info = build_drafter(draft, draft.export_config(), cfg)
    assert isinstance(drafter, ReDrafterDrafter)
    assert info == {"beam_width": 5, "beam_length": 3, "max_nodes": 11}
    drafter, info = build_drafter(draft, draft.export_config(), SimpleNamespace(extra={"beam_width": 2,
                                                                                         "beam_length": 4}))
    assert (drafter.beam_width, drafter.beam_length, drafter.max_nodes) == (2, 4, 7)
    with pytest.raises(ValueError, match="beam_width"):
        ReDrafterDrafter(draft, 0, 3)


# ---------------------------------------------------------------------------------------------------
# greedy losslessness on a tiny LLaMA
# ---------------------------------------------------------------------------------------------------

NEW = 24


def _self_distilled_draft(model, prompts) -> ReDrafterDraft:
    """Briefly train a ReDrafter on the base's own greedy continuations of the prompts."""
    view = BaseView.from_model(model)
    torch.manual_seed(0)
    draft = ReDrafterDraft(4, 1, view)
    seqs = []
    for p in prompts:
        with torch.inference_mode():
            g = model.generate(p[None], max_new_tokens=NEW + 8, do_sample=False, eos_token_id=None, pad_token_id=0)
            hidden = model.model(g).last_hidden_state
        mask = torch.ones_like(g)
        mask[:, : p.numel()] = 0
        seqs.append(DraftBatch(hidden.clone(), g, mask))
    fit_draft(draft, seqs, view, LossSection(decay=1.0), steps=40, lr=1e-2)
    return draft.eval()


def test_greedy_redrafter_decoding_is_lossless(model, prompts):
    """Random draft (nothing accepted), trained draft at its trained depth (everything accepted) and beyond
    it (L=7 > K+1: partial acceptance): the output is plain greedy decoding every time."""
    be = HFBackend(model)
    view = BaseView.from_model(model)
    random_draft = ReDrafterDraft(4, 2, view)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in random_draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    trained = _self_distilled_draft(model, prompts)
    lengths, steps = {}, {}
    for name, draft, beam_length in (("random", random_draft, 4), ("trained", trained, 4),
                                     ("beyond", trained, 7)):
        lengths[name], steps[name] = 0.0, []
        for prompt in prompts:
            want = autoregressive_generate(be, prompt, max_new_tokens=NEW, eos_ids=None).tokens
            drafter = ReDrafterDrafter(draft, 3, beam_length)
            res = speculative_generate(be, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
            assert res.tokens == want, name
            assert drafter.steps == res.base_steps and drafter.total_tokens_packed == res.tree_nodes
            lengths[name] += res.acceptance_length / len(prompts)
            steps[name] += res.accepted_lengths
    assert lengths["trained"] > 2.0 and lengths["trained"] > lengths["random"]
    assert any(1 < n < 7 for n in steps["beyond"])  # some paths accepted part of the way


# ---------------------------------------------------------------------------------------------------
# rejection sampling with ReDrafter trees reproduces the base distribution
# ---------------------------------------------------------------------------------------------------

V = 5
BOS = 4  # prompt token: its row forces t1 = 0, so (t2, t3) is the first tree step's output


class BigramBackend(Backend):
    """Toy base: p(next | ..., a) = softmax(table[a]) (a Markov chain); node hidden state = H[token]."""

    def __init__(self, table: torch.Tensor, hidden: torch.Tensor):
        self.table, self.hidden = table, hidden
        self.vocab_size, self.hidden_size = table.shape[0], hidden.shape[1]
        self.device = torch.device("cpu")
        self._len = 0

    def reset(self, max_len: int) -> None:
        self._len = 0

    @property
    def cache_len(self) -> int:
        return self._len

    def prefill(self, input_ids):
        self._len = int(input_ids.numel())
        return self.table[input_ids], self.hidden[input_ids]

    def forward_tree(self, tokens, depths, tree_mask):
        return self.table[tokens], self.hidden[tokens]

    def commit(self, keep) -> None:
        self._len += int(keep.numel())


def _toy_chain():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(V, V, generator=gen) * 1.2
    logits[:, BOS] = -1e9  # BOS is never generated
    logits[BOS] = -1e9
    logits[BOS, 0] = 0.0  # after the prompt: t1 = 0 surely
    return logits, torch.randn(V, 8, generator=gen)


def _tv_of_redrafter_sampling(samples: int, seed: int) -> float:
    logits, hidden = _toy_chain()
    be = BigramBackend(logits, hidden)
    draft = _toy_draft(V, seed=3)
    drafter = ReDrafterDrafter(draft, 3, 3)  # up to 7 nodes, depth 2
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(samples):
        out = speculative_generate(be, drafter, [BOS], max_new_tokens=3, eos_ids=None, acceptance="rejection",
                                   temperature=1.0, generator=gen).tokens
        assert out[0] == 0
        counts[out[1], out[2]] += 1
    p = logits.softmax(-1)
    exact = p[0][:, None] * p  # p(t2, t3 | t1 = 0)
    assert drafter.total_tokens_packed > drafter.steps  # real trees were verified, not just roots
    return 0.5 * float((counts / samples - exact).abs().sum())


# 16 cells: E[TV] of an exact sampler <= 0.5 * sqrt(2 / (pi n)) * sum sqrt(p) <= 0.042 at n = 1500.
TV_BOUND = 0.06


def test_rejection_sampling_with_redrafter_trees_matches_the_base():
    assert _tv_of_redrafter_sampling(1500, seed=0) < TV_BOUND  # measured 0.02-0.03 at n = 2000


def _wrong_accept_one(r, x, q, generator):
    """The classic bug: after a rejection, keep sampling from the target instead of the residual."""
    return acc.uniform(generator, r.device) < float(r[x]), r


def test_the_same_check_catches_a_wrong_residual(monkeypatch):
    monkeypatch.setattr(acc, "_accept_one", _wrong_accept_one)
    assert _tv_of_redrafter_sampling(400, seed=0) > TV_BOUND  # measured ~0.25: a large bias


def test_eval_report_records_the_prefix_sharing_compression(tmp_path):
    from eval.harness.config import load_eval_config
    from eval.harness.runner import evaluate
    from models.base import load_base

    base = load_base("tiny")
    view = BaseView.from_model(base.model)
    torch.manual_seed(0)
    drafter = ReDrafterDrafter(ReDrafterDraft(3, 1, view), 4, 3)
    cfg = load_eval_config(["configs/eval/smoke.yaml"], ["num_prompts=2", "hf_baseline=false"])
    report = evaluate(cfg, base, drafter, "redrafter", tmp_path)
    extra = report["extra"]
    # Timed prompts only (the warm-up generation is excluded), and sharing never adds tokens.
    assert report["base_steps"] <= extra["tokens_verified"] <= extra["tokens_without_prefix_sharing"]
    assert extra["tokens_without_prefix_sharing"] == report["base_steps"] * (1 + 4 * 2)
    assert extra["compression_ratio"] == pytest.approx(extra["tokens_without_prefix_sharing"] /
                                                       extra["tokens_verified"])
    assert extra["compression_ratio"] >= 1.0
    assert extra["tree_nodes_per_step"] == pytest.approx(extra["tokens_verified"] / report["base_steps"])
