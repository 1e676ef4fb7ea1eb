"""offset_labels against a brute-force loop and hand-made cases (docs/concepts.md#the-offset-rule)."""

import pytest
import torch

from data.targets import IGNORE_INDEX, offset_labels


def brute_force(input_ids, loss_mask, offset, ignore_index=IGNORE_INDEX):
    batch, length = input_ids.shape
    labels = torch.full((batch, length), ignore_index, dtype=torch.long)
    for b in range(batch):
        for t in range(length):
            window = range(t + 1, t + offset + 1)
            if t + offset < length and all(loss_mask[b, j] != 0 for j in window):
                labels[b, t] = input_ids[b, t + offset]
    return labels


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_masks(seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 50, (3, 23), generator=g)
    # Runs of ones of random lengths, like assistant turns between user turns.
    loss_mask = (torch.rand(3, 23, generator=g) < 0.7).long()
    for offset in range(1, 8):
        expected = brute_force(input_ids, loss_mask, offset)
        assert torch.equal(offset_labels(input_ids, loss_mask, offset), expected), offset


def test_target_crossing_a_user_turn_is_ignored():
    # positions:   0  1  2  3  4  5  6  7  8  9
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 1, 0]])  # assistant 1-3, user 4-5, assistant 6-8
    lab1 = offset_labels(ids, mask, 1)
    assert lab1.tolist() == [[11, 12, 13, -100, -100, 16, 17, 18, -100, -100]]
    lab2 = offset_labels(ids, mask, 2)
    # t=2 would target 14 (user); the windows of t=3 (4, 5) and t=4 (5, 6) contain user tokens.
    assert lab2.tolist() == [[12, 13, -100, -100, -100, 17, 18, -100, -100, -100]]
    lab3 = offset_labels(ids, mask, 3)
    assert lab3.tolist() == [[13, -100, -100, -100, -100, 18, -100, -100, -100, -100]]


def test_offset_beyond_length_and_custom_ignore_index():
    ids = torch.arange(4).unsqueeze(0)
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert offset_labels(ids, mask, 4).tolist() == [[-100] * 4]
    assert offset_labels(ids, mask, 3, ignore_index=-1).tolist() == [[3, -1, -1, -1]]


def test_bad_arguments_raise():
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="offset=0"):
        offset_labels(ids, torch.ones_like(ids), 0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        offset_labels(ids[0], torch.ones_like(ids[0]), 1)
