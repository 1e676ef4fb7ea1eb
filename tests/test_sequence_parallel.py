"""Sequence parallelism (train.sequence_parallel, train/sequence_parallel.py: DeepSpeed's Ulysses all-to-all) on 2 CPU
ranks (gloo) with the tiny base in fp32: the group's gradients equal one rank's on the whole sequence, for EAGLE-3's
training-time test, Hydra++'s prefix attention, the CTC drafter's attention module and the block drafts' context keys
(DFlash, DSpark, Domino), with the
hidden states given whole (the cache's path) and with the base's forward itself run sequence-parallel; sequence-
parallel training runs log the losses and gradient norms of 1-rank runs; the config rules."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMOKE_RECIPE, child_env

from core.config_loader import ConfigError, to_dict
from core.net import free_port
from train.checkpoint import resume_config_changes
from train.config import load_train_config

DEEPSPEED = Path(sys.executable).parent / "deepspeed"
RANKS = Path(__file__).parent / "helpers" / "seq_parallel_ranks.py"
EAGLE3 = ["configs/eagle3.yaml", SMOKE_RECIPE[1]]


def _run_ranks(out: Path, args: list[str], world: int = 2) -> dict:
    """`world` processes of tests/helpers/seq_parallel_ranks.py in one gloo group; rank 0's JSON."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(out), *args],
                              env=child_env({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


FAMILIES = ["eagle3", "hydra", "ctc", "dflash", "dspark", "domino"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    """Every family's numbers from one 2-rank launch (the ranks' start-up is most of its time)."""
    out = tmp_path_factory.mktemp("sp") / "sp.json"
    return _run_ranks(out, ["--families", ",".join(FAMILIES), "--steps", "3", "--layers", "2"])


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_over_two_ranks_equal_one_ranks(parity, family):
    """EAGLE-3 with two decoder layers and 3 TTT steps; Hydra++ with 3 heads of 2 blocks and its prefix layer; CTC with
    3 labels over 5 frames and its attention module;
    DFlash / DSpark / Domino with 2 layers, blocks of 4 slots, 5 sampled blocks a conversation (spread over both
    ranks' rows). Two conversations of 13 and 9 tokens (13 is not a multiple of 2: the sequence is padded), the fused
    chunked loss and the reference twin (EAGLE-3 and the block drafts: dense-mask attention)."""
    assert parity["world_size"] == 2
    for key in ("cached_chunked", "online_chunked", "cached_reference", "online_reference"):
        got = parity[family][key]
        # every target scored once over the two ranks' rows
        assert got["counts"] == got["ref_counts"] and min(got["counts"]) > 0, (key, got)
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6), (key, got)
        # fp32, the same kernels on other row blocks: measured 1e-7 (EAGLE-3, gradients up to 0.4) to 4e-7
        # (Hydra++, up to 1.0)
        assert got["max_grad"] > 1e-2, (key, got)  # gradients that could differ
        assert got["max_grad_diff"] <= 1e-6 * got["max_grad"], (key, got)


@pytest.fixture(scope="module")
def parity_smollm2_heads(tmp_path_factory) -> dict:
    """Every family on 3 ranks with SmolLM2-135M's head counts (9 heads, 3 KV heads: 2 does not divide them, 3 does),
    in fp64: this random base's activations are large (losses near 100, gradients up to 17), and fp32 rounding alone
    moved CTC's gradients by up to 2.5e-5 of their size. In fp64 Hydra++ and CTC agree to 1e-15; EAGLE-3's and the
    block drafts' attention compute their scores in fp32 whatever the dtype (models/families/eagle3/ttt.py,
    models/block_draft.py: block_attention), which leaves them at 1.5e-7."""
    out = tmp_path_factory.mktemp("sp3") / "sp.json"
    return _run_ranks(out, ["--families", ",".join(FAMILIES), "--steps", "3", "--layers", "2", "--heads", "9,3",
                            "--dtype", "float64"], world=3)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_over_three_ranks_with_smollm2s_heads_equal_one_ranks(parity_smollm2_heads, family):
    """The same check with a 3-way split of 15 padded rows and of 9 heads (the real base's shape, 16 dims a head)."""
    r = parity_smollm2_heads
    assert r["world_size"] == 3
    for key in ("cached_chunked", "online_chunked", "cached_reference", "online_reference"):
        got = r[family][key]
        assert got["counts"] == got["ref_counts"] and min(got["counts"]) > 0, (key, got)
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6), (key, got)
        assert got["max_grad"] > 1e-2, (key, got)
        assert got["max_grad_diff"] <= 1e-6 * got["max_grad"], (key, got)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if "loss" in r]


@pytest.mark.slow  # whole training runs on 2-4 ranks (~2 min together); the parity tests above stay default
@pytest.mark.distributed
@pytest.mark.parametrize("recipe, cache, ranks, extra", [
    ("configs/eagle3.yaml", "", 2, []), ("configs/hydra_pp.yaml", "auto", 2, []),
    # 8 of a conversation's ~50 anchors: the blocks are sampled, and both ranks of the group must draw the same
    ("configs/dflash.yaml", "", 2, ["draft.dflash.num_anchors=8"]), ("configs/eagle3.yaml", "", 4, [])])
