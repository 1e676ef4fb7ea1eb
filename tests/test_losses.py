"""Analytic checks of the plain losses: weighted hard CE (Medusa) and soft CE to a teacher."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from losses import (
    IGNORE_INDEX,
    cross_entropy_sum,
    head_weights,
    soft_cross_entropy_sum,
    weighted_head_means,
    weighted_multi_head_ce,
)

# ---------------------------------------------------------------------------------------------------
# head_weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads,lambda0,decay", [(1, 1.0, 0.8), (4, 1.0, 0.8), (5, 2.5, 0.5)])
def test_head_weights_follow_lambda0_times_decay_to_the_k_starting_at_k1(num_heads, lambda0, decay):
    weights = head_weights(num_heads, lambda0=lambda0, decay=decay)
    assert len(weights) == num_heads
    # Head k=1 (list index 0) already carries one factor of decay.
    assert weights[0] == pytest.approx(lambda0 * decay)
    for k, w in enumerate(weights, start=1):
        assert w == pytest.approx(lambda0 * decay**k)
    for prev, nxt in zip(weights, weights[1:]):
        assert nxt / prev == pytest.approx(decay)


def test_head_weights_defaults_are_medusa_defaults():
    assert head_weights(3) == pytest.approx(head_weights(3, lambda0=1.0, decay=0.8))


@pytest.mark.parametrize("bad", [dict(num_heads=0), dict(num_heads=2, decay=0.0)])
def test_head_weights_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        head_weights(**bad)


# ---------------------------------------------------------------------------------------------------
# cross_entropy_sum
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [2, 7, 50])
def test_uniform_logits_give_log_vocab_per_token(vocab):
    n = 6
    logits = torch.full((n, vocab), 3.25, requires_grad=True)  # any constant row is uniform
    labels = torch.randint(0, vocab, (n,))
    labels[1] = IGNORE_INDEX
    loss_sum, count = cross_entropy_sum(logits, labels)
    assert count.item() == n - 1
    assert loss_sum.item() == pytest.approx((n - 1) * math.log(vocab), rel=1e-6)
    # d CE / d logits = softmax − onehot = 1/V − onehot on valid rows, 0 on the ignored row.
    loss_sum.backward()
    expected = torch.full((n, vocab), 1.0 / vocab)
    expected[torch.arange(n), labels.clamp(min=0)] -= 1.0
    expected[1] = 0.0
    torch.testing.assert_close(logits.grad, expected)


@pytest.mark.parametrize("margin", [0.5, 4.0, 20.0])
def test_peaked_logits_give_closed_form_value(margin):
    # Target logit = margin, the other V−1 logits = 0: CE = log(e^m + V − 1) − m.
    vocab, n = 11, 3
    labels = torch.tensor([0, 5, 10])
    logits = torch.zeros(n, vocab)
    logits[torch.arange(n), labels] = margin
    loss_sum, _ = cross_entropy_sum(logits, labels)
    expected = n * (math.log(math.exp(margin) + vocab - 1) - margin)
    assert loss_sum.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_cross_entropy_sum_upcasts_bf16_to_fp32():
    logits = torch.randn(5, 9).bfloat16()
    labels = torch.randint(0, 9, (5,))
    loss_sum, _ = cross_entropy_sum(logits, labels)
    assert loss_sum.dtype == torch.float32
    expected = F.cross_entropy(logits.float(), labels, reduction="sum")
    assert loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)


def test_cross_entropy_sum_all_ignored_is_zero_not_nan():
    logits = torch.randn(4, 5, requires_grad=True)
    labels = torch.full((4,), IGNORE_INDEX)
    loss_sum, count = cross_entropy_sum(logits, labels)
    assert count.item() == 0 and loss_sum.item() == 0.0
    loss_sum.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_cross_entropy_sum_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        cross_entropy_sum(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_sum(torch.randn(2, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="int64"):
        cross_entropy_sum(torch.randn(2, 4), torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------
# weighted_multi_head_ce / weighted_head_means
# ---------------------------------------------------------------------------------------------------


def test_weighted_multi_head_ce_is_weighted_sum_of_per_head_means():
    torch.manual_seed(0)
    vocab, weights = 13, head_weights(3)
    logits = [torch.randn(n, vocab, requires_grad=True) for n in (8, 7, 6)]  # N may shrink with depth
    labels = [torch.randint(0, vocab, (lg.shape[0],)) for lg in logits]
    labels[1][:3] = IGNORE_INDEX
    total, per_head = weighted_multi_head_ce(logits, labels, weights)
    expected_means = [F.cross_entropy(lg, lb, ignore_index=IGNORE_INDEX) for lg, lb in zip(logits, labels)]
    for got, want in zip(per_head, expected_means):
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        assert not got.requires_grad  # logging values
    expected_total = sum(w * m for w, m in zip(weights, expected_means))
    assert total.item() == pytest.approx(expected_total.item(), rel=1e-6)
    # The gradient of head k is λ_k × its mean-CE gradient.
    total.backward()
    (g1,) = torch.autograd.grad(expected_means[1], logits[1])
    torch.testing.assert_close(logits[1].grad, weights[1] * g1)


def test_head_without_valid_labels_contributes_zero_not_nan():
    vocab = 9
    logits = [torch.randn(5, vocab, requires_grad=True) for _ in range(2)]
    labels = [torch.randint(0, vocab, (5,)), torch.full((5,), IGNORE_INDEX)]
    total, per_head = weighted_multi_head_ce(logits, labels, [0.8, 0.64])
    assert torch.isfinite(total)
    assert per_head[1].item() == 0.0
    assert total.item() == pytest.approx(0.8 * per_head[0].item(), rel=1e-6)
    total.backward()
    assert torch.equal(logits[1].grad, torch.zeros_like(logits[1]))
    assert torch.isfinite(logits[0].grad).all()


def test_weighted_head_means_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one of each per head"):
        weighted_head_means([torch.tensor(1.0)], [torch.tensor(1), torch.tensor(2)], [0.8])


# ---------------------------------------------------------------------------------------------------
# soft_cross_entropy_sum
# ---------------------------------------------------------------------------------------------------


def _entropy_sum(logits: torch.Tensor) -> float:
    p = logits.double().softmax(-1)
    return float(-(p * p.log()).sum())


def test_soft_ce_with_teacher_equal_to_student_is_the_entropy_and_has_zero_grad():
    torch.manual_seed(1)
    student = torch.randn(6, 10, requires_grad=True)
    mask = torch.ones(6, dtype=torch.bool)
    loss_sum, count = soft_cross_entropy_sum(student, student.detach().clone(), mask)
    assert count.item() == 6
    assert loss_sum.item() == pytest.approx(_entropy_sum(student.detach()), rel=1e-5)
    # d/dz of H(p, softmax(z)) = softmax(z) − p = 0 when the distributions agree: CE is minimal there.
    loss_sum.backward()
    torch.testing.assert_close(student.grad, torch.zeros_like(student), atol=1e-6, rtol=0)


def test_soft_ce_uniform_teacher_and_student_gives_log_vocab():
    vocab = 17
    mask = torch.ones(3, dtype=torch.bool)
    loss_sum, _ = soft_cross_entropy_sum(torch.zeros(3, vocab), torch.ones(3, vocab), mask)
    assert loss_sum.item() == pytest.approx(3 * math.log(vocab), rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_soft_ce_gradient_is_student_minus_teacher_probs_over_t(temperature):
    torch.manual_seed(2)
    student = torch.randn(5, 8, requires_grad=True)
    teacher = torch.randn(5, 8, requires_grad=True)
    mask = torch.tensor([True, False, True, True, False])
    loss_sum, count = soft_cross_entropy_sum(student, teacher, mask, temperature=temperature)
    assert count.item() == 3
    loss_sum.backward()
    q = (student.detach() / temperature).softmax(-1)
    p = (teacher.detach() / temperature).softmax(-1)
    expected = (q - p) / temperature * mask[:, None]
    torch.testing.assert_close(student.grad, expected, atol=1e-6, rtol=1e-5)
    assert teacher.grad is None  # the teacher is frozen


def test_soft_ce_with_onehot_teacher_equals_hard_ce():
    # A (near) one-hot teacher turns soft CE into hard CE on its argmax.
    torch.manual_seed(3)
    student = torch.randn(4, 6)
    labels = torch.tensor([0, 3, 5, 2])
    teacher = torch.full((4, 6), -1e4)
    teacher[torch.arange(4), labels] = 0.0
    soft, _ = soft_cross_entropy_sum(student, teacher, torch.ones(4, dtype=torch.bool))
    hard, _ = cross_entropy_sum(student, labels)
    assert soft.item() == pytest.approx(hard.item(), rel=1e-6)


def test_soft_ce_masked_row_with_nan_does_not_leak():
    student = torch.randn(3, 5)
    student[1] = float("nan")
    mask = torch.tensor([True, False, True])
    loss_sum, _ = soft_cross_entropy_sum(student, torch.randn(3, 5), mask)
    assert torch.isfinite(loss_sum)


def test_soft_ce_rejects_non_bool_mask():
    with pytest.raises(ValueError, match="bool"):
        soft_cross_entropy_sum(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2))
