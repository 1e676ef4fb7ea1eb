"""Each family's own training options are a nested section declared in its own file (FamilyFacts.draft_options /
loss_options: draft.<family>.*, loss.<family>.*). Given to a run of another family, one fails at load with one line
naming the family it belongs to; the flat keys of older configs (draft.ttt_steps) load at their new place with a
one-line note, in recipes, overrides and a run's saved config.yaml (tests/test_configs.py loads every recipe)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import yaml

from core.config_loader import ConfigError, to_dict
from models.registry import DRAFT_MODELS, FAMILIES, config_key_owners, flat_key_owners, option_sections
from train import checkpoint
from train.config import DraftSection, LossSection, TrainConfig, load_train_config, saved_config_tree

FLAT_RUN_CONFIG = "tests/fixtures/flat_keys_run_config.yaml"  # a real run's config.yaml with the old flat keys


def _other_value(value):
    """A valid-typed value different from a field's default."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.25
    return {"dpace": "decay", "kl": "tv"}[value]


def _get(obj, key: str):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_table_of_family_keys():
    """The keys of the families that had flat keys, pinned (a family added later brings its own section)."""
    assert {
        "draft.hydra.prefix_layer": "hydra", "draft.redrafter.rnn": "redrafter", "draft.ctc.num_frames": "ctc",
        "loss.ctc.token_weight": "ctc", "draft.eagle3.ttt_steps": "eagle3", "draft.dflash.block_size": "dflash",
        "draft.dflash.num_anchors": "dflash", "draft.dflash.mask_token_id": "dflash",
        "draft.dflash.learned_mask": "dflash", "loss.dflash.position_weights": "dflash",
        "loss.dflash.dpace_alpha": "dflash"}.items() <= config_key_owners().items()
    for key, owner in config_key_owners().items():  # every key is a real field, in its owner's own section
        _get(TrainConfig(), key)
        assert key.split(".")[1] == owner
    assert not any(k.startswith(("draft.medusa.", "loss.medusa.")) for k in config_key_owners())  # shared only


def test_the_old_flat_keys_move_into_the_family_that_read_them():
    assert flat_key_owners() == {
        "draft.prefix_layer": "hydra", "draft.rnn": "redrafter", "draft.num_frames": "ctc",
        "loss.token_weight": "ctc", "draft.ttt_steps": "eagle3", "draft.block_size": "dflash",
        "draft.num_anchors": "dflash", "draft.mask_token_id": "dflash", "draft.learned_mask": "dflash",
        "loss.position_weights": "dflash", "loss.dpace_alpha": "dflash"}


# family key -> why it may share its last name with a shared key
SAME_NAME_AS_SHARED = {
    "draft.eagle3.num_layers": "EAGLE-3's decoder layers; the shared draft.num_layers counts other families' ResBlocks "
                               "or DFlash's layers, and an EAGLE-3 run refuses it != 1 naming draft.eagle3.num_layers",
}


def test_the_sections_are_built_from_the_families_own_dataclasses():
    for section, cls in (("draft", DraftSection), ("loss", LossSection)):
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, options in option_sections(section).items():
            assert fields[name] is options
            assert options.__module__ == DRAFT_MODELS[name].__module__  # declared in the family's own file
            assert isinstance(getattr(cls(), name), options)
    # no per-family key is left flat in the shared sections (but for the few family keys that share a name with a
    # different shared key, each with its reason: upgrade_flat_keys leaves a shared key where it is)
    shared = {f.name for f in dataclasses.fields(DraftSection)} | {f.name for f in dataclasses.fields(LossSection)}
    assert not {key.split(".")[-1] for key in config_key_owners() if key not in SAME_NAME_AS_SHARED} & shared
    assert set(SAME_NAME_AS_SHARED) <= set(config_key_owners())


@pytest.mark.parametrize("key", sorted(config_key_owners()))
def test_a_key_given_to_another_family_fails_naming_its_family(key):
    owner = config_key_owners()[key]
    other = "medusa" if owner != "medusa" else "hydra"
    value = _other_value(_get(TrainConfig(), key))
    with pytest.raises(ConfigError) as err:
        load_train_config([f"configs/{other}.yaml"], [f"{key}={value}"])
    msg = str(err.value)
    assert "\n" not in msg and key in msg and f"{FAMILIES[owner].title} family ({owner})" in msg, msg
    assert f"draft.family={owner}" in msg


