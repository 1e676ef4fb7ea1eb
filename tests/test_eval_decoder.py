"""The decode loop: greedy losslessness against transformers `generate` and the AR loop for random static
and dynamic trees, exact acceptance lengths for oracle / always-wrong drafters, EOS and length stops."""

from __future__ import annotations

import pytest
import torch
from helpers.oracles import NoisyPathsOracle
from torch import nn

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import STATIC_TREES, StaticTree, Tree, chain_tree
from models.families.medusa.drafter import MedusaDrafter

VOCAB = 320
NEW = 24



@pytest.fixture(scope="module")
def references(model, prompts):
    """Greedy continuations from transformers generate, long enough for oracles to look ahead."""
    out = []
    for p in prompts:
        with torch.inference_mode():
            g = model.generate(p[None], max_new_tokens=NEW + 8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        out.append(g[0].tolist())  # prompt + continuation
    return out


def _hf_greedy(model, prompt, max_new, eos):
    with torch.inference_mode():
        g = model.generate(prompt[None], max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    return g[0, prompt.numel():].tolist()


class StaticNoisyOracle(Drafter):
    """Static tree whose per-depth top-k holds the true continuation at a random rank with probability
    `hit`, random tokens elsewhere: every acceptance length and branch gets exercised."""

    def __init__(self, tree: StaticTree, reference: list[int], hit: float, seed: int, on_track: bool = True):
        self.tree, self.ref, self.hit, self.on_track = tree, reference, hit, on_track
        self.gen = torch.Generator().manual_seed(seed)
        self.max_nodes = tree.num_nodes

    def propose(self, state: DecodeState) -> Tree:
        n = state.ids.numel()
        if self.on_track:  # greedy runs: the loop has stayed on the reference sequence so far
            assert self.ref[n] == state.root
        d, k = self.tree.depth, self.tree.topk
        topk = torch.stack([torch.randperm(VOCAB, generator=self.gen)[:k] for _ in range(d)])
        for depth in range(1, d + 1):
            true = self.ref[n + depth] if n + depth < len(self.ref) else 0
            if float(torch.rand((), generator=self.gen)) < self.hit:
                row = topk[depth - 1][topk[depth - 1] != true][: k - 1].tolist()
                rank = int(torch.randint(0, k, (1,), generator=self.gen))
                topk[depth - 1] = torch.tensor(row[:rank] + [true] + row[rank:])
        return self.tree.fill(state.root, topk)


class ChainOracle(Drafter):
    """Chain of the true next `depth` tokens (shift=0) or of always-wrong tokens (shift != 0)."""

    def __init__(self, reference: list[int], depth: int, shift: int = 0):
        self.ref, self.depth, self.shift = reference, depth, shift
        self.max_nodes = depth + 1

    def propose(self, state: DecodeState) -> Tree:
        n = state.ids.numel()
        drafts = [(self.ref[n + j] + self.shift) % VOCAB for j in range(1, self.depth + 1)]
        return chain_tree(state.root, drafts)


@pytest.mark.parametrize("tree_name", sorted(STATIC_TREES))
def test_greedy_lossless_static_trees(model, prompts, references, tree_name):
    be = HFBackend(model)
    for i, (prompt, ref) in enumerate(zip(prompts, references)):
        want = ref[prompt.numel() : prompt.numel() + NEW]
        drafter = StaticNoisyOracle(StaticTree(STATIC_TREES[tree_name]), ref, hit=0.7, seed=i)
        res = speculative_generate(be, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
        assert res.tokens == want
        assert res.acceptance_length > 1.0  # drafts were really accepted, not a trivial pass


def test_greedy_lossless_dynamic_trees_and_ar_loop(model, prompts, references):
    be = HFBackend(model)
    for i, (prompt, ref) in enumerate(zip(prompts, references)):
        want = ref[prompt.numel() : prompt.numel() + NEW]
        ar = autoregressive_generate(be, prompt, max_new_tokens=NEW, eos_ids=None)
        assert ar.tokens == want and ar.acceptance_length == 1.0 and ar.base_steps == NEW - 1
        res = speculative_generate(be, NoisyPathsOracle(ref, num_paths=5, length=4, seed=i, ragged=True), prompt,
                                   max_new_tokens=NEW, eos_ids=None)
        assert res.tokens == want
        assert res.acceptance_length > 1.0


def test_greedy_lossless_with_eos_against_generate(model, prompts, references):
    """EOS inside an accepted path: the output stops right after it, exactly like generate."""
    be = HFBackend(model)
    prompt, ref = prompts[0], references[0]
    cont = ref[prompt.numel() :]
    eos = next(t for j, t in enumerate(cont) if j >= 5 and t not in cont[:j])  # first occurs at j >= 5
    stop = cont.index(eos)
    want = _hf_greedy(model, prompt, NEW, eos)
    assert want == cont[: stop + 1]
    res = speculative_generate(be, ChainOracle(ref, depth=4), prompt, max_new_tokens=NEW, eos_ids=[eos])
    assert res.tokens == want and res.stop_reason == "eos"
    ar = autoregressive_generate(be, prompt, max_new_tokens=NEW, eos_ids=[eos])
    assert ar.tokens == want


def test_oracle_and_always_wrong_acceptance_lengths(model, prompts, references):
    be = HFBackend(model)
    prompt, ref = prompts[1], references[1]
    want = ref[prompt.numel() : prompt.numel() + NEW]
    oracle = speculative_generate(be, ChainOracle(ref, depth=4), prompt, max_new_tokens=NEW, eos_ids=None)
    assert oracle.tokens == want
    assert oracle.acceptance_length == 5.0  # depth + 1 every step
    assert oracle.base_steps == -(-(NEW - 1) // 5)  # ceil: the prefill gave the first token
    assert oracle.accept_rate_per_position == [1.0] * 4
    wrong = speculative_generate(be, ChainOracle(ref, depth=4, shift=1), prompt, max_new_tokens=NEW,
                                 eos_ids=None)
    assert wrong.tokens == want
    assert wrong.acceptance_length == 1.0 and wrong.accept_rate_per_position == [0.0] * 4


def test_max_new_tokens_truncates_inside_a_step(model, prompts, references):
    be = HFBackend(model)
    prompt, ref = prompts[0], references[0]
    for max_new in (1, 2, 7):
        res = speculative_generate(be, ChainOracle(ref, depth=4), prompt, max_new_tokens=max_new,
                                   eos_ids=None)
        assert res.tokens == ref[prompt.numel() : prompt.numel() + max_new]
        assert res.stop_reason == "length" and res.base_steps == -(-(max_new - 1) // 5)


def test_typical_at_t0_and_rejection_at_t0_equal_greedy(model, prompts, references):
    be = HFBackend(model)
    prompt, ref = prompts[0], references[0]
    want = ref[prompt.numel() : prompt.numel() + NEW]
    for rule in ("typical", "rejection"):
        drafter = StaticNoisyOracle(StaticTree(STATIC_TREES["tree16"]), ref, hit=0.7, seed=3)
        res = speculative_generate(be, drafter, prompt, max_new_tokens=NEW, eos_ids=None, acceptance=rule)
        assert res.tokens == want, rule


def test_sampling_is_seeded_and_reproducible(model, prompts, references):
    be = HFBackend(model)
    prompt, ref = prompts[0], references[0]
    runs = []
    for _ in range(2):
        # Sampling leaves the greedy reference, so the "oracle" just drafts plausible-looking tokens.
        drafter = StaticNoisyOracle(StaticTree(STATIC_TREES["tree16"]), ref, hit=0.7, seed=3, on_track=False)
        res = speculative_generate(be, drafter, prompt, max_new_tokens=NEW, eos_ids=None,
                                   acceptance="rejection", temperature=0.8, top_p=0.9,
                                   generator=torch.Generator().manual_seed(7))
        runs.append(res.tokens)
        assert len(res.tokens) == NEW and all(0 <= t < VOCAB for t in res.tokens)
    assert runs[0] == runs[1]
    ar1 = autoregressive_generate(be, prompt, max_new_tokens=NEW, temperature=0.8,
                                  generator=torch.Generator().manual_seed(7))
    ar2 = autoregressive_generate(be, prompt, max_new_tokens=NEW, temperature=0.8,
                                  generator=torch.Generator().manual_seed(8))
    assert ar1.tokens != ar2.tokens  # temperature really samples


class _FakeMedusaHeads(nn.Module):
    """forward(hidden [..., d]) -> [K, ..., V], like models.families.medusa.model.MedusaDraft."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.num_heads = k
        self.heads = nn.ModuleList(nn.Linear(d, VOCAB) for _ in range(k))

    def forward(self, hidden):
        return torch.stack([h(hidden) for h in self.heads])


def test_medusa_drafter_is_lossless(model, prompts, references):
    torch.manual_seed(0)
    heads = _FakeMedusaHeads(model.config.hidden_size, 4)
    drafter = MedusaDrafter(heads, StaticTree(STATIC_TREES["medusa63"]))
    be = HFBackend(model)
    prompt, ref = prompts[1], references[1]
    res = speculative_generate(be, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
    assert res.tokens == ref[prompt.numel() : prompt.numel() + NEW]
    with pytest.raises(ValueError, match="heads"):
        MedusaDrafter(_FakeMedusaHeads(model.config.hidden_size, 2), StaticTree(STATIC_TREES["chain4"]))


def test_decoder_rejects_bad_trees_and_settings(model, prompts):
    be = HFBackend(model)

    class WrongRoot(Drafter):
        max_nodes = 2

        def propose(self, state):
            return chain_tree(state.root + 1, [3])

    with pytest.raises(ValueError, match="root"):
        speculative_generate(be, WrongRoot(), prompts[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature=0"):
        speculative_generate(be, WrongRoot(), prompts[0], max_new_tokens=4, temperature=0.5)
