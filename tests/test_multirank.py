"""Bases larger than one device (docs/howto/large_bases.md), on 2 DeepSpeed CPU ranks with the tiny base:
a ZeRO-3-partitioned frozen base gives the whole base's h with half the parameters per rank and trains to
the same losses; a 2-rank hidden-state cache build equals a 1-rank build byte for byte and resumes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMOKE_RECIPE as RECIPE
from conftest import child_env

from data.dataset import build_datasets
from data.hidden_cache import RankGroup, build_hidden_cache, shard_owner
from models.base import HiddenStates, load_base
from train.config import load_train_config

DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def _launch(script: str, args: list[str], port: int, timeout: int = 900) -> str:
    """`deepspeed --num_gpus 2 script args` (2 CPU ranks, gloo); returns the output, fails with its tail."""
    proc = subprocess.run([str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(port), script, *args],
                          env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.distributed
def test_partitioned_base_gives_the_whole_bases_h_with_half_the_parameters(tmp_path):
    out = tmp_path / "pb.json"
    log = _launch("bench/partitioned_base.py", ["--base", "tiny", "--rows", "3", "--json", str(out)], 29563)
    r = json.loads(out.read_text())
    # Same fp32 values gathered, same kernels (1 thread in both): tolerance 1e-6, measured exactly 0.
    assert r["sum_over_ranks_max_abs_h_diff"] <= 1e-6
    assert r["lm_head_copy_equal"]  # the frozen lm_head the losses read is the whole, true matrix
    # Every parameter is partitioned (persistence threshold 0): each rank holds half, up to the padding of
    # odd-sized tensors to a multiple of the world size.
    assert 0.49 <= r["partition_fraction"] <= 0.52, r
    assert log.count("holds") == 2  # both ranks printed their memory line


@pytest.mark.distributed
def test_partitioned_base_trains_to_the_same_losses_as_the_whole_base(tmp_path):
    """Hydra++ reads everything a draft can take from the base: h, the embeddings (e(x) of the path), the
    lm_head (teacher loss) and a copy of the last decoder layer (the prefix layer, built while it is gathered).
    Dropout off: its masks depend on the rank, the comparison is 1 rank vs 2."""
    from train.loop import train

    recipe = ["configs/hydra_pp.yaml", RECIPE[1]]
    overrides = ["train.max_steps=4", "train.log_every=1", "train.val_batches=2", "train.global_batch_size=4",
                 "train.micro_batch_size=2", "draft.dropout=0.0"]
    whole = tmp_path / "whole"
    train(load_train_config(recipe, [f"run_dir={whole}", *overrides]))  # 1 rank, whole base
    zero3 = tmp_path / "zero3"
    _launch("launch/train_draft.py", ["--config", recipe[0], "--config", recipe[1], f"run_dir={zero3}",
                                      "base.partition=zero3", *overrides], 29564)
    l1, l2 = _losses(whole), _losses(zero3)
    assert len(l1) == len(l2) == 4
    assert l1 == pytest.approx(l2, rel=1e-5)
    # The held-out table (collective forwards on both ranks, written by rank 0) matches too.
    h1 = json.loads((whole / "heldout.json").read_text())["depths"]
    h2 = json.loads((zero3 / "heldout.json").read_text())["depths"]
    for a, b in zip(h1, h2):
        assert a["tokens"] == b["tokens"] and a["top1"] == pytest.approx(b["top1"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_ranks_write_disjoint_round_robin_shards_that_add_up_to_a_one_rank_build(tmp_path):
    """The shard split without a launcher: rank 1 of 2, then rank 0 of 2, in one process (no-op barrier and
    all-reduce; the base forward is not collective here). Rank 0 refuses to finish while shards are missing."""
    base = load_base("tiny")
    ds, _ = build_datasets(base.tokenizer, "tests/fixtures/sharegpt_tiny.json", max_records=None, max_length=128,
                           val_fraction=0.2, seed=0, cache_dir=tmp_path / "data", min_assistant_tokens=1)

    def build(directory, ranks=None):
        return build_hidden_cache(HiddenStates(base.model), ds, directory, pad_id=0, device=torch.device("cpu"),
                                  micro_batch_size=3,
                                  shard_rows=4, cache_dtype="fp32", info={"key": "k"}, ranks=ranks)

    reference = _files(build(tmp_path / "one"))
    n_shards = sum(name.startswith("shard-") for name in reference)
    assert [shard_owner(s, 2) for s in range(4)] == [0, 1, 0, 1]
    with pytest.raises(RuntimeError, match="missing after every rank finished"):
        build(tmp_path / "alone", RankGroup(rank=0, world_size=2))  # rank 1 never ran: odd shards missing
    two = tmp_path / "two"
    (two).mkdir()
    build(two, RankGroup(rank=1, world_size=2))
    odd = sorted(p.name for p in two.glob("shard-*"))
    assert odd == [f"shard-{s:05d}.safetensors" for s in range(1, n_shards, 2)]  # its own shards only
    assert not (two / "manifest.json").exists()  # rank 0 writes it
    build(two, RankGroup(rank=0, world_size=2))
    assert _files(two) == reference


@pytest.mark.distributed
def test_two_rank_cache_build_equals_one_rank_and_a_killed_build_resumes(tmp_path):
    from train.cache_build import build_cache

    # 26 train rows in shards of 4: 7 shards, rank 0 writes 0, 2, 4, 6 and rank 1 writes 1, 3, 5.
    common = ["data.hidden_cache_dtype=fp32", "data.hidden_cache_shard_rows=4", "train.micro_batch_size=3",
              "train.global_batch_size=6"]
    one = build_cache(load_train_config(RECIPE, [f"data.hidden_cache={tmp_path / 'one'}", *common]))
    reference = _files(one)
    assert sum(name.startswith("shard-") for name in reference) == 7

    # 2 ranks, the base partitioned with ZeRO-3 (collective forwards, ranks in lockstep).
    two = tmp_path / "two"
    log = _launch("launch/build_cache.py", ["--config", RECIPE[0], "--config", RECIPE[1],
                                            f"data.hidden_cache={two}", "base.partition=zero3", *common], 29565)
    assert _files(two) == reference  # shards, manifest and key: byte for byte
    assert log.count("hidden-state cache ready") == 1  # reported once, by rank 0

    # A killed build: no manifest, one unfinished shard of each rank (one left as a half-written temp file).
    (two / "manifest.json").unlink()
    (two / "shard-00003.safetensors").unlink()
    (two / "shard-00004.safetensors").rename(two / "shard-00004.tmp")
    kept = {p.name: p.stat().st_mtime_ns for p in two.glob("shard-*.safetensors")}
    log = _launch("launch/build_cache.py", ["--config", RECIPE[0], "--config", RECIPE[1],
                                            f"data.hidden_cache={two}", *common], 29566)
    assert "5 already written, resuming" in log
    assert {p.name: p.stat().st_mtime_ns for p in two.glob("shard-*.safetensors") if p.name in kept} == kept
    assert _files(two) == reference
