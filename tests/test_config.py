"""Typed config: defaults, YAML deltas, overrides, and errors that name the key and the fix."""

import pytest

from core.config_loader import ConfigError
from train.config import TrainConfig, load_train_config


def _yaml(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_then_yaml_then_overrides(tmp_path):
    a = _yaml(tmp_path, "train:\n  lr: 0.002\n  micro_batch_size: 2\n", "a.yaml")
    b = _yaml(tmp_path, "train:\n  lr: 0.003\ndraft:\n  num_heads: 3\n", "b.yaml")
    cfg = load_train_config([a, b], ["train.lr=4e-4", "run_name=x"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.train.lr == pytest.approx(4e-4)  # the override wins over both files
    assert cfg.train.micro_batch_size == 2  # from a.yaml, untouched by b.yaml
    assert cfg.draft.num_heads == 3
    assert cfg.draft.num_layers == 1  # default in code
    assert str(cfg.resolved_run_dir) == "runs/x"


def test_shipped_recipes_load():
    cfg = load_train_config(["configs/medusa.yaml", "configs/smoke.yaml", "configs/deepspeed/zero2.yaml"])
    assert cfg.base.path == "tiny" and cfg.deepspeed.zero_stage == 2 and cfg.draft.family == "medusa"
    cfg = load_train_config(["configs/medusa.yaml", "configs/cpu_budget.yaml", "configs/deepspeed/zero3.yaml"])
    assert cfg.deepspeed.zero_stage == 3 and cfg.draft.share_lm_head  # ZeRO-3 works with the shared head


def test_demo_recipe_and_its_eval_tree_fit_together():
    """`specdraft demo` stacks configs/demo.yaml on cli.demo.RECIPE; its eval tree must fit the draft's heads
    (build_drafter refuses a tree deeper than num_heads) and the draft must train from the hidden cache."""
    from cli.demo import RECIPE
    from eval.harness.config import load_eval_config

    cfg = load_train_config([f"configs/{RECIPE}", "configs/demo.yaml"])
    assert cfg.base.path == "smollm2" and cfg.data.hidden_cache == "auto" and cfg.train.epochs > 1
    ecfg = load_eval_config(["configs/eval/demo.yaml"])
    assert ecfg.tree_choices and max(len(c) for c in ecfg.tree_choices) <= cfg.draft.num_heads
    assert ecfg.dtype == "fast" and ecfg.ar_baseline and ecfg.hf_baseline  # both baselines, side by side
    assert cfg.train.precision == "fast"  # bf16 only where the CPU runs it fast (core.hardware.fast_dtype)


@pytest.mark.parametrize("text, key, suggestion", [
    ("train:\n  lrr: 0.1\n", "train.lrr", "train.lr"),
    ("draft:\n  num_head: 2\n", "draft.num_head", "draft.num_heads"),
    ("trian:\n  lr: 0.1\n", "trian", "train"),
])
def test_unknown_keys_rejected_with_closest_names(tmp_path, text, key, suggestion):
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_train_config([path])
    msg = str(e.value)
    assert path in msg and f"'{key}'" in msg and f"'{suggestion}'" in msg


def test_unknown_override_key_rejected():
    with pytest.raises(ConfigError, match=r"override 'train.warmup=0.1'.*did you mean 'train.warmup_ratio'"):
        load_train_config([], ["train.warmup=0.1"])


@pytest.mark.parametrize("override, key", [
    ("train.lr=0", "train.lr"),
    ("train.lr=-1e-3", "train.lr"),
    ("draft.num_heads=0", "draft.num_heads"),
    ("train.global_batch_size=10", "train.global_batch_size"),  # default micro batch 4 does not divide 10
    ("draft.family=eagle", "draft.family"),
    ("train.precision=fp8", "train.precision"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
    ("deepspeed.zero_stage=3", "deepspeed.zero_stage"),  # own LM heads: not with ZeRO-3 (see validate)
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("resume=/no/such/checkpoint", "resume"),
])
def test_invalid_values_fail_at_load_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_train_config([], [override])
    assert f"{key}=" in str(e.value)


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="train.lr"):
        load_train_config([], ["train.lr=fast"])


def test_malformed_inputs(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_train_config([str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="key=value"):
        load_train_config([], ["train.lr"])
    with pytest.raises(ConfigError, match="section"):
        load_train_config([_yaml(tmp_path, "train: 3\n")])


def test_deepspeed_extra_passes_through(tmp_path):
    from train.ds_config import build_deepspeed_config

    text = "deepspeed:\n  zero_stage: 2\n  extra:\n    zero_optimization:\n      round_robin_gradients: true\n"
    path = _yaml(tmp_path, text)
    cfg = load_train_config([path], ["train.global_batch_size=16", "train.micro_batch_size=4"])
    ds = build_deepspeed_config(cfg, world_size=2, precision="fp32")
    assert ds["gradient_accumulation_steps"] == 2  # 16 / (4 x 2 ranks)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["round_robin_gradients"] is True
    with pytest.raises(ValueError, match="not divisible"):
        build_deepspeed_config(cfg, world_size=3, precision="fp32")
