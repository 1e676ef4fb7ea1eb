"""train.init_from: a run starts from a trained draft's weights (train/init_from.py), not the family's
initialisation; the run takes the export's draft vocabulary; a draft of another family, shape
or vocabulary size is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from models.export.specdraft import read_tensors
from train.config import ConfigError, load_train_config
from train.loop import train

COMMON = ["configs/eagle3.yaml", "configs/smoke.yaml"]
OVER = ["train.val_batches=0", "train.log_every=1", "train.lr=5e-3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny EAGLE-3 trained 8 steps over a 64-token draft vocabulary."""
    run = tmp_path_factory.mktemp("init") / "first"
    train(load_train_config(COMMON, [*OVER, f"run_dir={run}", "train.max_steps=8", "draft.vocab_size=64"]))
    return run


def _weights(run_dir) -> dict:
    return read_tensors(run_dir / "export" / "model.safetensors")


def test_a_run_from_an_export_starts_from_its_weights_and_keeps_its_vocabulary(trained, tmp_path):
    """With a learning rate of ~0 a run ends where it starts: started from the export, it ends at the export's
    weights; started fresh (the same config), elsewhere."""
    cont, fresh = tmp_path / "cont", tmp_path / "fresh"
    over = [*OVER[:-1], "train.lr=1e-12", "train.max_steps=1", "draft.vocab_size=64", "train.seed=3"]
    train(load_train_config(COMMON, [*over, f"run_dir={cont}", f"train.init_from={trained / 'export'}"]))
    train(load_train_config(COMMON, [*over, f"run_dir={fresh}"]))
    want, got, other = _weights(trained), _weights(cont), _weights(fresh)
    assert want.keys() == got.keys() and torch.equal(got["d2t"], want["d2t"])
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(other[k].float(), want[k].float()) for k in want if k != "d2t")


def test_the_export_map_replaces_the_run_built_one(trained, tmp_path, monkeypatch):
    """The run's own map (built from its data) is not used: a draft vocabulary built differently (here: reversed)
    still trains with the export's rows."""
    import train.loop as loop

    built = loop.draft_vocab
    monkeypatch.setattr(loop, "draft_vocab", lambda *a: built(*a).flip(0))
    run = tmp_path / "run"
    train(load_train_config(COMMON, [*OVER, "train.max_steps=1", "draft.vocab_size=64", f"run_dir={run}",
                                     f"train.init_from={trained / 'export'}"]))
    d2t = read_tensors(trained / "export" / "model.safetensors")["d2t"]
    assert torch.equal(read_tensors(run / "export" / "model.safetensors")["d2t"], d2t)


@pytest.mark.parametrize("overrides, match", [
    (["draft.vocab_size=0"], "drafts over a 64-token draft vocabulary, this run over the full vocabulary"),
    (["draft.vocab_size=64", "draft.eagle3.num_layers=2"], "do not match this run's eagle3 draft"),
])
def test_a_draft_of_another_shape_is_refused_naming_the_key(trained, tmp_path, overrides, match):
    cfg = load_train_config(COMMON, [*OVER, "train.max_steps=1", f"run_dir={tmp_path / 'x'}", *overrides,
                                     f"train.init_from={trained / 'export'}"])
    with pytest.raises(ValueError, match="train.init_from") as err:
        train(cfg)
    assert match in str(err.value)


def test_another_family_is_refused(trained, tmp_path):
    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"],
                            [*OVER, "train.max_steps=1", f"run_dir={tmp_path / 'x'}",
                             f"train.init_from={trained / 'export'}"])
    with pytest.raises(ValueError, match="holds a eagle3 draft, but this run trains medusa"):
        train(cfg)


def test_a_path_without_an_export_fails_at_load(tmp_path):
    with pytest.raises(ConfigError, match="train.init_from"):
        load_train_config(COMMON, [f"train.init_from={tmp_path}"])
