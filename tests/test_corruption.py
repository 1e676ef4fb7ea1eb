"""Every file specdraft writes and reads back, damaged the ways files get damaged (cut short by a full disk or an
interrupted copy, bytes overwritten, a JSON value of the wrong type), fails with one clear sentence that names the
file, never a traceback at the CLI, and never trains on garbage. The hidden-state cache rebuilds only the bad
shard; training resumes from the newest good checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SMOKE_RECIPE

from cli.main import main
from data.dataset import build_datasets
from data.hidden_cache import CacheError, HiddenCache, build_hidden_cache, check_shards
from models.base import HiddenStates, load_base
from models.draft import BaseView
from models.export.schema import ExportError
from models.export.specdraft import export_specdraft, load_draft, read_export_config
from models.families.medusa.model import MedusaDraft


def truncate(path: Path, keep: float = 0.6) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def overwrite(path: Path, offset_from_end: int = 64, n: int = 16) -> None:
    """Flip n bytes near the end (tensor data, not the header): the size stays the same."""
    data = bytearray(path.read_bytes())
    at = len(data) - offset_from_end
    data[at:at + n] = bytes(255 - b for b in data[at:at + n])
    path.write_bytes(bytes(data))


def set_json(path: Path, key: str, value) -> None:
    obj = json.loads(path.read_text())
    obj[key] = value
    path.write_text(json.dumps(obj))


def cli_error(args: list[str], capsys) -> str:
    """Run the CLI in-process: it must fail with exit code 2 and one line on stderr, no traceback."""
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ---- hidden-state cache ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_base("tiny")


@pytest.fixture(scope="module")
def rows(tiny, tmp_path_factory):
    ds, _ = build_datasets(tiny.tokenizer, "tests/fixtures/sharegpt_tiny.json", max_records=None, max_length=96,
                           val_fraction=0.2, seed=0, cache_dir=tmp_path_factory.mktemp("data"), min_assistant_tokens=1)
    return ds


def build(tiny, rows, directory, verify=False):
    return build_hidden_cache(HiddenStates(tiny.model), rows, directory, pad_id=0, device=torch.device("cpu"),
                              micro_batch_size=3, shard_rows=2, cache_dtype="fp32", info={"key": "k"}, verify=verify)


def shard(directory: Path, i: int) -> Path:
    return directory / f"shard-{i:05d}.safetensors"


@pytest.mark.parametrize("damage, needs_verify", [(truncate, False), (overwrite, True), (Path.unlink, False)])
def test_a_bad_cache_shard_is_named_and_only_it_is_rebuilt(tiny, rows, tmp_path, damage, needs_verify, capsys):
    directory = build(tiny, rows, tmp_path / "cache")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["shards"] >= 3 and all(f["bytes"] > 0 and len(f["sha256"]) == 64 for f in manifest["shard_files"])
    original = shard(directory, 1).read_bytes()
    good_before = {i: shard(directory, i).stat().st_mtime_ns for i in (0, 2)}
    damage(shard(directory, 1))

    with pytest.raises(CacheError, match=r"shard-00001\.safetensors.*Rebuild only those"):
        HiddenCache(directory, verify=needs_verify)
    if needs_verify:  # same size: only the checksum sees it, and only when asked
        assert not check_shards(directory) and 1 in check_shards(directory, verify=True)

    build(tiny, rows, directory, verify=needs_verify)
    out = capsys.readouterr().out
    assert "1 bad shard(s), rebuilding only those: shard-00001.safetensors" in out
    assert shard(directory, 1).read_bytes() == original  # fp32, same rows: the rebuilt shard is the same bytes
    assert {i: shard(directory, i).stat().st_mtime_ns for i in (0, 2)} == good_before  # good shards kept
    assert len(HiddenCache(directory, verify=True)) == len(rows)


@pytest.mark.parametrize("edit", [lambda p: set_json(p, "rows", "two"), truncate])
def test_a_damaged_cache_manifest_is_a_clear_error(tiny, rows, tmp_path, edit):
    directory = build(tiny, rows, tmp_path / "cache")
    edit(directory / "manifest.json")
    with pytest.raises(CacheError, match=r"manifest\.json is damaged"):
        HiddenCache(directory)


# ---- exports -----------------------------------------------------------------------------------------------


@pytest.fixture
def export(tiny, tmp_path):
    draft = MedusaDraft(2, 1, BaseView.from_model(tiny.model))
    return export_specdraft(draft, tmp_path / "export", "tiny", tiny.fingerprint)


@pytest.mark.parametrize("damage, message", [
    (lambda e: truncate(e / "model.safetensors"), r"model\.safetensors is corrupt or cut short"),
    (lambda e: overwrite(e / "model.safetensors"), r"model\.safetensors: its bytes differ.*sha256"),
    (lambda e: (e / "model.safetensors").unlink(), r"model\.safetensors is missing"),
    (lambda e: truncate(e / "config.json"), r"config\.json: the export's config\.json is not valid JSON"),
    (lambda e: set_json(e / "config.json", "num_heads", "two"), r"config\.json: \"num_heads\": \"two\" must be an "
                                                                r"integer"),
    (lambda e: set_json(e / "config.json", "num_head", 2), r"unknown key\(s\) num_head \(did you mean num_heads\?\)"),
    (lambda e: set_json(e / "config.json", "share_lm_head", 1), r"\"share_lm_head\": 1 must be true or false"),
    (lambda e: (set_json(e / "config.json", "num_heads", 3), set_json(e / "config.json", "model_sha256", "")),
     r"tensors do not match.*missing \['heads\.2"),
])
def test_a_damaged_export_is_named_with_the_fix(tiny, export, damage, message, capsys):
    load_draft(export, BaseView.from_model(tiny.model), tiny.fingerprint)  # intact: loads
    damage(export)
    with pytest.raises(ExportError, match=message):
        load_draft(export, BaseView.from_model(tiny.model), tiny.fingerprint)
    err = cli_error(["eval", "--draft", str(export), "--config", "configs/eval/smoke.yaml"], capsys)
    assert str(export) in err and "re-export" in err or "fix" in err


def test_a_missing_required_key_names_the_family(export):
    cfg = json.loads((export / "config.json").read_text())
    del cfg["num_layers"]
    (export / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"missing key\(s\) \['num_layers'\] that a medusa export needs"):
        read_export_config(export)


def test_every_engine_format_we_write_reads_back_through_the_checks(tiny, export, tmp_path):
    """The vLLM export of a draft is read back: its JSON parses, its safetensors header is whole."""
    from models.export.formats import export_vllm
    from models.export.schema import read_json_file, safetensors_shapes
    from models.export.vllm import read_speculative_config

    draft, config = load_draft(export, BaseView.from_model(tiny.model), tiny.fingerprint)
    out = export_vllm(draft, tmp_path / "vllm", config, BaseView.from_model(tiny.model))
    assert read_speculative_config(out)["method"] == "medusa"
    assert read_json_file(out / "config.json", "vLLM's config.json")["num_heads"] == 2
    assert safetensors_shapes(out / "model.safetensors")
    truncate(out / "model.safetensors")
    with pytest.raises(ExportError, match="corrupt or cut short"):
        safetensors_shapes(out / "model.safetensors")


# ---- ShareGPT input and regenerated JSONL ------------------------------------------------------------------


def test_a_non_utf8_sharegpt_file_is_named(tmp_path, capsys):
    bad = tmp_path / "latin1.json"
    bad.write_bytes('[{"id": "a", "conversations": [{"from": "human", "value": "caf\u00e9"}]}]'.encode("latin1"))
    err = cli_error(["train", "--config", *SMOKE_RECIPE[:1], "--config", SMOKE_RECIPE[1], f"data.source={bad}",
                     f"run_dir={tmp_path / 'run'}"], capsys)
    assert str(bad) in err and "not UTF-8" in err and "iconv" in err


def test_a_torn_or_foreign_self_distill_file(tmp_path, capsys):
    from data.self_distill import _resume

    partial = tmp_path / "x.jsonl.partial"
    partial.write_text(json.dumps({"selfdistill_key": "K"}) + "\n" + json.dumps({"id": "a", "generated_tokens": 3,
                                                                                   "skipped": "empty"}) + "\n{\"id\": ")
    done, skipped, tokens = _resume(partial, "K")
    assert (done, skipped, tokens) == (1, {"empty": 1}, 3)
    assert partial.read_text().endswith("}\n") and "cut by a kill" in capsys.readouterr().out  # torn line dropped
    with pytest.raises(ValueError, match="key K; these settings and base need OTHER"):
        _resume(partial, "OTHER")
    partial.write_text(json.dumps({"selfdistill_key": "K"}) + "\n{not json}\n")
    with pytest.raises(ValueError, match=r"x\.jsonl\.partial is damaged"):
        _resume(partial, "K")


# ---- checkpoints -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_with_checkpoints(tmp_path_factory):
    """A smoke run with a checkpoint every 2 steps (the last two kept): step 4 and step 6."""
    from train.config import load_train_config
    from train.loop import train

    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    train(load_train_config(SMOKE_RECIPE, [f"run_dir={run_dir}", "train.save_every=2", "train.val_batches=0"]))
    return run_dir


def _resume(run_dir: Path, tmp_path: Path, *extra: str) -> Path:
    from train.config import load_train_config
    from train.loop import train

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    train(load_train_config(SMOKE_RECIPE, [f"run_dir={copy}", "train.save_every=2", "train.val_batches=0",
                                           "resume=auto", "train.max_steps=8", *extra]))
    return copy


def test_checkpoints_keep_the_last_two_and_list_their_files(run_with_checkpoints):
    ckpts = run_with_checkpoints / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000004", "step00000006"]
    assert (ckpts / "latest").read_text() == "step00000006"
    files = json.loads((ckpts / "step00000006" / "specdraft_files.json").read_text())
    assert files and all(size >= 0 for size in files.values())


def test_a_damaged_latest_pointer_falls_back_to_the_newest_checkpoint(run_with_checkpoints, tmp_path, caplog):
    from train import checkpoint

    ckpts = run_with_checkpoints / "checkpoints"
    damaged = tmp_path / "c"
    shutil.copytree(ckpts, damaged)
    (damaged / "latest").write_bytes(b"\xff\xfe garbage")
    with caplog.at_level("WARNING"):
        assert checkpoint.resume_candidates(damaged)[0].name == "step00000006"
    assert "latest is damaged" in caplog.text


def test_a_checkpoint_cut_short_is_skipped_for_the_older_one(run_with_checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "src"
    shutil.copytree(run_with_checkpoints, run_dir)
    newest = run_dir / "checkpoints" / "step00000006"
    biggest = max((p for p in newest.rglob("*") if p.is_file() and p.name != "specdraft_files.json"),
                  key=lambda p: p.stat().st_size)
    truncate(biggest)
    resumed = _resume(run_dir, tmp_path)
    log = capsys.readouterr().err  # the training loop logs to stderr
    assert "step00000006 cannot be used" in log and "cut short" in log
    assert "step00000004 at step 4" in log  # the newest good checkpoint
    assert (resumed / "checkpoints" / "latest").read_text() == "step00000008"


def test_resuming_with_another_draft_or_data_names_the_keys(run_with_checkpoints, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(run_with_checkpoints, run_dir)
    err = cli_error(["train", "--config", SMOKE_RECIPE[0], "--config", SMOKE_RECIPE[1], f"run_dir={run_dir}",
                     "resume=auto", "draft.num_heads=3", "data.max_length=128"], capsys)
    assert "draft.num_heads: 4 -> 3" in err and "data.max_length: 256 -> 128" in err and str(run_dir) in err


# ---- quick commands stay quick -----------------------------------------------------------------------------


def test_the_smoke_eval_config_runs_ngram_on_the_tiny_base(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    assert main(["eval", "--method", "ngram", "--config", "configs/eval/smoke.yaml", f"run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "building the model bigram table of tiny" in out  # said up front, with its size and where it goes
    report = json.loads((tmp_path / "eval" / "smoke" / "report.json").read_text())
    assert report["base_model"] == "tiny"
