"""Tokenized datasets: split, filtering, on-disk cache reuse, and collate."""

from pathlib import Path

import pytest
import torch

import data.dataset as dataset_mod
from data.dataset import build_datasets, collate
from data.sharegpt import read_sharegpt
from data.template import render_with_assistant_mask
from models.tiny import tiny_tokenizer

TINY = str(Path(__file__).parent / "fixtures" / "sharegpt_tiny.json")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def build(tok, cache_dir, **overrides):
    kwargs = dict(max_records=None, max_length=128, val_fraction=0.2, seed=0, cache_dir=cache_dir)
    kwargs.update(overrides)
    return build_datasets(tok, TINY, **kwargs)


def test_rows_match_render_and_split_is_disjoint(tok, tmp_path):
    train, val = build(tok, tmp_path)
    conversations, _ = read_sharegpt(TINY)
    assert train.column_names == ["input_ids", "loss_mask"] == val.column_names
    assert len(train) + len(val) == len(conversations)  # every fixture conversation has assistant tokens
    assert len(val) == 7  # ceil(0.2 * 33)
    rendered = {tuple(render_with_assistant_mask(tok, c, max_length=128)[0]): c for c in conversations}
    seen = set()
    for row in list(train) + list(val):
        key = tuple(row["input_ids"])
        assert key in rendered and key not in seen  # a real conversation, in exactly one split
        seen.add(key)
        assert row["loss_mask"] == render_with_assistant_mask(tok, rendered[key], max_length=128)[1]
        assert len(row["input_ids"]) <= 128 and sum(row["loss_mask"]) >= 1


def test_seed_changes_the_split_and_min_assistant_tokens_filters(tok, tmp_path):
    train0, val0 = build(tok, tmp_path, seed=0)
    train1, val1 = build(tok, tmp_path, seed=1)
    assert sorted(map(tuple, val0["input_ids"])) != sorted(map(tuple, val1["input_ids"]))
    # Short assistant replies ("Modern." + end marker = 9 tokens) are dropped with a higher threshold.
    train, val = build(tok, tmp_path, min_assistant_tokens=30)
    rows = list(train) + list(val)
    assert 2 <= len(rows) < len(train0) + len(val0)
    assert all(sum(r["loss_mask"]) >= 30 for r in rows)


def test_second_build_hits_the_cache(tok, tmp_path, monkeypatch):
    calls = {"render": 0}
    real_render = dataset_mod.render_with_assistant_mask

    def counting_render(*args, **kwargs):
        calls["render"] += 1
        return real_render(*args, **kwargs)

    monkeypatch.setattr(dataset_mod, "render_with_assistant_mask", counting_render)
    train_a, val_a = build(tok, tmp_path, max_records=12)
    assert calls["render"] == 12
    assert list(tmp_path.glob("render-*.arrow")) and list(tmp_path.glob("render-*.json"))

    def no_read(*args, **kwargs):
        raise AssertionError("the cache should make reading ShareGPT unnecessary")

    monkeypatch.setattr(dataset_mod, "read_sharegpt", no_read)
    train_b, val_b = build(tok, tmp_path, max_records=12)
    assert calls["render"] == 12  # not rendered again
    assert train_b["input_ids"] == train_a["input_ids"] and val_b["loss_mask"] == val_a["loss_mask"]
    # A different max_length is a different cache entry: it must read and render again.
    monkeypatch.setattr(dataset_mod, "read_sharegpt", read_sharegpt)
    build(tok, tmp_path, max_records=12, max_length=64)
    assert calls["render"] == 24


def test_too_few_rows_and_bad_arguments_raise(tok, tmp_path):
    with pytest.raises(ValueError, match="need at least 2"):
        build(tok, tmp_path, max_records=3, min_assistant_tokens=10_000)
    with pytest.raises(ValueError, match="val_fraction"):
        build(tok, tmp_path, val_fraction=0.0)
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        build(bare, tmp_path)


def test_collate_pads_right_and_masks_padding():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, 3)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask"):
        collate([{"input_ids": [1, 2], "loss_mask": [1]}], pad_id=0)
    with pytest.raises(ValueError, match="empty batch"):
        collate([], pad_id=0)


def test_collate_on_dataset_rows(tok, tmp_path):
    train, _ = build(tok, tmp_path, max_records=8)
    rows = [train[i] for i in range(len(train))]
    batch = collate(rows, pad_id=tok.pad_token_id)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths == [len(r["input_ids"]) for r in rows]
    assert batch["loss_mask"].sum().item() == sum(sum(r["loss_mask"]) for r in rows)
    assert (batch["loss_mask"] <= batch["attention_mask"]).all()
