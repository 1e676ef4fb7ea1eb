"""End-to-end training on the smoke config (tiny random LLaMA, ShareGPT fixture), in this process and
in subprocesses (crash + resume, SIGTERM, 2 DeepSpeed CPU ranks)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SMOKE_RECIPE as RECIPE
from conftest import child_env

from models.base import load_base
from models.draft import BaseView
from models.export.schema import check_export_config
from models.export.specdraft import load_draft, read_tensors


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _cli(args: list[str], env_extra: dict | None = None, **kw) -> subprocess.Popen:
    env = child_env(env_extra)
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_smoke_run_writes_the_contract_files(smoke_run):
    run_dir, _ = smoke_run
    for rel in ("config.yaml", "metrics.jsonl", "checkpoints/latest", "export/model.safetensors",
                "export/config.json", "heldout.json"):
        assert (run_dir / rel).exists(), rel
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == [4, 8, 12, 16]
    for key in ("loss", "loss/head1", "top1/head1", "top5/head4", "lr", "grad_norm", "tokens_per_s"):
        assert key in rows[0], key
    # fp32 + ZeRO-0: DeepSpeed drops the norm while clipping; the loop computes it (never NaN / null here).
    assert all(isinstance(r["grad_norm"], float) and 0 < r["grad_norm"] < 1e6 for r in rows if "loss" in r)


def test_loss_decreases(smoke_run):
    rows = [r for r in _metrics(smoke_run[0]) if "loss" in r]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]


def test_base_weights_unchanged_by_training(smoke_run):
    _, before = smoke_run
    after = load_base("tiny").model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


def test_export_holds_only_draft_tensors_and_round_trips(smoke_run):
    run_dir, _ = smoke_run
    export = run_dir / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["family"] == "medusa" and config["base_model"] == "tiny" and config["base_fingerprint"]
    tensors = read_tensors(export / "model.safetensors")
    assert all(k.startswith("heads.") for k in tensors)  # no base weights
    base = load_base("tiny")
    draft, _ = load_draft(export, BaseView.from_model(base.model), base.fingerprint)
    for k, v in draft.state_dict().items():
        assert torch.equal(v, tensors[k])
    with pytest.raises(ValueError, match=r"fingerprint .*base_path=tiny for eval"):
        load_draft(export, BaseView.from_model(base.model), "not-this-base")


def test_trainable_params_are_recorded_not_read_off_the_weights_file(smoke_run, tmp_path):
    """The export records what was trained; the weights file can hold more (a frozen LM head kept for serving),
    so its tensor count is only the fallback for exports that predate the record."""
    from safetensors.torch import save_file

    from eval.harness.results_doc import trainable_params

    run_dir, _ = smoke_run
    config = json.loads((run_dir / "export" / "config.json").read_text())
    base = load_base("tiny")
    draft, _ = load_draft(run_dir / "export", BaseView.from_model(base.model), base.fingerprint)
    assert config["trainable_params"] == sum(p.numel() for p in draft.parameters()) > 0
    save_file({"w": torch.zeros(3, 5), "lm_head.weight": torch.zeros(7, 2)}, str(tmp_path / "model.safetensors"))
    assert trainable_params(tmp_path, {"trainable_params": 15}) == 15
    assert trainable_params(tmp_path, {}) == 29  # an older export: every tensor counts


def test_export_every_leaves_a_loadable_snapshot_with_its_heldout_table(smoke_run):
    run_dir, _ = smoke_run
    snaps = sorted(p.name for p in (run_dir / "exports").iterdir())
    assert snaps == ["step00000008"]  # step 16 is the final export, not a snapshot; no .tmp left behind
    snap = run_dir / "exports" / "step00000008"
    config = json.loads((snap / "config.json").read_text())
    assert config["trained_steps"] == 8 and config["train_data"]["epoch_tokens"] > 0
    heldout = json.loads((snap / "heldout.json").read_text())
    assert 0.0 <= heldout["summary"]["top1/head1"] <= 1.0
    base = load_base("tiny")
    draft, _ = load_draft(snap, BaseView.from_model(base.model), base.fingerprint)
    mid = read_tensors(snap / "model.safetensors")
    final = read_tensors(run_dir / "export" / "model.safetensors")
    assert mid.keys() == final.keys()
    # the snapshot is the draft at step 8, not a copy of the end: eight more steps moved it
    assert any(not torch.equal(mid[k], final[k]) for k in mid)
    for k, v in draft.state_dict().items():
        assert torch.equal(v, mid[k])


def test_compare_describes_a_snapshot_from_its_own_heldout_table(smoke_run):
    from eval.harness.results_doc import describe_training

    run_dir, _ = smoke_run
    snap = json.loads((run_dir / "exports" / "step00000008" / "heldout.json").read_text())
    final = json.loads((run_dir / "heldout.json").read_text())
    mid, end = describe_training(run_dir / "exports" / "step00000008"), describe_training(run_dir / "export")
    assert (mid["run"], mid["steps"], end["run"], end["steps"]) == ("smoke/step00000008", 8, "smoke", 16)
    assert mid["heldout_top1"] == [d["top1"] for d in snap["depths"]]
    assert end["heldout_top1"] == [d["top1"] for d in final["depths"]]


def test_medusa_format_export(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    proc = _cli(["export", "--run", str(run_dir), "--format", "medusa", "--out", str(tmp_path / "m")])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 4 and cfg["medusa_num_layers"] == 1 and cfg["base_model_name_or_path"] == "tiny"
    tensors = read_tensors(tmp_path / "m" / "medusa_lm_head.safetensors")
    ours = read_tensors(run_dir / "export" / "model.safetensors")
    assert set(tensors) == {k.removeprefix("heads.") for k in ours}
    assert torch.equal(tensors["2.1.weight"], ours["heads.2.1.weight"])  # head 3's LM head
    assert "0.0.linear.weight" in tensors


def test_crash_then_resume_matches_uninterrupted(tmp_path):
    common = RECIPE + ["train.max_steps=6", "train.save_every=2", "train.val_batches=0"]
    full = tmp_path / "full"
    crashed = tmp_path / "crashed"
    args = lambda d, extra=(): ["train", "--config", RECIPE[0], "--config", RECIPE[1], *common[2:],  # noqa: E731
                                f"run_dir={d}", *extra]
    p = _cli(args(full))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    # Crash hard after step 5 (checkpoints exist for steps 2 and 4 only).
    p = _cli(args(crashed), {"SPECDRAFT_TEST_KILL_AT_STEP": "5"})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == -signal.SIGKILL, out
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "step00000004"
    assert not (crashed / "export").exists()
    p = _cli(args(crashed, ["resume=auto"]))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "at step 4" in out
    a = read_tensors(full / "export" / "model.safetensors")
    b = read_tensors(crashed / "export" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # metrics.jsonl has each step once: the replayed steps replaced the crashed run's lines.
    steps = [r["step"] for r in _metrics(crashed)]
    assert steps == sorted(set(steps))
    # The run's CPU seconds carry over the kill: the resumed start adds its own to the checkpoint's, so the
    # crashed-and-resumed run counts at least what its resumed start alone spent on steps 5-6.
    cpu = [json.loads((d / "export" / "config.json").read_text())["train_cpu_seconds"] for d in (full, crashed)]
    state = torch.load(next((crashed / "checkpoints" / "step00000004").rglob("*model_states.pt")), weights_only=False)
    assert state["train_cpu_seconds"] > 0 and cpu[1] > state["train_cpu_seconds"] and cpu[0] > 0
    # and the export with the key loads where exports are read (the schema knows it)
    check_export_config(json.loads((crashed / "export" / "config.json").read_text()), crashed / "export")


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    run_dir = tmp_path / "term"
    p = _cli(["train", "--config", RECIPE[0], "--config", RECIPE[1], f"run_dir={run_dir}",
              "train.max_steps=100000", "train.log_every=1"])
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert p.poll() is None and time.time() < deadline, p.stdout.read() if p.poll() is not None else "timeout"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, out  # interrupted, not finished: a scheduler must not think it is done
    assert "SIGTERM" in out and "resume=auto" in out
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest).is_dir()


@pytest.mark.distributed
def test_two_cpu_ranks_match_one_rank(tmp_path):
    overrides = ["train.max_steps=4", "train.log_every=1", "train.val_batches=0", "train.global_batch_size=4",
                 "train.micro_batch_size=2"]
    one = tmp_path / "one"
    p = _cli(["train", "--config", RECIPE[0], "--config", RECIPE[1], f"run_dir={one}", *overrides])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    two = tmp_path / "two"
    deepspeed = Path(sys.executable).parent / "deepspeed"
    env = child_env()
    proc = subprocess.run([str(deepspeed), "--num_gpus", "2", "--master_port", "29561", "launch/train_draft.py",
                           "--config", RECIPE[0], "--config", RECIPE[1], f"run_dir={two}", *overrides],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    l1 = [r["loss"] for r in _metrics(one)]
    l2 = [r["loss"] for r in _metrics(two)]
    assert len(l1) == len(l2) == 4
    for a, b in zip(l1, l2):
        assert a == pytest.approx(b, rel=1e-4)


def test_max_tokens_sets_the_steps_at_the_mean_conversation_length():
    from types import SimpleNamespace

    from train.loop import _steps_for

    t = SimpleNamespace(max_tokens=0, epochs=2.5, global_batch_size=8)
    assert _steps_for(t, epoch_tokens=40_000, rows=100, steps_per_epoch=12) == 30  # epochs decide
    t.max_tokens = 64_000  # 400 tokens a conversation, 8 a step: 3,200 tokens a step -> 20 steps
    assert _steps_for(t, epoch_tokens=40_000, rows=100, steps_per_epoch=12) == 20
    t.max_tokens = 10  # never zero steps
    assert _steps_for(t, epoch_tokens=40_000, rows=100, steps_per_epoch=12) == 1


def test_epoch_tokens_counts_the_selected_rows_of_a_split_table():
    from datasets import Dataset

    from train.run_inputs import epoch_tokens_of

    ds = Dataset.from_dict({"input_ids": [[1] * n for n in (3, 2, 10, 7, 1)]})
    split = ds.train_test_split(test_size=2, seed=0)  # index-mapped views of the same table
    for part in (ds, split["train"], split["test"]):
        assert epoch_tokens_of(part) == sum(len(ids) for ids in part["input_ids"])


_LEAVES_THE_GROUP = """
import sys
from types import SimpleNamespace
import torch.distributed as dist
import cli.main, train.loop
from train.distributed import init_distributed

def fake_train(cfg, decode_eval=None):  # joins the group as the real loop does, then returns its run dir
    init_distributed()
    return "run"

train.loop.train = fake_train
import train.config
train.config.load_train_config = lambda config, overrides: SimpleNamespace(  # no config file needed here
    train=SimpleNamespace(decode_eval_prompts=0))
rc = cli.main.cmd_train(SimpleNamespace(config=[], overrides=[]))
print("initialized after:", dist.is_initialized())
sys.exit(rc)
"""


def test_train_command_leaves_the_process_group_before_exit():
    """A rank that exits with gloo still set up can abort in the group's destructor ("terminate called without an
    active exception", exit -6) after its work is done: seen on a 2-rank sequence-parallel run in CI. The command
    leaves the group first."""
    proc = subprocess.run([sys.executable, "-c", _LEAVES_THE_GROUP], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "initialized after: False" in proc.stdout, proc.stdout + proc.stderr
