"""A training option only one family reads, given to a run of another family, fails at load with one line naming
the family it belongs to (FamilyFacts.config_keys, checked by train/config.py: validate); old configs still load
(tests/test_configs.py loads every recipe and overlay)."""

from __future__ import annotations

import dataclasses

import pytest

from core.config_loader import ConfigError
from models.registry import FAMILIES, config_key_owners
from train.config import TrainConfig, load_train_config


def _other_value(value):
    """A valid-typed value different from a field's default."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.25
    return {"dpace": "decay"}[value]


def _default(key: str):
    section, name = key.split(".")
    return getattr(getattr(TrainConfig(), section), name)


def test_the_table_of_family_keys():
    assert config_key_owners() == {
        "draft.prefix_layer": "hydra", "draft.rnn": "redrafter", "draft.num_frames": "ctc",
        "loss.token_weight": "ctc", "draft.ttt_steps": "eagle3", "draft.block_size": "dflash",
        "draft.num_anchors": "dflash", "draft.mask_token_id": "dflash", "draft.learned_mask": "dflash",
        "loss.position_weights": "dflash", "loss.dpace_alpha": "dflash"}
    for key in config_key_owners():  # every declared key is a real field (a typo would never fire)
        section, name = key.split(".")
        assert name in {f.name for f in dataclasses.fields(getattr(TrainConfig(), section))}, key


@pytest.mark.parametrize("key", sorted(config_key_owners()))
def test_a_key_given_to_another_family_fails_naming_its_family(key):
    owner = config_key_owners()[key]
    other = "medusa" if owner != "medusa" else "hydra"
    value = _other_value(_default(key))
    with pytest.raises(ConfigError) as err:
        load_train_config([f"configs/{other}.yaml"], [f"{key}={value}"])
    msg = str(err.value)
    assert "\n" not in msg and key in msg and f"{FAMILIES[owner].title} family ({owner})" in msg, msg
    assert f"draft.family={owner}" in msg


def test_a_key_at_its_default_or_on_its_own_family_is_fine():
    load_train_config(["configs/medusa.yaml"], ["draft.ttt_steps=3", "loss.position_weights=dpace"])  # defaults
    cfg = load_train_config(["configs/eagle3.yaml"], ["draft.ttt_steps=5", "draft.num_heads=5"])
    assert cfg.draft.ttt_steps == 5
    cfg = load_train_config(["configs/dflash.yaml"], ["loss.dpace_alpha=0.25", "draft.num_anchors=32"])
    assert (cfg.loss.dpace_alpha, cfg.draft.num_anchors) == (0.25, 32)
