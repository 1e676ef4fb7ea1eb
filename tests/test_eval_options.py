"""A drafter option has one declaration, its family's `Options` dataclass (models/families/<family>/drafter.py), and
`extra.<key>=` sets it: typed against every family's declarations when the eval config loads (a typo fails before
any export or base loads), and checked again against the export's own family when its drafter is built."""

from __future__ import annotations

import pytest

from core.config_loader import ConfigError
from eval.engine.drafters.options import OptionsError, check_extra, parse_options
from eval.engine.drafters.registry import drafter_family
from eval.harness.config import load_eval_config


def test_extra_is_typed_when_the_config_loads():
    cfg = load_eval_config([], ["extra.eagle3_mode=chain", "extra.num_speculative_tokens=3.0", "extra.k=2"])
    assert cfg.extra == {"eagle3_mode": "chain", "num_speculative_tokens": 3, "k": 2}
    assert type(cfg.extra["num_speculative_tokens"]) is int


def test_an_undeclared_option_fails_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"unknown drafter option\(s\) \['num_speculative_token'\].*did you mean "
                                          r"num_speculative_tokens\?.*eagle3: eagle3_mode, num_speculative_tokens"):
        load_eval_config([], ["extra.num_speculative_token=3"])
    with pytest.raises(ConfigError, match=r"extra.num_speculative_tokens='three'.*needs a int"):
        load_eval_config([], ["extra.num_speculative_tokens=three"])


def test_the_exports_family_checks_its_own_options_at_build():
    """beam_width is ReDrafter's: the config loads, an EAGLE-3 export refuses it when its drafter is built."""
    cfg = load_eval_config([], ["extra.beam_width=4"])
    with pytest.raises(OptionsError, match=r"unknown eagle3 option\(s\) \['beam_width'\]"):
        parse_options(drafter_family("eagle3").options, "eagle3", cfg.extra, {})


def test_a_type_the_families_disagree_on_is_left_to_the_family():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class A:
        x: int = 1

    @dataclass(frozen=True)
    class B:
        x: str = "a"

    assert check_extra({"x": "7"}, {"a": A, "b": B}) == {"x": "7"}
    assert check_extra({"x": 7.0}, {"a": A}) == {"x": 7}
