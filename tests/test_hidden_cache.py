"""Hidden-state cache: exact rows, resumable writer, key checks, and cached training == online training."""

import json

import pytest
import torch
from conftest import SMOKE_RECIPE

from data.dataset import build_datasets, collate
from data.hidden_cache import HiddenCache, build_hidden_cache, cache_key, collate_cached, estimate_bytes
from models.base import HiddenStates, last_hidden_and_logits, load_base
from models.draft import BaseView, DraftBatch
from models.families.medusa.model import MedusaDraft
from train.config import LossSection, load_train_config


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    base = load_base("tiny")
    train_ds, _ = build_datasets(base.tokenizer, "tests/fixtures/sharegpt_tiny.json", max_records=None,
                                 max_length=128, val_fraction=0.2, seed=0,
                                 cache_dir=tmp_path_factory.mktemp("data"), min_assistant_tokens=1)
    return base, train_ds


def _train_losses(run_dir) -> list[float]:
    """The training loss of every logged step of a run (metrics.jsonl rows with a "loss")."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _build(base, ds, directory, **kw):
    return build_hidden_cache(HiddenStates(base.model), ds, directory, pad_id=0, device=torch.device("cpu"),
                              micro_batch_size=3, shard_rows=4, cache_dtype="fp32", **kw)


def test_cached_rows_equal_the_base_forward(tiny_data, tmp_path, capsys):
    base, ds = tiny_data
    cache = HiddenCache(_build(base, ds, tmp_path / "c"))
    assert "hidden-state cache" in capsys.readouterr().out  # the size estimate is printed first
    assert len(cache) == len(ds) and cache.manifest["shards"] == (len(ds) + 3) // 4
    for i in (0, 3, 4, len(ds) - 1):  # first/last row of a shard, across shard boundaries
        ids = torch.tensor(ds[i]["input_ids"])[None]
        h, _ = last_hidden_and_logits(base.model, ids)
        row = cache[i]
        assert torch.equal(row["input_ids"].long(), ids[0])
        assert torch.equal(row["loss_mask"].long(), torch.tensor(ds[i]["loss_mask"]))
        torch.testing.assert_close(row["hidden"], h[0], rtol=1e-5, atol=1e-5)  # padding never leaks into h


def test_size_estimate_matches_the_files(tiny_data, tmp_path):
    base, ds = tiny_data
    directory = _build(base, ds, tmp_path / "c")
    on_disk = sum(p.stat().st_size for p in directory.glob("shard-*.safetensors"))
    estimate = estimate_bytes(ds, base.model.config.hidden_size, "fp32")
    assert 0.9 * on_disk < estimate <= on_disk  # headers and offsets are the only extra


def test_a_killed_build_resumes_without_redoing_finished_shards(tiny_data, tmp_path, monkeypatch):
    base, ds = tiny_data
    directory = _build(base, ds, tmp_path / "c", info={"key": "k1"})
    first = HiddenCache(directory)[5]["hidden"].clone()
    (directory / "manifest.json").unlink()  # as if killed before the end...
    (directory / "shard-00001.safetensors").unlink()  # ...while writing shard 1
    calls = []
    real_forward = base.model.model.forward
    monkeypatch.setattr(base.model.model, "forward", lambda *a, **k: calls.append(1) or real_forward(*a, **k))
    _build(base, ds, directory, info={"key": "k1"})
    assert len(calls) == 2  # shard 1 only: 4 rows in micro-batches of 3
    torch.testing.assert_close(HiddenCache(directory)[5]["hidden"], first)


def test_another_runs_cache_directory_is_refused(tiny_data, tmp_path):
    base, ds = tiny_data
    _build(base, ds, tmp_path / "c", info={"key": "k1"})
    with pytest.raises(ValueError, match="other data or another base"):
        _build(base, ds, tmp_path / "c", info={"key": "k2"})
    with pytest.raises(FileNotFoundError, match="manifest"):
        HiddenCache(tmp_path / "nothing")


def test_key_depends_on_rows_base_and_dtype(tiny_data):
    base, ds = tiny_data
    k = cache_key(base.fingerprint, torch.float32, ds, "bf16")
    assert k == cache_key(base.fingerprint, torch.float32, ds, "bf16")
    assert k != cache_key(base.fingerprint, torch.bfloat16, ds, "bf16")
    assert k != cache_key("other", torch.float32, ds, "bf16")
    assert k != cache_key(base.fingerprint, torch.float32, ds.select(range(len(ds) - 1)), "bf16")


def test_cached_and_online_give_the_same_loss_on_the_same_batch(tiny_data, tmp_path):
    base, ds = tiny_data
    cache = HiddenCache(_build(base, ds, tmp_path / "c"))
    view = BaseView.from_model(base.model)
    torch.manual_seed(0)
    draft = MedusaDraft(3, 1, view)
    loss_cfg = LossSection(teacher_weight=0.5)  # teacher rows come from h as well
    rows = [2, 7, 5]
    online = collate([ds[i] for i in rows], 0)
    h, _ = last_hidden_and_logits(base.model, online["input_ids"], online["attention_mask"])
    cached = collate_cached([cache[i] for i in rows], 0, torch.float32)
    assert torch.equal(cached["input_ids"], online["input_ids"])
    a = draft.loss(DraftBatch(h, online["input_ids"], online["loss_mask"]), view, loss_cfg)
    b = draft.loss(DraftBatch(cached["hidden"], cached["input_ids"], cached["loss_mask"]), view, loss_cfg)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert [s.top1 for s in a.per_depth] == [s.top1 for s in b.per_depth]


def test_training_from_the_cache_matches_online_training(tmp_path):
    from train.loop import train

    common = ["train.max_steps=6", "train.log_every=2", "train.val_batches=0", f"data.cache_dir={tmp_path / 'd'}"]
    train(load_train_config(SMOKE_RECIPE, [f"run_dir={tmp_path / 'online'}", *common]))
    train(load_train_config(SMOKE_RECIPE, [f"run_dir={tmp_path / 'cached'}", "data.hidden_cache=auto",
                                           "data.hidden_cache_dtype=fp32", *common]))
    assert len(list((tmp_path / "d" / "hidden").glob("*/manifest.json"))) == 1

    online, cached = _train_losses(tmp_path / "online"), _train_losses(tmp_path / "cached")
    assert len(online) == 3
    assert cached == pytest.approx(online, rel=1e-4)


# ---- EAGLE-3: the cache also stores the aux layers ------------------------------------------------


def test_aux_layers_are_cached_exactly_and_counted(tiny_data, tmp_path):
    from models.base import last_hidden_and_aux

    base, ds = tiny_data
    directory = _build(base, ds, tmp_path / "c", aux_layers=[1, 0])
    cache = HiddenCache(directory)
    assert cache.manifest["aux_layers"] == [1, 0]
    for i in (0, 4, len(ds) - 1):
        ids = torch.tensor(ds[i]["input_ids"])[None]
        h, aux = last_hidden_and_aux(base.model, ids, None, [1, 0])
        torch.testing.assert_close(cache[i]["hidden"], h[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache[i]["aux"], aux[0], rtol=1e-5, atol=1e-5)
    on_disk = sum(p.stat().st_size for p in directory.glob("shard-*.safetensors"))
    estimate = estimate_bytes(ds, base.model.config.hidden_size, "fp32", num_aux=2)
    assert 0.9 * on_disk < estimate <= on_disk  # the estimate covers h and the aux layers
    batch = collate_cached([cache[i] for i in (1, 2)], 0, torch.float32)
    assert batch["aux"].shape == (*batch["input_ids"].shape, 2 * base.model.config.hidden_size)


def test_key_covers_the_aux_layer_ids(tiny_data):
    base, ds = tiny_data
    plain = cache_key(base.fingerprint, torch.float32, ds, "bf16")
    assert cache_key(base.fingerprint, torch.float32, ds, "bf16", []) == plain  # no aux = the old key
    a = cache_key(base.fingerprint, torch.float32, ds, "bf16", [0, 1])
    assert a not in (plain, cache_key(base.fingerprint, torch.float32, ds, "bf16", [1, 0]))


def test_eagle3_training_from_the_cache_matches_online_training(tmp_path):
    from train.loop import train

    recipe = ["configs/eagle3.yaml", "configs/smoke.yaml"]
    common = ["train.max_steps=4", "train.log_every=2", "train.val_batches=0", f"data.cache_dir={tmp_path / 'd'}"]
    train(load_train_config(recipe, [f"run_dir={tmp_path / 'online'}", *common]))
    train(load_train_config(recipe, [f"run_dir={tmp_path / 'cached'}", "data.hidden_cache=auto",
                                     "data.hidden_cache_dtype=fp32", *common]))
    manifests = list((tmp_path / "d" / "hidden").glob("*/manifest.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["aux_layers"] == [0, 1]

    online, cached = _train_losses(tmp_path / "online"), _train_losses(tmp_path / "cached")
    assert len(online) == 2
    assert cached == pytest.approx(online, rel=1e-4)


def test_a_family_without_aux_layers_trains_from_an_eagle3_cache_of_the_same_rows(tmp_path):
    """One base pass serves every family: Medusa finds the EAGLE-3 cache of its rows (no second build) and
    trains exactly as from a cache of its own."""
    from train.loop import train

    common = ["train.max_steps=4", "train.log_every=2", "train.val_batches=0", "data.hidden_cache=auto",
              "data.hidden_cache_dtype=fp32"]
    shared = f"data.cache_dir={tmp_path / 'shared'}"
    train(load_train_config(["configs/eagle3.yaml", "configs/smoke.yaml"], [f"run_dir={tmp_path / 'e3'}", shared,
                                                                            *common]))
    eagle3_cache = list((tmp_path / "shared" / "hidden").glob("*/manifest.json"))
    assert len(eagle3_cache) == 1
    mtime = eagle3_cache[0].stat().st_mtime_ns
    train(load_train_config(SMOKE_RECIPE, [f"run_dir={tmp_path / 'reused'}", shared, *common]))
    assert list((tmp_path / "shared" / "hidden").glob("*/manifest.json")) == eagle3_cache  # nothing new built
    assert eagle3_cache[0].stat().st_mtime_ns == mtime
    train(load_train_config(SMOKE_RECIPE, [f"run_dir={tmp_path / 'own'}", f"data.cache_dir={tmp_path / 'own_d'}",
                                           *common]))
    own = json.loads(next((tmp_path / "own_d" / "hidden").glob("*/manifest.json")).read_text())
    assert own["aux_layers"] == []

    assert len(_train_losses(tmp_path / "own")) == 2
    assert _train_losses(tmp_path / "reused") == _train_losses(tmp_path / "own")


def test_the_superset_lookup_refuses_other_rows_and_caches_without_aux(tiny_data, tmp_path):
    from data.hidden_cache import find_superset_cache

    base, ds = tiny_data
    look = dict(base_fingerprint=base.fingerprint, base_dtype=base.model.dtype, cache_dtype="fp32")
    info = {"base_fingerprint": base.fingerprint, "base_dtype": str(base.model.dtype)}
    root = tmp_path / "root"
    _build(base, ds, root / "hidden" / "plain", info={**info, "key": cache_key(base.fingerprint, base.model.dtype,
                                                                                  ds, "fp32")})
    assert find_superset_cache(root, ds, **look) is None  # no aux layers: not a superset (it IS the cache)
    aux_key = cache_key(base.fingerprint, base.model.dtype, ds, "fp32", [1, 0])
    _build(base, ds, root / "hidden" / "aux", aux_layers=[1, 0], info={**info, "key": aux_key})
    assert find_superset_cache(root, ds, **look) == root / "hidden" / "aux"
    assert find_superset_cache(root, ds.select(range(len(ds) - 1)), **look) is None  # other rows
    assert find_superset_cache(root, ds, **{**look, "cache_dtype": "bf16"}) is None
    assert find_superset_cache(root, ds, **{**look, "base_fingerprint": "other"}) is None
    cache = HiddenCache(root / "hidden" / "aux", read_aux=False)
    assert "aux" not in cache[0] and "aux" in HiddenCache(root / "hidden" / "aux")[0]


@pytest.mark.parametrize("size", [2, 3])
def test_a_sequence_parallel_rank_reads_only_its_window_and_gets_what_slicing_the_whole_row_gives(tiny_data,
                                                                                                   tmp_path, size):
    """HiddenCache.window + collate_cached(widths=...) (what a rank of a sequence-parallel group reads) against the
    whole rows collated, padded and sliced the way SequenceParallel.split slices them (the reference twin)."""
    import torch.nn.functional as F

    from train.sequence_parallel import rank_window

    base, ds = tiny_data
    cache = HiddenCache(_build(base, ds, tmp_path / "c", aux_layers=[1, 0]))
    rows, halo = [0, 3, 5], 4
    whole = collate_cached([cache[i] for i in rows], 0, torch.float32)
    length = whole["input_ids"].shape[1]
    assert length == max(cache.length(i) for i in rows)
    n = -(-length // size)
    for rank in range(size):
        start, h_stop, a_stop = rank_window(length, size, rank, halo)
        got = collate_cached([cache.window(i, start, h_stop, a_stop) for i in rows], 0, torch.float32,
                             widths=(h_stop - start, a_stop - start))
        want_h = F.pad(whole["hidden"], (0, 0, 0, n * size + halo - length))[:, start:h_stop]
        want_a = F.pad(whole["aux"], (0, 0, 0, n * size - length))[:, start:a_stop]
        torch.testing.assert_close(got["hidden"], want_h, rtol=0, atol=0)
        torch.testing.assert_close(got["aux"], want_a, rtol=0, atol=0)
        assert torch.equal(got["input_ids"], whole["input_ids"]) and torch.equal(got["loss_mask"],
                                                                                 whole["loss_mask"])
        read = sum(cache.window(i, start, h_stop, a_stop)["hidden"].shape[0] for i in rows)
        assert read <= len(rows) * (n + halo) < sum(cache.length(i) for i in rows), \
            "a rank read more than its window"