def test_a_sequence_parallel_run_logs_what_one_rank_logs(tmp_path, recipe, cache, ranks, extra):
    """The loop end to end, EAGLE-3 online (the base's forward sharded) and Hydra++ from the hidden-state cache, on
    one group of 2 ranks, and EAGLE-3 on 4 ranks (2 groups of 2, each reading other conversations): DeepSpeed's batch
    and gradient averaging per data-parallel group, the loss's shares, the per-depth counts summed over the ranks, the
    held-out table rank 0 writes; DFlash with sampled blocks (the group seeded alike)."""
    from train.loop import train

    config = [recipe, SMOKE_RECIPE[1]]
    overrides = ["train.max_steps=3", "train.log_every=1", "train.val_batches=1", "train.global_batch_size=4",
                 "train.micro_batch_size=2", "train.num_threads=1", "train.precision=fp32", "base.dtype=fp32",
                 f"data.hidden_cache={cache}", f"data.cache_dir={tmp_path / 'cache'}", "draft.dropout=0.0", *extra]
    one = tmp_path / "one"
    train(load_train_config(config, [f"run_dir={one}", *overrides]))
    two = tmp_path / "two"
    proc = subprocess.run([str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(free_port()),
                           "launch/train_draft.py", "--config", config[0], "--config", config[1], f"run_dir={two}",
                           *overrides, "train.sequence_parallel=2"],
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert f"each conversation split over 2 ranks (DeepSpeed Ulysses), {ranks // 2} group(s)" in log
    m1, m2 = _metrics(one), _metrics(two)
    assert len(m1) == len(m2) == 3
    for a, b in zip(m1, m2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        for k in range(1, 4):
            assert b[f"top1/head{k}"] == a[f"top1/head{k}"]
    if cache:
        assert "training from the hidden-state cache" in log
    h1 = json.loads((one / "heldout.json").read_text())["depths"]
    h2 = json.loads((two / "heldout.json").read_text())["depths"]
    assert [d["tokens"] for d in h1] == [d["tokens"] for d in h2]
    assert [d["loss"] for d in h2] == pytest.approx([d["loss"] for d in h1], rel=1e-5)


def test_the_key_is_off_by_default_and_checked():
    cfg = load_train_config(EAGLE3, [])
    assert cfg.train.sequence_parallel == 1
    assert load_train_config(EAGLE3, ["train.sequence_parallel=2"]).train.sequence_parallel == 2
    with pytest.raises(ConfigError, match="train.sequence_parallel"):
        load_train_config(EAGLE3, ["train.sequence_parallel=0"])
    with pytest.raises(ConfigError, match="does not take a sequence shard"):  # a family without it
        load_train_config(SMOKE_RECIPE, ["train.sequence_parallel=2"])
    with pytest.raises(ConfigError, match="COD sampling"):
        load_train_config(EAGLE3, ["train.sequence_parallel=2", "draft.eagle3.parallel_drafting=true"])
    with pytest.raises(ConfigError, match="ZeRO-3-partitioned base"):
        load_train_config(EAGLE3, ["train.sequence_parallel=2", "base.partition=zero3"])


def test_a_run_resumes_only_with_the_same_sequence_parallelism():
    """Checkpoints made under sequence parallelism are DeepSpeed's per model-parallel rank (its mpu)."""
    before = to_dict(load_train_config(EAGLE3, []))
    after = to_dict(load_train_config(EAGLE3, ["train.sequence_parallel=2"]))
    assert resume_config_changes(before, after) == ["train.sequence_parallel: 1 -> 2"]
    assert resume_config_changes(before, before) == []


def test_the_group_size_must_divide_the_ranks():
    from train.sequence_parallel import SequenceParallel

    with pytest.raises(ValueError, match="must divide the number of ranks"):
        SequenceParallel(2, 0, 3)
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        SequenceParallel(2, 0, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_sequence_parallel_run_resumes_where_it_stopped(tmp_path):
    """Killed (SIGKILL, no chance to save) after step 2 of 3, with a checkpoint every step, then resume=auto: step 3
    logs what an uninterrupted 1-rank run logs (DeepSpeed's checkpoint of a run with the sequence-parallel mpu)."""
    from train.loop import train

    overrides = ["train.max_steps=3", "train.log_every=1", "train.val_batches=1", "train.global_batch_size=4",
                 "train.micro_batch_size=2", "train.num_threads=1", "train.precision=fp32", "base.dtype=fp32",
                 "train.save_every=1", "resume=auto"]
    one = tmp_path / "one"
    train(load_train_config(EAGLE3, [f"run_dir={one}", *overrides]))
    two = tmp_path / "two"
    command = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), "launch/train_draft.py",
               "--config", EAGLE3[0], "--config", EAGLE3[1], f"run_dir={two}", *overrides, "train.sequence_parallel=2"]
    killed = subprocess.run(command, env=child_env({"SPECDRAFT_TEST_KILL_AT_STEP": "2"}), capture_output=True,
                            text=True, timeout=900)
    assert killed.returncode != 0 and (two / "checkpoints" / "step00000002").is_dir()
    assert not (two / "export").exists()
    command[4] = str(free_port())
    resumed = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    last1, last2 = _metrics(one)[-1], _metrics(two)[-1]
    assert last2["step"] == last1["step"] == 3
    assert last2["loss"] == pytest.approx(last1["loss"], rel=1e-6)
    assert last2["grad_norm"] == pytest.approx(last1["grad_norm"], rel=1e-5)
