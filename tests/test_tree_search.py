"""Data-driven tree search: Medusa rank statistics vs a topk twin, greedy growth vs brute force, predicted
hits == accepted drafts at every real decode step, the searched tree beating tree16, the CLI end to end."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from core.config_loader import ConfigError
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import STATIC_TREES, StaticTree, Tree
from eval.harness.tree_search import (
    acceptance_curve,
    candidate_sizes,
    grow_tree,
    load_tree_search_config,
    node_hit_counts,
    pick_size,
    step_hits,
    tree_acceptance,
    tree_acceptance_reference,
    tree_choices,
)
from models.draft import BaseView
from models.families.medusa.drafter import MedusaDrafter
from models.families.medusa.model import MedusaDraft

VOCAB, DEPTH, NEW = 320, 4, 40


@pytest.fixture(scope="module")
def backend(model):
    return HFBackend(model)


@pytest.fixture(scope="module")
def sequences(backend):
    """[(prompt_len, seq [T], hidden [T, d])]: prompt + the base's greedy continuation, h from one prefill."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (6, 11):
        prompt = torch.randint(3, VOCAB, (n,), generator=gen)
        g = autoregressive_generate(backend, prompt, max_new_tokens=NEW + DEPTH + 1)
        seq = torch.cat([prompt, torch.tensor(g.tokens)])
        backend.reset(seq.numel())
        _, hidden = backend.prefill(seq)
        out.append((n, seq, hidden.clone()))  # clone: a normal tensor, usable by autograd
    return out


@torch.no_grad()
def _topk_twin(drafter: MedusaDrafter, hidden, ids, depth, max_rank):
    """Slow reference: one row at a time, full topk, find the true token's index."""
    ranks = torch.full((ids.numel(), depth), -1, dtype=torch.long)
    for t in range(ids.numel()):
        logits = drafter.heads(hidden[t : t + 1])[:, 0]  # [K, V]
        for k in range(1, depth + 1):
            if t + 1 + k < ids.numel():
                order = logits[k - 1].topk(logits.shape[-1]).indices
                ranks[t, k - 1] = min(int((order == ids[t + 1 + k]).nonzero()), max_rank)
    return ranks


@pytest.fixture(scope="module")
def trained(model, sequences):
    return _memorized_medusa(model, sequences)


@pytest.mark.parametrize("max_rank", [4, VOCAB])
def test_medusa_true_path_ranks_match_the_topk_twin(trained, sequences, max_rank):
    drafter = MedusaDrafter(trained, StaticTree(STATIC_TREES["chain4"]))
    _, seq, hidden = sequences[0]
    fast = drafter.true_path_ranks(hidden, seq, DEPTH, max_rank, chunk_size=7)  # chunks cut mid-sequence
    twin = _topk_twin(drafter, hidden, seq, DEPTH, max_rank)
    assert torch.equal(fast, twin)
    # Row t knows depth k iff t+1+k < T: the last full row is T-2-DEPTH, the last row knows nothing.
    assert (fast[-1] == -1).all() and (fast[-DEPTH - 2] >= 0).all() and fast[-DEPTH - 1, -1] == -1
    assert len(set(fast[fast >= 0].tolist())) > 2  # not a degenerate all-zero table


def test_true_path_ranks_give_tied_tokens_the_best_topk_slot():
    class TiedHeads(torch.nn.Module):
        num_heads = 2

        def forward(self, h):  # [n, d] -> [2, n, V]: small integer logits, so ties everywhere
            return torch.stack([h[:, :12].round(), h[:, 12:24].round()])

        def parameters(self, recurse=True):
            return iter([])

    drafter = MedusaDrafter(TiedHeads(), StaticTree([(0,)]))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randint(0, 4, (30, 24), generator=gen).float()
    ids = torch.randint(0, 12, (30,), generator=gen)
    ranks = drafter.true_path_ranks(hidden, ids, 2, 12)
    for t in range(30 - 3):
        for k in (1, 2):
            logits = drafter.heads(hidden[t : t + 1])[k - 1, 0]
            values = logits.topk(12).values
            # rank = first topk slot holding the true token's logit value
            assert ranks[t, k - 1] == int((values == logits[ids[t + 1 + k]]).nonzero()[0])


