"""Packed training rows (data/packed.py; what the GPU machine trains from) and file parts
(data/file_parts.py; how large files cross the device tool): round trips against the `datasets` pipeline,
the max_length cut and filter against a plain reference, the seeded split, refusals of damaged input, and a
training run from a pack in a process where `datasets` and `wandb` are never imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env

from data.dataset import build_datasets
from data.file_parts import join, split
from data.packed import PACK_FORMAT, is_packed, load_packed, packed_train_data, tokenizer_fingerprint, write_packed
from models.tiny import tiny_tokenizer

TINY = str(Path(__file__).parent / "fixtures" / "sharegpt_tiny.json")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def rows(tok, tmp_path_factory):
    """Every kept fixture conversation as rendered by the `datasets` pipeline (max_length 256)."""
    train, val = build_datasets(tok, TINY, max_records=None, max_length=256, val_fraction=0.2, seed=0,
                                cache_dir=tmp_path_factory.mktemp("data"))
    return [dict(r) for r in list(train) + list(val)]


@pytest.fixture(scope="module")
def pack(tok, rows, tmp_path_factory):
    """The rows packed into several shards (shard_tokens far below the fixture's ~6k tokens)."""
    out = tmp_path_factory.mktemp("pack") / "sharegpt"
    info = {"source": TINY, "max_records": None, "max_length": 256, "tokenizer": "tiny",
            "tokenizer_fingerprint": tokenizer_fingerprint(tok)}
    manifest = write_packed(rows, out, vocab_size=len(tok), info=info, shard_tokens=1500)
    return out, manifest


def _key(row) -> tuple:
    return tuple(row["input_ids"]), tuple(row["loss_mask"])


def test_round_trip_keeps_every_row_exactly_and_splits_disjointly(tok, rows, pack):
    out, manifest = pack
    assert is_packed(str(out)) and manifest["format"] == PACK_FORMAT
    assert len(manifest["shards"]) > 1 and manifest["rows"] == len(rows)
    assert manifest["tokens"] == sum(len(r["input_ids"]) for r in rows)
    train, val = load_packed(out, tok, max_length=256, val_fraction=0.2, seed=0)
    got = [_key(r) for r in list(train) + list(val)]
    assert sorted(got) == sorted(_key(r) for r in rows)  # same rows, masks bit-exact, nothing twice
    assert len(val) == int(np.ceil(0.2 * len(rows))) and len(set(got)) == len(got)
    assert all(isinstance(t, int) for t in train[0]["input_ids"])  # like `datasets` rows: plain ints


def test_seed_decides_the_split(tok, pack):
    out, _ = pack
    val0 = {_key(r) for r in load_packed(out, tok, max_length=256, val_fraction=0.2, seed=0)[1]}
    again = {_key(r) for r in load_packed(out, tok, max_length=256, val_fraction=0.2, seed=0)[1]}
    val1 = {_key(r) for r in load_packed(out, tok, max_length=256, val_fraction=0.2, seed=1)[1]}
    assert val0 == again and val0 != val1


def test_max_length_cut_and_min_assistant_filter_match_a_plain_reference(tok, rows, pack):
    out, _ = pack
    cut, need = 80, 20
    want = sorted((tuple(r["input_ids"][:cut]), tuple(r["loss_mask"][:cut])) for r in rows
                  if sum(r["loss_mask"][:cut]) >= need)
    train, val = load_packed(out, tok, max_length=cut, val_fraction=0.1, seed=3, min_assistant_tokens=need)
    assert 2 <= len(want) < len(rows)  # the filter really drops some rows here
    assert max(len(r["input_ids"]) for r in rows) > cut  # and the cut really cuts
    assert sorted(_key(r) for r in list(train) + list(val)) == want
    assert max(train.lengths()) <= cut


def test_refuses_another_tokenizer_a_damaged_shard_and_a_wide_vocab(tok, rows, pack, tmp_path):
    out, _ = pack
    other = tiny_tokenizer()
    other.chat_template = "{{ messages }}"
    with pytest.raises(ValueError, match="another tokenizer"):
        load_packed(out, other, max_length=256, val_fraction=0.2, seed=0)
    damaged = tmp_path / "damaged"
    write_packed(rows, damaged, vocab_size=len(tok), shard_tokens=1500)
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="damaged"):
        load_packed(damaged, None, max_length=256, val_fraction=0.2, seed=0)
    with pytest.raises(ValueError, match="uint16"):
        write_packed(rows, tmp_path / "wide", vocab_size=70_000)
    with pytest.raises(ValueError, match="outside"):
        write_packed([{"input_ids": [5, 400], "loss_mask": [0, 1]}], tmp_path / "bad", vocab_size=320)
    assert not is_packed(str(tmp_path / "bad")) and not is_packed(TINY)


def test_train_data_entry_points_eval_at_the_source_slice(pack):
    out, _ = pack
    entry = packed_train_data(out)
    assert entry["derived_from"] == {"source": TINY, "max_records": None}


def test_split_and_join_round_trip_and_refuse_bad_parts(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    index = split(src, [tmp_path / "a", tmp_path / "b"], parts=2)
    assert len(index["parts"]) == 2 and (tmp_path / "a" / "blob.bin.split.json").is_file()
    assert join([tmp_path / "a", tmp_path / "b"], tmp_path / "out.bin").read_bytes() == data
    with pytest.raises(FileNotFoundError, match="missing"):
        join([tmp_path / "a"], tmp_path / "x.bin")
    small = split(src, [tmp_path / "c"], max_bytes=30_000)
    assert len(small["parts"]) == 4 and all((tmp_path / "c" / p).stat().st_size <= 30_000 for p in small["parts"])
    part = tmp_path / "c" / small["parts"][1]
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        join([tmp_path / "c"], tmp_path / "y.bin")
    assert not (tmp_path / "y.bin").exists()


_NO_IMPORT_CHILD = """
import json, sys
from cli.main import main
rc = main(sys.argv[1:])
print("IMPORTED " + json.dumps({m: m in sys.modules for m in ("datasets", "wandb")}))
sys.exit(rc)
"""


def test_training_from_a_pack_imports_neither_datasets_nor_wandb(pack, tmp_path):
    """The GPU machine's way: data.source=<pack>, wandb.enabled=false; neither package is needed."""
    out, _ = pack
    run_dir = tmp_path / "run"
    args = ["train", "--config", "configs/medusa.yaml", "--config", "configs/smoke.yaml", f"data.source={out}",
            f"run_dir={run_dir}", "train.max_steps=2", "train.val_batches=1", "wandb.enabled=false"]
    proc = subprocess.run([sys.executable, "-c", _NO_IMPORT_CHILD, *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    imported = json.loads(proc.stdout.split("IMPORTED ")[-1].splitlines()[0])
    assert imported == {"datasets": False, "wandb": False}
    assert (run_dir / "export" / "model.safetensors").is_file()
    export_cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert export_cfg["train_data"]["derived_from"]["source"] == TINY