@pytest.mark.parametrize("flat", sorted(flat_key_owners()))
def test_an_old_flat_key_on_another_family_fails_naming_the_new_key_and_its_family(flat, caplog):
    owner = flat_key_owners()[flat]
    section, name = flat.split(".")
    new = f"{section}.{owner}.{name}"
    value = _other_value(_get(TrainConfig(), new))
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        load_train_config(["configs/medusa.yaml"], [f"{flat}={value}"])
    msg = str(err.value)
    assert "\n" not in msg and new in msg and f"({owner})" in msg, msg
    assert f"{flat} -> {new}" in caplog.text


def test_a_key_at_its_default_or_on_its_own_family_is_fine():
    load_train_config(["configs/medusa.yaml"], ["draft.eagle3.ttt_steps=3", "loss.dflash.position_weights=dpace"])
    cfg = load_train_config(["configs/eagle3.yaml"], ["draft.eagle3.ttt_steps=5", "draft.num_heads=5"])
    assert cfg.draft.eagle3.ttt_steps == 5
    cfg = load_train_config(["configs/dflash.yaml"], ["loss.dflash.dpace_alpha=0.25", "draft.dflash.num_anchors=32"])
    assert (cfg.loss.dflash.dpace_alpha, cfg.draft.dflash.num_anchors) == (0.25, 32)