def _synthetic_ranks(seed, n=400, depth=3, max_rank=4):
    """Skewed rank table with unknown (-1) tails and clipped (= max_rank) entries."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.15])  # ranks 0..3, and 4 = ">= max_rank"
    ranks = torch.multinomial(probs, n * depth, replacement=True, generator=gen).reshape(n, depth)
    ranks[-5:, 1:] = -1  # positions near the end of a sequence
    return ranks, max_rank


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_growth_predicts_the_brute_force_acceptance_and_is_optimal(seed):
    ranks, max_rank = _synthetic_ranks(seed)
    counts = node_hit_counts(ranks, max_rank)
    grown = grow_tree(counts, ranks.shape[0], max_nodes=12)
    curve = acceptance_curve(grown)
    assert len(grown) == 12 and all(b >= a for a, b in zip(curve, curve[1:]))
    for n in range(1, 13):
        choices = tree_choices(grown, n)
        StaticTree(choices)  # every grown prefix is a valid tree (each node's parent came first)
        assert curve[n] == pytest.approx(tree_acceptance_reference(choices, ranks), abs=1e-12)
        assert tree_acceptance(choices, counts, ranks.shape[0]) == pytest.approx(curve[n], abs=1e-12)
    # Brute force over every valid tree of 1..3 nodes (depth <= 3, ranks < 4): none beats the greedy one.
    nodes = [c for d in (1, 2, 3) for c in itertools.product(range(max_rank), repeat=d)]
    for n in (1, 2, 3):
        best = max(tree_acceptance_reference(sub, ranks) for sub in itertools.combinations(nodes, n)
                   if all(len(c) == 1 or c[:-1] in sub for c in sub))
        assert curve[n] == pytest.approx(best, abs=1e-12)


def test_growth_stops_when_nothing_more_is_ever_hit_and_sizes_are_capped():
    ranks = torch.tensor([[0, 0], [0, 5], [1, -1], [5, 0]])
    grown = grow_tree(node_hit_counts(ranks, 2), 4, max_nodes=64)
    # (0, 5) and (5, ...) are beyond max_rank; the 1-1 tie goes to the shallower node.
    assert [n.choice for n in grown] == [(0,), (1,), (0, 0)]
    assert [n.count for n in grown] == [2, 1, 1]
    assert candidate_sizes([1, 2, 4, 8], len(grown)) == [1, 2, 3]
    assert candidate_sizes([4], 0) == []
    assert pick_size([1, 2, 3], [1.5, 2.0, 2.2], [1.0, 1.0, 1.5]) == 1  # 2.0 tok/s beats 1.5 and 1.47


def _steps_match(choices, ranks, prompt_len, accepted_lengths, seq_len):
    """Walk the decode's step boundaries; at each step the tree's hit count must equal accepted drafts."""
    t, checked = prompt_len - 1, 0
    for acc in accepted_lengths:
        if t + 1 + DEPTH < seq_len:
            assert step_hits(choices, ranks[t].tolist()) == acc - 1, f"step at t={t}"
            checked += 1
        t += acc
    return checked


def _memorized_medusa(model, sequences, steps=4):
    """Heads briefly fitted to the tuning sequences: ranks mostly small but not all zero."""
    torch.manual_seed(0)
    draft = MedusaDraft(num_heads=DEPTH, num_layers=1, base=BaseView.from_model(model))
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for _, seq, hidden in sequences:
            logits = draft(hidden)  # [K, T, V]
            for k in range(1, DEPTH + 1):
                loss = loss + torch.nn.functional.cross_entropy(logits[k - 1, : -1 - k], seq[1 + k :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def test_predicted_hits_equal_accepted_drafts_at_every_real_decode_step(trained, backend, sequences):
    draft = trained
    probe = MedusaDrafter(draft, StaticTree([(0,)]))
    per_seq = []
    for p_len, seq, hidden in sequences:
        ranks = probe.true_path_ranks(hidden, seq, DEPTH, 10)
        per_seq.append((p_len, seq, ranks))
    rows = torch.cat([r[p - 1 : p - 1 + NEW] for p, _, r in per_seq])
    grown = grow_tree(node_hit_counts(rows, 10), rows.shape[0], max_nodes=16)
    assert len({n.choice[0] for n in grown}) > 1  # a real tree, not only the top-1 chain
    for choices, seqs in ((tree_choices(grown, 16), per_seq), ([list(c) for c in STATIC_TREES["chain4"]], per_seq[:1])):
        drafter = MedusaDrafter(draft, StaticTree(choices))
        checked = long_steps = 0
        for p_len, seq, ranks in seqs:
            g = speculative_generate(backend, drafter, seq[:p_len], max_new_tokens=NEW)
            assert g.tokens == seq[p_len : p_len + NEW].tolist()  # lossless: the decode walks our sequence
            checked += _steps_match(choices, ranks, p_len, g.accepted_lengths, seq.numel())
            long_steps += sum(a > 2 for a in g.accepted_lengths)
        assert checked >= 5 and long_steps > 0


class SkewedOracle(Drafter):
    """Knows the base's continuation; at position t the true depth-k token sits at rank table[t, k-1] of
    its candidates (ranks skewed away from Medusa's rank-0 bias), distractors elsewhere. propose and
    true_path_ranks read the same table, so they agree exactly."""

    name = "skewed-oracle"

    def __init__(self, seq: torch.Tensor, table: torch.Tensor, tree: StaticTree):
        self.seq, self.table, self.tree, self.max_nodes = seq, table, tree, tree.num_nodes

    def true_path_ranks(self, hidden, ids, max_depth, max_rank):
        ranks = self.table[: ids.numel(), :max_depth].clamp(max=max_rank).clone()
        for k in range(1, max_depth + 1):
            ranks[max(0, ids.numel() - 1 - k) :, k - 1] = -1
        return ranks

    def propose(self, state: DecodeState) -> Tree:
        t = state.ids.numel() - 1
        assert int(self.seq[t + 1]) == state.root  # greedy: the decode stays on the base's sequence
        k_top = self.tree.topk
        topk = torch.empty(self.tree.depth, k_top, dtype=torch.long)
        for k in range(1, self.tree.depth + 1):
            true = int(self.seq[t + 1 + k]) if t + 1 + k < self.seq.numel() else 0
            distractors = [x for x in range(3, 3 + k_top + 1) if x != true][:k_top]
            r = int(self.table[t, k - 1])
            row = distractors[:r] + [true] + distractors[r:] if r < k_top else distractors
            topk[k - 1] = torch.tensor(row[:k_top])
        return self.tree.fill(state.root, topk)


def test_searched_tree_beats_tree16_in_a_real_decode(backend, sequences):
    p_len, seq, hidden = sequences[1]
    gen = torch.Generator().manual_seed(1)
    # Depth 1: mostly rank 2; deeper: mostly rank 1. tree16 has (2,) but none of its rank-1 children.
    table = torch.stack([torch.multinomial(torch.tensor(w), seq.numel(), replacement=True, generator=gen)
                         for w in ([0.1, 0.1, 0.7, 0.1], [0.1, 0.75, 0.1, 0.05], [0.1, 0.8, 0.05, 0.05],
                                   [0.1, 0.8, 0.05, 0.05])], dim=1)  # [T, 4]
    probe = SkewedOracle(seq, table, StaticTree([(0,)]))
    rows = probe.true_path_ranks(hidden, seq, DEPTH, 10)[p_len - 1 : p_len - 1 + NEW]
    grown = grow_tree(node_hit_counts(rows, 10), rows.shape[0], max_nodes=15)  # 16 nodes with the root
    searched = tree_choices(grown, 15)
    measured = {}
    for name, choices in (("searched", searched), ("tree16", [list(c) for c in STATIC_TREES["tree16"]])):
        tree = StaticTree(choices)
        assert tree.num_nodes == 16
        g = speculative_generate(backend, SkewedOracle(seq, table, tree), seq[:p_len], max_new_tokens=NEW)
        assert g.tokens == seq[p_len : p_len + NEW].tolist()
        ranks = probe.true_path_ranks(hidden, seq, DEPTH, 10)
        assert _steps_match(choices, ranks, p_len, g.accepted_lengths, seq.numel()) > 5
        measured[name] = g.acceptance_length
    assert measured["searched"] > measured["tree16"] + 0.3, measured
    assert [2, 1] in searched and [2, 1] not in STATIC_TREES["tree16"]


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="sizes"):
        load_tree_search_config(["configs/eval/tree_search.yaml"], ["sizes=[]"])
    with pytest.raises(ConfigError, match="timing_prompts"):
        load_tree_search_config([], ["num_prompts=2", "timing_prompts=3"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_tree_search_config([], ["max_node=4"])
    cfg = load_tree_search_config(["configs/eval/tree_search.yaml"])
    assert cfg.dataset == "sharegpt" and cfg.max_nodes == 64 and cfg.exclude_eval.endswith("sharegpt.yaml")


# ---------------------------------------------------------------------------------------------------
# CLI end to end on a tiny Medusa export
# ---------------------------------------------------------------------------------------------------

TINY_ARGS = ["dataset=tests/fixtures/eval_prompts.jsonl", "num_prompts=2", "new_tokens=6", "timing_prompts=1",
             "timing_new_tokens=4", "timing_repeats=1", "warmup_tokens=1", "sizes=[1,2,4]", "max_nodes=4",
             "dtype=fp32", "backend=hf", f"max_rank={VOCAB}"]  # every rank < VOCAB: the growth always finds nodes


@pytest.fixture
def tiny_export(tmp_path):
    from models.base import load_base
    from models.export.specdraft import export_specdraft

    base = load_base("tiny")
    draft = MedusaDraft(num_heads=3, num_layers=1, base=BaseView.from_model(base.model))
    return export_specdraft(draft, tmp_path / "run" / "export", "tiny", base.fingerprint,
                            extra={"train_seconds": 12.5})


def test_cli_stores_the_tree_and_eval_uses_it(tiny_export, capsys):
    from cli.main import main

    assert main(["tree-search", "--draft", str(tiny_export), *TINY_ARGS]) == 0, capsys.readouterr().err
    config = json.loads((tiny_export / "config.json").read_text())
    result = json.loads((tiny_export.parent / "tree_search" / "tree_search.json").read_text())
    assert config["train_seconds"] == 12.5 and config["family"] == "medusa"  # other keys survive the rewrite
    assert result["sizes"] == candidate_sizes([1, 2, 4], len(result["nodes"]))
    assert config["tree"] == result["chosen_tree"] and result["chosen_size"] in result["sizes"]
    assert len(config["tree"]) == config["tree_search"]["chosen_size"]
    StaticTree(config["tree"])
    assert result["positions"] > 0 and len(result["step_time_s"]) == len(result["sizes"])
    assert all(a >= 1.0 for a in result["measured_acceptance"])
    assert result["predicted_acceptance"] == sorted(result["predicted_acceptance"])
    assert (tiny_export.parent / "tree_search" / "tree_search.png").read_bytes()[:4] == b"\x89PNG"
    assert "chosen" in (tiny_export.parent / "tree_search" / "tree_search.md").read_text()

    assert main(["eval", "--draft", str(tiny_export), "--config", "configs/eval/smoke.yaml", "backend=hf",
                 "num_prompts=1", "max_new_tokens=6", "warmup_tokens=0", "ar_baseline=false",
                 "hf_baseline=false", "untuned_probe=false"]) == 0, capsys.readouterr().err
    # untuned_probe=false: the export's default shape, which is now the searched tree (with the probe on, an
    # untuned eval may decode a chain the probe measured faster; tests/test_untuned_probe.py)
    report = json.loads((tiny_export.parent / "eval" / "smoke" / "report.json").read_text())
    assert report["extra"]["tree"] == "export"
    assert report["extra"]["tree_nodes"] == len(config["tree"]) + 1


def test_cli_refuses_a_drafter_without_rank_statistics(tiny_export, capsys, monkeypatch):
    from cli.main import main

    monkeypatch.delattr(MedusaDrafter, "true_path_ranks")
    assert main(["tree-search", "--draft", str(tiny_export), *TINY_ARGS]) == 2
    assert "true_path_ranks" in capsys.readouterr().err
    assert "tree" not in json.loads((tiny_export / "config.json").read_text())


def test_hit_counts_are_nested_along_paths():
    ranks, max_rank = _synthetic_ranks(5)
    counts = node_hit_counts(ranks, max_rank)
    assert all(counts[c[:-1]] >= n for c, n in counts.items() if len(c) > 1)
    reference = Counter({c: sum(step_hits([c], row) for row in ranks.tolist()) for c in counts})
    assert counts == reference
