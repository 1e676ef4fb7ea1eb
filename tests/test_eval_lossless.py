"""Tie-aware losslessness (eval/harness/lossless.py): the classification rules, the decoder's top-2 record, a
constructed rounding tie that must be reported as a tie, and a broken verifier that must be reported as
a real failure whatever the tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import eval.engine.decoder as decoder
import eval.harness.runner as runner
from eval.engine.acceptance import Accepted
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import Tree, chain_tree
from eval.harness.lossless import (
    IDENTICAL,
    MISMATCH,
    TIE,
    classify,
    first_difference,
    format_verdict,
    measure_tolerance,
    verdict,
    verify_widths,
)

# ---------------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------------


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a strict prefix differs where it stops


def test_classify_tie_needs_a_small_gap_and_the_runner_up():
    plain, gaps, second = [5, 6, 7, 8], [3.0, 2.0, 0.01, 4.0], [1, 1, 9, 1]
    assert classify(plain, plain, gaps, second, 0.05).kind == IDENTICAL
    tie = classify([5, 6, 9, 3], plain, gaps, second, 0.05)
    assert (tie.kind, tie.position, tie.gap, tie.spec_token, tie.plain_runner_up) == (TIE, 2, 0.01, 9, 9)
    # Same small gap, but the speculative token is not the base's runner-up: no rounding explains that.
    assert classify([5, 6, 4, 3], plain, gaps, second, 0.05).kind == MISMATCH
    # The runner-up, but the gap is beyond the measured rounding: a real failure.
    assert classify([5, 6, 9, 3], plain, gaps, second, 0.005).kind == MISMATCH
    assert classify([5, 6, 9, 3], plain, gaps, second, 0.0).kind == MISMATCH  # fp32: exact verdict
    assert classify([5, 6, 9, 3], plain, None, None, 0.05).kind == MISMATCH  # no evidence, no tie
    assert classify([5, 6], plain, gaps, second, 0.05).kind == MISMATCH  # stopped early


def test_verdict_counts_and_words():
    divs = [classify([1], [1], [0.0], [2], 0.1), classify([2], [1], [0.05], [2], 0.1),
            classify([3], [1], [0.05], [2], 0.1)]
    v = verdict(divs, 0.1)
    assert (v["lossless_identical"], v["lossless_ties"], v["lossless_mismatches"]) == (1, 1, 1)
    assert v["lossless_up_to_ties"] is False
    report = {"num_prompts": 3, "lossless": False, "lossless_fraction": 1 / 3,
              "extra": {**v, "lossless_checked": 3, "dtype": "bfloat16"}}
    text = format_verdict(report)
    assert text.startswith("NOT lossless: 1/3 prompts identical") and "1 real mismatch" in text
    assert "1 differ only where the base's top-2 logits tie within bfloat16 rounding" in text
    ok = verdict(divs[:2], 0.1)
    assert ok["lossless_up_to_ties"] is True
    assert format_verdict({**report, "extra": {**ok, "lossless_checked": 2, "dtype": "bfloat16"}}).startswith(
        "lossless up to ties")


# ---------------------------------------------------------------------------------------------------
# the decoder's record and the measured tolerance
# ---------------------------------------------------------------------------------------------------


class ChainDrafter(Drafter):
    """Drafts `n` tokens: root+1, root+2, ... (mod V): mostly wrong, so trees have several nodes."""

    name = "chain"

    def __init__(self, n: int, vocab: int):
        self.n, self.vocab, self.max_nodes = n, vocab, n + 1

    def propose(self, state: DecodeState) -> Tree:
        return chain_tree(state.root, [(state.root + k) % self.vocab for k in range(1, self.n + 1)])


def test_ar_records_each_tokens_top2(model, prompts):
    backend = HFBackend(model)
    g = autoregressive_generate(backend, prompts[0], max_new_tokens=10, record_top2=True)
    assert len(g.top2_gaps) == len(g.runner_up) == len(g.tokens) == 10
    # Independent check: one full forward over prompt + output gives every position's logits.
    seq = torch.cat([prompts[0], torch.tensor(g.tokens)])
    with torch.no_grad():
        logits = model(seq[None]).logits[0, prompts[0].numel() - 1: -1]  # rows that chose g.tokens
    v, i = torch.topk(logits.float(), 2, dim=-1)
    assert torch.equal(i[:, 0], torch.tensor(g.tokens))
    assert g.runner_up == i[:, 1].tolist()
    assert g.top2_gaps == pytest.approx((v[:, 0] - v[:, 1]).tolist(), abs=1e-4)
    # Off by default: nothing recorded, nothing computed.
    assert autoregressive_generate(backend, prompts[0], max_new_tokens=4).top2_gaps == []


def test_speculative_record_is_aligned_with_its_tokens(model, prompts):
    backend = HFBackend(model)
    a = autoregressive_generate(backend, prompts[1], max_new_tokens=12, record_top2=True)
    s = speculative_generate(backend, ChainDrafter(3, model.config.vocab_size), prompts[1], max_new_tokens=12,
                             record_top2=True)
    assert s.tokens == a.tokens  # fp32: lossless
    assert len(s.top2_gaps) == len(s.tokens) and s.runner_up == a.runner_up
    assert s.top2_gaps == pytest.approx(a.top2_gaps, abs=1e-4)


class RoundingBackend(HFBackend):
    """A backend whose multi-token forwards 'round differently': the runner-up logit of every row is raised
    by `eps`, so wherever the base's top-2 gap is below eps a tree forward picks the runner-up and a
    one-token forward does not. This is a tie by construction; nothing else changes."""

    def __init__(self, model, eps: float):
        super().__init__(model)
        self.eps = eps

    def forward_tree(self, tokens, depths, tree_mask):
        logits, hidden = super().forward_tree(tokens, depths, tree_mask)
        if tokens.numel() > 1:
            logits = logits.clone()
            second = torch.topk(logits, 2, dim=-1).indices[:, 1]
            logits[torch.arange(logits.shape[0]), second] += self.eps
        return logits, hidden


def test_measured_tolerance_sees_the_rounding(model, prompts):
    exact = measure_tolerance(HFBackend(model), prompts, new_tokens=12, widths=[4])
    assert exact["positions"] == 24 and exact["tolerance"] < 1e-4  # fp32 tree vs one-token: ~1e-6
    rounded = measure_tolerance(RoundingBackend(model, 0.25), prompts, new_tokens=12, widths=[4])
    assert rounded["tolerance"] == pytest.approx(0.5, abs=1e-3)  # 2 x the largest top-8 logit change


class BucketRoundingBackend(RoundingBackend):
    """Rounds differently only at verify widths 3-4 (the bucket a 3-node tree pads to), as a CUDA GEMM can:
    width-1 and width-16 forwards agree bit for bit there, so a tolerance measured at width 16 alone is 0."""

    def forward_tree(self, tokens, depths, tree_mask):
        if tokens.numel() in (3, 4):
            return super().forward_tree(tokens, depths, tree_mask)
        return HFBackend.forward_tree(self, tokens, depths, tree_mask)


def test_verify_widths_cover_every_bucket_up_to_the_largest_tree():
    assert verify_widths(1) == [2] and verify_widths(3) == [2, 4] and verify_widths(4) == [2, 4]
    assert verify_widths(16) == [2, 4, 8, 16] and verify_widths(17) == [2, 4, 8, 16, 32]
    assert verify_widths(63) == [2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="must be >= 2"):
        measure_tolerance(None, [], widths=[1])


def test_the_tolerance_is_measured_at_the_widths_the_decoder_verifies(model, prompts):
    """A rounding difference that only the width-4 verify has: width 16 alone measures 0 (what a CUDA eval
    printed: tolerance 0.0, then 'real mismatches'); the drafter's widths see it, per width."""
    backend = BucketRoundingBackend(model, 0.25)
    assert measure_tolerance(backend, prompts, new_tokens=12, widths=[16])["tolerance"] < 1e-4
    m = measure_tolerance(backend, prompts, new_tokens=12, widths=verify_widths(3))
    assert m["tolerance"] == pytest.approx(0.5, abs=1e-3) and m["widths"] == [2, 4]
    assert m["by_width"]["2"] < 1e-4 and m["by_width"]["4"] == pytest.approx(0.25, abs=1e-3)


