"""CTC loss of the CTC drafter: torch DP vs brute force over all alignments, a hand-computed case,
clamping of infeasible labels, prefix reachability, and the chunked fused Linear->CTC vs its twin."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from losses.ctc import (
    collapse_reference,
    ctc_draft_loss,
    ctc_loss_bruteforce,
    ctc_nll_extended,
    extended_labels,
    feasible_label_lengths,
    fused_linear_ctc,
    linear_ctc_reference,
    prefix_hits,
)


def _feasible_reference(label: list[int], frames: int) -> int:
    """Longest prefix that some frame sequence of this length collapses to (found by search)."""
    best = 0
    for length in range(len(label) + 1):
        need = length + sum(label[i] == label[i + 1] for i in range(length - 1))
        if need <= frames:
            best = length
    return best


def test_collapse_reference_hand_cases():
    b = 9
    assert collapse_reference([1, 1, b, 2, 2, 2], b) == [1, 2]
    assert collapse_reference([1, b, 1], b) == [1, 1]  # a blank separates a real repeat
    assert collapse_reference([b, b, b], b) == []
    assert collapse_reference([3, 3, 3], b) == [3]


def test_feasible_lengths_hand_cases_and_random():
    labels = torch.tensor([[5, 5, 5, 5], [1, 2, 3, 4], [1, 1, 2, 2], [7, 7, 1, 2]])
    assert feasible_label_lengths(labels, 6).tolist() == [3, 4, 4, 4]  # "a a a a" needs 7 frames
    assert feasible_label_lengths(labels, 4).tolist() == [2, 4, 3, 3]
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 3, (50, 5), generator=g)
    for m in (1, 3, 5, 7):
        want = [_feasible_reference(row, m) for row in rand.tolist()]
        assert feasible_label_lengths(rand, m).tolist() == want


def test_hand_computed_ctc_probabilities():
    # 2 classes: token 0 and the blank 1. Frame probs [0.7, 0.3] and [0.4, 0.6].
    probs = torch.tensor([[[0.7, 0.3], [0.4, 0.6]]], dtype=torch.float64)
    logits = probs.log()
    # Label [0]: alignments (0,0), (0,_), (_,0) -> 0.28 + 0.42 + 0.12 = 0.82.
    loss, count = ctc_draft_loss(logits, torch.tensor([[0]]), blank=1)
    assert int(count) == 1
    assert float(loss) == pytest.approx(-math.log(0.82), rel=1e-9)
    # Label [0, 0] in 3 frames: the only alignment is (0, _, 0).
    probs3 = torch.tensor([[[0.5, 0.5], [0.1, 0.9], [0.8, 0.2]]], dtype=torch.float64)
    loss3, _ = ctc_draft_loss(probs3.log(), torch.tensor([[0, 0]]), blank=1)
    assert float(loss3) == pytest.approx(-math.log(0.5 * 0.9 * 0.8), rel=1e-9)
    # ... and in 2 frames it is infeasible: clamped to its first token, i.e. label [0] again.
    loss2, _ = ctc_draft_loss(logits, torch.tensor([[0, 0]]), blank=1)
    assert float(loss2) == pytest.approx(-math.log(0.82), rel=1e-9)


@pytest.mark.parametrize("frames,length", [(3, 2), (4, 3), (5, 3)])
def test_torch_ctc_equals_bruteforce_with_grads(frames, length):
    g = torch.Generator().manual_seed(frames * 10 + length)
    classes, blank = 4, 3  # tokens 0..2 (many repeats), blank 3
    n = 6
    logits = torch.randn(n, frames, classes, generator=g, dtype=torch.float64)
    labels = torch.randint(0, blank, (n, length), generator=g)
    labels[0] = 1  # all repeats: infeasible for small M, exercises the clamp
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    fast, count = ctc_draft_loss(a, labels, blank)
    slow = ctc_loss_bruteforce(b, labels, blank)
    assert int(count) == n
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    fast.backward()
    slow.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-7, atol=1e-9)


def test_own_dp_on_gathered_states_equals_torch_ctc_loss():
    """The fused path's DP over the 2N+1 gathered states == torch ctc_loss over all classes (value and
    gradient w.r.t. the logits), clamped labels included."""
    g = torch.Generator().manual_seed(7)
    n, frames, classes, blank = 30, 6, 7, 6
    logits = torch.randn(n, frames, classes, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (n, 4), generator=g)
    labels[0] = 2  # needs 7 frames: clamped to 3 tokens
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ext, skip_ok = extended_labels(labels, blank)
    lp = torch.log_softmax(a, -1).gather(2, ext[:, None, :].expand(n, frames, ext.shape[1]))
    mine = ctc_nll_extended(lp, skip_ok, feasible_label_lengths(labels, frames)).sum()
    ref, _ = ctc_draft_loss(b, labels, blank)
    torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-10)
    mine.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-10)


def test_ctc_rejects_bad_labels():
    logits = torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match="blank"):
        ctc_draft_loss(logits, torch.tensor([[1, 4], [0, 1]]), blank=4)
    with pytest.raises(ValueError, match="-100"):
        ctc_draft_loss(logits, torch.tensor([[1, -100], [0, 1]]), blank=4)
    with pytest.raises(ValueError, match="N <= M"):
        ctc_draft_loss(logits, torch.zeros(2, 5, dtype=torch.long), blank=4)


def test_prefix_hits_equals_enumeration():
    g = torch.Generator().manual_seed(1)
    blank, n, frames, k, length = 3, 40, 4, 2, 3
    cands = torch.randint(0, 4, (n, frames, k), generator=g)
    labels = torch.randint(0, 3, (n, length), generator=g)
    got = prefix_hits(cands, labels, blank)
    for i in range(n):
        collapses = [collapse_reference(seq, blank) for seq in itertools.product(*cands[i].tolist())]
        want = [any(c[:j] == labels[i, :j].tolist() for c in collapses) for j in range(1, length + 1)]
        assert got[i].tolist() == want, i
    # k = 1: "the greedy collapse starts with y_1..y_j".
    greedy = torch.tensor([[[0], [0], [3], [0], [1]]])  # collapses to [0, 0, 1]
    assert prefix_hits(greedy, torch.tensor([[0, 0, 2]]), blank).tolist() == [[True, True, False]]
    assert prefix_hits(greedy, torch.tensor([[1, 0, 1]]), blank).tolist() == [[False, False, False]]


def _linear_inputs(seed=0, n=11, frames=4, d=8, classes=13, length=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, frames, d, generator=g).to(dtype)
    w = (torch.randn(classes, d, generator=g) / d**0.5).to(dtype)
    labels = torch.randint(0, 3, (n, length), generator=g)  # few token ids: repeats happen
    labels[0] = 1  # "a a a" needs 5 frames: clamped with frames=4
    return x, w, labels, classes - 1


def _run(fn, x, w, labels, blank, **kw):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss, stats = fn(x, w, labels, blank=blank, **kw)
    loss.backward()
    return loss.detach(), stats, x.grad, w.grad


@pytest.mark.parametrize("chunk_size,token_weight", [(1, 0.0), (12, 0.3), (1000, 0.0)])
def test_fused_linear_ctc_matches_reference(chunk_size, token_weight):
    x, w, labels, blank = _linear_inputs()
    ref = _run(linear_ctc_reference, x, w, labels, blank, token_weight=token_weight)
    fused = _run(fused_linear_ctc, x, w, labels, blank, chunk_size=chunk_size, token_weight=token_weight)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-4)
    for a, b in zip(fused[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    assert int(ref[1].truncated) > 0  # the random labels include infeasible ones
    torch.testing.assert_close(fused[2], ref[2], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused[3], ref[3], rtol=1e-4, atol=1e-6)


def test_fused_linear_ctc_bf16_and_no_grad():
    x, w, labels, blank = _linear_inputs(seed=2, dtype=torch.bfloat16)
    ref = _run(linear_ctc_reference, x, w, labels, blank)
    fused = _run(fused_linear_ctc, x, w, labels, blank, chunk_size=10)
    assert fused[2].dtype == torch.bfloat16 and fused[3].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], ref[0], rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(fused[2].float(), ref[2].float(), rtol=5e-2, atol=2e-2)
    with torch.no_grad():
        loss, stats = fused_linear_ctc(x.float(), w.float(), labels, blank=blank, chunk_size=4)
    want, _ = linear_ctc_reference(x.float(), w.float(), labels, blank=blank)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-4)
    assert int(stats.count) == x.shape[0]


def test_fused_linear_ctc_loss_is_mean_of_token_term_and_ctc():
    """token_weight only adds token_weight * mean_j CE_j per start, CE_j read from the stats."""
    x, w, labels, blank = _linear_inputs(seed=3)
    base, stats = fused_linear_ctc(x, w, labels, blank=blank, chunk_size=7)
    mixed, _ = fused_linear_ctc(x, w, labels, blank=blank, chunk_size=7, token_weight=0.5)
    torch.testing.assert_close(mixed, base + 0.5 * stats.token_ce.sum() / labels.shape[1])


def test_row_blocks_equal_one_weight_and_skip_frozen_grads():
    """[frozen lm_head [V, d], trainable blank [1, d]] blocks == one [V+1, d] weight; the frozen block gets
    no gradient, the blank row gets the same gradient as the last row of the single weight."""
    x, w, labels, blank = _linear_inputs(seed=4)
    single = _run(fused_linear_ctc, x, w, labels, blank, chunk_size=9, token_weight=0.2)
    for fn in (fused_linear_ctc, linear_ctc_reference):
        xs = x.clone().requires_grad_()
        frozen, blank_row = w[:-1].clone(), w[-1:].clone().requires_grad_()
        loss, _ = fn(xs, [frozen, blank_row], labels, blank=blank, chunk_size=9, token_weight=0.2)
        loss.backward()
        torch.testing.assert_close(loss.detach(), single[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(xs.grad, single[2], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(blank_row.grad, single[3][-1:], rtol=1e-4, atol=1e-6)
        assert frozen.grad is None