def test_old_flat_keys_on_the_command_line_load_at_their_new_place_with_a_note(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_train_config(["configs/eagle3.yaml"], ["draft.ttt_steps=5", "draft.num_heads=5"])
    assert cfg.draft.eagle3.ttt_steps == 5
    notes = [r.getMessage() for r in caplog.records if "draft.ttt_steps" in r.getMessage()]
    assert notes and all("\n" not in n for n in notes)
    assert any("override 'draft.ttt_steps=5'" in n and "draft.ttt_steps -> draft.eagle3.ttt_steps" in n
               for n in notes), notes
    with caplog.at_level(logging.WARNING):
        cfg = load_train_config(["configs/dflash.yaml"], ["loss.dpace_alpha=0.25", "draft.num_anchors=32"])
    assert (cfg.loss.dflash.dpace_alpha, cfg.draft.dflash.num_anchors) == (0.25, 32)
    assert "loss.dpace_alpha -> loss.dflash.dpace_alpha" in caplog.text


def test_an_old_yaml_recipe_loads_as_the_new_one(tmp_path, caplog):
    old = tmp_path / "old_ctc.yaml"
    old.write_text("draft:\n  family: ctc\n  num_heads: 3\n  num_frames: 5\nloss:\n  token_weight: 0.2\n")
    with caplog.at_level(logging.WARNING):
        cfg = load_train_config([str(old)])
    assert (cfg.draft.ctc.num_frames, cfg.loss.ctc.token_weight) == (5, 0.2)
    assert f"{old}: old flat keys" in caplog.text and "loss.token_weight -> loss.ctc.token_weight" in caplog.text
    new = load_train_config([], ["draft.family=ctc", "draft.num_heads=3", "draft.ctc.num_frames=5",
                                 "loss.ctc.token_weight=0.2"])
    assert to_dict(cfg) == to_dict(new)


def test_the_family_of_a_later_layer_decides_where_a_flat_key_goes(tmp_path):
    first = tmp_path / "first.yaml"
    first.write_text("draft:\n  num_frames: 5\n")
    cfg = load_train_config([str(first)], ["draft.family=ctc", "draft.num_heads=3"])
    assert cfg.draft.ctc.num_frames == 5


def test_a_flat_and_a_nested_key_that_disagree_fail_naming_the_new_key(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("draft:\n  family: eagle3\n  num_heads: 4\n  ttt_steps: 4\n  eagle3:\n    ttt_steps: 5\n")
    with pytest.raises(ConfigError, match=r"keep only draft\.eagle3\.ttt_steps"):
        load_train_config([str(both)])
    both.write_text("draft:\n  family: eagle3\n  num_heads: 4\n  ttt_steps: 4\n  eagle3:\n    ttt_steps: 4\n")
    assert load_train_config([str(both)]).draft.eagle3.ttt_steps == 4


def test_a_nested_key_of_an_unknown_option_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"draft\.eagle3\.ttt_step'.*did you mean 'draft\.eagle3\.ttt_steps'"):
        load_train_config(["configs/eagle3.yaml"], ["draft.eagle3.ttt_step=4"])


def test_a_saved_run_config_with_flat_keys_loads_and_resumes_unchanged():
    """A real run's config.yaml (every old flat key, at its value): it loads to the same training, and
    the resume check sees no change between it and the config loaded from it."""
    saved = yaml.safe_load(open(FLAT_RUN_CONFIG))
    cfg = load_train_config([FLAT_RUN_CONFIG])
    assert cfg.draft.family == "eagle3" and cfg.draft.eagle3.ttt_steps == saved["draft"]["ttt_steps"] == 3
    assert cfg.loss.teacher_weight == saved["loss"]["teacher_weight"]
    assert checkpoint.resume_config_changes(saved_config_tree(saved), to_dict(cfg)) == []
    # a real change is still caught, and named by its new key
    changed = load_train_config([FLAT_RUN_CONFIG], ["draft.eagle3.ttt_steps=4", "draft.num_heads=4"])
    diffs = checkpoint.resume_config_changes(saved_config_tree(saved), to_dict(changed))
    assert "draft.eagle3.ttt_steps: 3 -> 4" in diffs


def test_family_facts_reject_options_without_defaults_and_the_old_config_keys():
    from models.family import FamilyFacts

    @dataclasses.dataclass
    class NoDefault:
        size: int

    with pytest.raises(ValueError, match="needs a default"):
        FamilyFacts("x", "X", draft_options=NoDefault)
    with pytest.raises(ValueError, match="draft_options"):
        FamilyFacts("x", "X", config_keys=("draft.size",))
    with pytest.raises(ValueError, match="not a field"):
        FamilyFacts("x", "X", flat_keys=("draft.size",))


def test_a_flat_key_only_other_families_have_is_ambiguous_and_names_their_keys(monkeypatch):
    """Not an old key of any family, and the run's family lacks it: nothing to map it to; the error names the nested
    keys it could mean (here two made-up families declare the same option)."""
    import train.config as train_config

    @dataclasses.dataclass
    class Made:
        foo: int = 1  # a made-up option

    real = train_config.option_sections
    monkeypatch.setattr(train_config, "option_sections",
                        lambda section: {**real(section), **({"fam_a": Made, "fam_b": Made} if section == "draft"
                                                             else {})})
    with pytest.raises(ConfigError) as err:
        train_config.upgrade_flat_keys([("override 'draft.foo=2'", {"draft": {"family": "eagle3", "foo": 2}})])
    msg = str(err.value)
    assert "\n" not in msg and "draft.fam_a.foo or draft.fam_b.foo" in msg and "trains eagle3" in msg, msg
    # the run's own family has it: no ambiguity
    [(_, tree)] = train_config.upgrade_flat_keys([("x", {"draft": {"family": "fam_b", "foo": 2}})], note=print)
    assert tree["draft"] == {"family": "fam_b", "fam_b": {"foo": 2}}


def test_resuming_a_run_whose_config_yaml_has_the_old_flat_keys(tmp_path):
    """The loop's resume check (train/loop.py) on a run directory written before the family sections: the same
    config resumes; a changed family option is refused, named by its new key."""
    from train.loop import _check_resumed_config

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step40").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(open(FLAT_RUN_CONFIG).read())
    cfg = load_train_config([FLAT_RUN_CONFIG], [f"run_dir={run_dir}", "resume=auto"])
    _check_resumed_config(cfg, run_dir, run_dir / "checkpoints")  # no change: resumes
    changed = load_train_config([FLAT_RUN_CONFIG], [f"run_dir={run_dir}", "resume=auto",
                                                       "draft.eagle3.ttt_steps=4", "draft.num_heads=4"])
    with pytest.raises(ValueError, match=r"draft\.eagle3\.ttt_steps: 3 -> 4"):
        _check_resumed_config(changed, run_dir, run_dir / "checkpoints")


def test_the_checked_in_configs_use_the_nested_keys():
    """Every YAML under configs/ (recipes, overlays, compare and eval configs) and the launch / recipe scripts'
    overrides are read without a note: none still writes a flat family key."""
    from pathlib import Path

    from train.config import upgrade_flat_keys

    root = Path(__file__).resolve().parents[1]
    notes = []
    for path in sorted((root / "configs").rglob("*.yaml")):
        tree = yaml.safe_load(path.read_text()) or {}
        if isinstance(tree, dict) and ("draft" in tree or "loss" in tree):
            upgrade_flat_keys([(str(path.relative_to(root)), tree)], note=notes.append)
    assert not notes, notes
    flat = [f"{k}=" for k in flat_key_owners()]
    for script in sorted([*(root / "recipes").glob("*.sh"), *(root / "launch").glob("*.sh")]):
        text = script.read_text()
        assert not [k for k in flat if f" {k}" in text], script.name