def test_ties_at_a_bucket_only_the_tree_uses_are_ties_not_mismatches(monkeypatch, tmp_path):
    """The decoder's 3-node chain verifies at width 3 (bucket 4): the eval must judge its divergences with the
    rounding of that width, not of width 16."""
    report = _eval(monkeypatch, tmp_path, lambda m: BucketRoundingBackend(m, 0.1), lambda v: ChainDrafter(2, v),
                   True)
    ex = report["extra"]
    assert ex["tie_tolerance"] == pytest.approx(0.2, abs=1e-3)
    assert ex["tie_tolerance_measure"]["widths"] == [2, 4]
    assert ex["lossless_ties"] >= 1 and ex["lossless_mismatches"] == 0 and ex["lossless_up_to_ties"] is True


def _eval(monkeypatch, tmp_path, backend_factory, drafter_factory, low_precision: bool, twin: bool = False,
          overrides: tuple = ()):
    """specdraft eval's own path (eval.harness.runner.evaluate) on a tiny base with varied greedy continuations (and
    top-2 gaps from 0 to ~2) with the tiny tokenizer, through a chosen backend. twin: give evaluate an fp32 twin (a
    copy of the base that decodes through the exact HFBackend, whatever backend_factory does to the run's own)."""
    import copy

    from eval.harness.config import load_eval_config
    from models.base import load_base
    from models.tiny import diverse_tiny_llama

    base = dataclasses.replace(load_base("tiny"), model=diverse_tiny_llama(0))
    base32 = dataclasses.replace(base, model=copy.deepcopy(base.model))
    monkeypatch.setattr(runner, "make_backend",
                        lambda kind, model: HFBackend(model) if model is base32.model else backend_factory(model))
    if low_precision:  # judge the fp32 tiny base as a bf16 one would be: measure the tolerance
        monkeypatch.setattr(runner, "is_exact_dtype", lambda dtype: False)
    cfg = load_eval_config(["configs/eval/smoke.yaml"], ["num_prompts=3", "max_new_tokens=24", "hf_baseline=false",
                                                        *overrides])
    vocab = base.model.config.vocab_size
    fp32_twin = (lambda: (base32, drafter_factory(vocab))) if twin else None
    return runner.evaluate(cfg, base, drafter_factory(vocab), "chain", tmp_path, fp32_twin=fp32_twin)


def test_a_rounding_flip_is_numeric_when_the_fp32_redecode_is_identical(monkeypatch, tmp_path):
    """A multi-token forward that flips near ties (one rounding step) while the tolerance sample measured 0.0 (the
    AMX case: three prompts without a flip, a fourth with one): judged by the tolerance alone that is a "real
    mismatch"; the fp32 re-decode is identical to plain decoding, so it is numeric, not a bug."""
    flip = lambda m: RoundingBackend(m, 0.1)  # noqa: E731
    alone = _eval(monkeypatch, tmp_path / "alone", flip, lambda v: ChainDrafter(2, v), True,
                  overrides=("tie_prompts=0",))
    assert alone["extra"]["lossless_mismatches"] >= 1  # the old false alarm
    assert "not re-decoded in fp32" in format_verdict(alone)
    report = _eval(monkeypatch, tmp_path / "judged", flip, lambda v: ChainDrafter(2, v), True, twin=True,
                   overrides=("tie_prompts=0",))
    ex = report["extra"]
    assert report["lossless"] is False  # the exact comparison still says what happened in low precision
    assert ex["lossless_numeric"] >= 1 and ex["lossless_mismatches"] == 0 and ex["lossless_up_to_ties"] is True
    assert ex["lossless_redecoded"] == ex["lossless_differing"] == ex["fp32_redecode"]["prompts"]
    text = format_verdict(report)
    assert text.startswith("lossless up to rounding") and text.endswith("; 0 real mismatches")
    assert "re-decoded in fp32: identical to plain decoding" in text
    samples = (tmp_path / "judged" / "samples.jsonl").read_text()
    assert '"kind": "numeric"' in samples and '"tolerance_kind": "mismatch"' in samples


def test_a_verifier_bug_stays_a_mismatch_in_the_fp32_redecode(monkeypatch, tmp_path):
    """The same judge must still catch a real bug: with the verifier broken, the fp32 re-decode differs too."""
    monkeypatch.setattr(decoder, "greedy_accept", _accept_everything)
    report = _eval(monkeypatch, tmp_path, lambda m: RoundingBackend(m, 0.3), lambda v: ChainDrafter(2, v), True,
                   twin=True)
    ex = report["extra"]
    assert ex["lossless_mismatches"] == report["num_prompts"] and ex["lossless_numeric"] == 0
    assert ex["lossless_redecoded"] == report["num_prompts"]
    text = format_verdict(report)
    assert text.startswith("NOT lossless") and "different in the fp32 re-decode too" in text


def test_no_redecode_in_fp32_runs(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(runner, "redecode_fp32", lambda *a: calls.append(a) or {})
    _eval(monkeypatch, tmp_path, lambda m: RoundingBackend(m, 0.3), lambda v: ChainDrafter(2, v), False, twin=True)
    assert calls == []  # an fp32 run is the exact check itself


def test_no_redecode_where_nothing_differs(monkeypatch, tmp_path):
    report = _eval(monkeypatch, tmp_path, HFBackend, lambda v: ChainDrafter(2, v), True, twin=True)
    assert report["lossless"] is True and "fp32_redecode" not in report["extra"]  # nothing differed: no twin load


def test_a_constructed_tie_is_reported_as_a_tie(monkeypatch, tmp_path):
    report = _eval(monkeypatch, tmp_path, lambda m: RoundingBackend(m, 0.1), lambda v: ChainDrafter(2, v), True)
    ex = report["extra"]
    assert report["lossless"] is False  # the exact check still says what happened
    assert ex["lossless_ties"] >= 1 and ex["lossless_mismatches"] == 0 and ex["lossless_up_to_ties"] is True
    assert ex["tie_tolerance"] == pytest.approx(0.2, abs=1e-3)
    assert format_verdict(report).startswith("lossless up to ties")
    samples = (tmp_path / "samples.jsonl").read_text()
    assert '"kind": "tie"' in samples


def _accept_everything(tree: Tree, logits: torch.Tensor) -> Accepted:
    """A broken verifier: takes the drafter's first path whatever the base says."""
    path = tree.paths[0][tree.paths[0] >= 0]
    return Accepted(path, int(logits[path[-1]].argmax()))


@pytest.mark.parametrize("low_precision", [False, True])
def test_a_broken_verifier_is_a_real_failure(monkeypatch, tmp_path, low_precision):
    monkeypatch.setattr(decoder, "greedy_accept", _accept_everything)
    # Even with a generous rounding tolerance (eps=0.3 -> 0.6) the drafter's tokens are not the runner-up.
    report = _eval(monkeypatch, tmp_path, lambda m: RoundingBackend(m, 0.3 if low_precision else 0.0),
                   lambda v: ChainDrafter(2, v), low_precision)
    ex = report["extra"]
    assert report["lossless"] is False and ex["lossless_up_to_ties"] is False
    assert ex["lossless_mismatches"] == report["num_prompts"]
    assert format_verdict(report).startswith("NOT lossless")


def test_fp32_verdict_is_exact(monkeypatch, tmp_path):
    report = _eval(monkeypatch, tmp_path, HFBackend, lambda v: ChainDrafter(2, v), False)
    ex = report["extra"]
    assert ex["tie_tolerance"] == 0.0 and report["lossless"] is True and ex["lossless_up_to_ties"] is True
    assert ex["lossless_identical"] == report["num_prompts"]
    assert format_verdict(report).startswith("lossless (exact): 3/3 prompts identical")


def test_top2_runner_up_is_never_the_committed_token_at_an_exact_tie():
    """bf16 logits tie exactly; whatever order topk lists tied tokens in, the runner-up is the other one.
    On a SmolLM2-sized row CPU topk lists this pair as [12947, 6910] while argmax commits 6910 (the demo run
    where topk's second index named the committed token and a tie was reported as a mismatch)."""
    from eval.engine.top2 import top2

    row = torch.full((49152,), -5.0)
    row[[6910, 12947]] = 3.0  # exact tie; argmax commits the first index, 6910
    gap, runner = top2(row)
    assert int(row.argmax()) == 6910 and gap == 0.0 and runner == 12947
    row[12947] = 2.5  # clear top-1 6910, runner-up 12947
    assert top2(row) == (0.5, 12947)


def test_decoder_records_the_runner_up_other_than_the_committed_token():
    """The decoder's own record (what the verdict reads): the first fix changed only eval.harness.lossless.top2, and a
    second demo run again reported an exact bf16 tie (gap 0.0, runner-up = the committed 6910) as a mismatch."""
    from eval.engine.decoder import GenerationResult, _record_top2

    rows = torch.full((3, 49152), -5.0)
    rows[0, [6910, 12947]] = 3.0  # exact tie: argmax commits 6910
    rows[1, 7] = 1.0  # clear top-1 7, runner-up 9
    rows[1, 9] = 0.25
    rows[2, [4, 5, 6]] = 2.0  # three-way tie: commits 4; runner-up 5 or 6, never 4
    r = GenerationResult(tokens=[], accepted_lengths=[])
    _record_top2(r, rows)
    assert [int(t) for t in rows.argmax(-1)] == [6910, 7, 4]
    assert r.runner_up[0] == 12947 and r.runner_up[1] == 9 and r.runner_up[2] in (5, 6)
    assert r.top2_gaps == [0.0, 0.75, 0.0]
    # near ties: every other token within NEAR_TIE_BAND of the top-1, never the committed one
    assert r.near_ties[0] == [[12947, 0.0]] and r.near_ties[1] == [[9, 0.75]]
    assert sorted(r.near_ties[2]) == [[5, 0.0], [6, 0.0]]


def test_near_ties_keep_only_tokens_within_the_band():
    from eval.engine.top2 import NEAR_TIE_BAND, near_ties_rows

    row = torch.full((1, 100), -5.0)
    row[0, 3], row[0, 8], row[0, 11] = 4.0, 4.0 - NEAR_TIE_BAND / 2, 4.0 - 2 * NEAR_TIE_BAND
    assert near_ties_rows(row) == [[[8, NEAR_TIE_BAND / 2]]]  # 11 is too far below, 3 is the committed token


def test_a_three_way_tie_is_a_tie_only_within_the_tolerance():
    """bf16 can tie three tokens exactly; the verification forward may commit the third (a real SmolLM2 run:
    gap 0.0, spec token neither the argmax nor the runner-up)."""
    plain, gaps, second = [5, 6, 7], [3.0, 0.0, 4.0], [1, 9, 1]
    near = [[], [[9, 0.0], [11, 0.0], [12, 0.6]], []]
    tie = classify([5, 11, 3], plain, gaps, second, 0.05, near)
    assert (tie.kind, tie.spec_gap) == (TIE, 0.0)
    assert classify([5, 12, 3], plain, gaps, second, 0.05, near).kind == MISMATCH  # 0.6 below the top: too far
    assert classify([5, 12, 3], plain, gaps, second, 0.75, near).kind == TIE
    assert classify([5, 13, 3], plain, gaps, second, 0.75, near).kind == MISMATCH  # not near the top at all
    assert classify([5, 11, 3], plain, gaps, second, 0.05).kind == MISMATCH  # no near-tie record: no evidence
