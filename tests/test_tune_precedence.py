"""Which shape a run decodes when the config, the export's tuning.json and the export itself each have one
(docs/howto/evaluate.md, "Which shape a run decodes"): the config beats tuning.json, which beats the export's
default (its config.json, else the family's defaults), one rule (eval/choice/apply.py: decide) for every
reader: our decoder's EAGLE-3 chain length in `specdraft eval`, vLLM's count in `export --format vllm`, the
serving chain in `serve-check`. No model is loaded: the shapes are read as the drafter would read them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eval.choice.apply import decide, ours_here, tuned_eval_config, tuned_serving_chain, vllm_export_config
from eval.choice.record import machine_info, write_tuning
from eval.choice.stats import choose
from eval.engine.drafters.options import parse_options
from eval.engine.drafters.registry import drafter_family
from eval.harness.config import EvalConfig, load_eval_config
from models.export.vllm import TUNED_TOKENS_KEY, speculative_tokens

EXPORT_CHAIN = 3  # the export's config.json (as a P-EAGLE export carries it); the Options default is 4
TUNED_CHAIN = 5


def _point(label: str, knobs: dict) -> dict:
    return {"label": label, "knobs": knobs, "cost": 1.0, "status": "ok", "speedup": 1.3, "ratios": [1.3] * 3,
            "ar_null": [0.0, 0.0]}


def _export(tmp_path, export_chain: int | None = EXPORT_CHAIN, *, elsewhere: bool = False) -> dict:
    """An EAGLE-3 export directory: config.json (with its own chain unless export_chain is None) and a
    tuning.json whose choices (ours: a chain of TUNED_CHAIN; vLLM: 2 tokens) were measured here, or on another
    CPU."""
    config = {"family": "eagle3", "ttt_steps": 3, TUNED_TOKENS_KEY: 2}
    if export_chain is not None:
        config.update(eagle3_mode="chain", num_speculative_tokens=export_chain)
    (tmp_path / "config.json").write_text(json.dumps(config))
    here = ours_here(EvalConfig())
    machine = {**{k: here[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}, "cores": 2}
    if elsewhere:
        machine["cpu"] = "Other CPU"
    ours = _point(f"chain {TUNED_CHAIN}",
                  {"tree_choices": None, "extra": {"eagle3_mode": "chain", "num_speculative_tokens": TUNED_CHAIN}})
    vllm = _point("num_speculative_tokens 2", {"num_speculative_tokens": 2})
    write_tuning(tmp_path, {}, {
        "ours": {"engine": "ours", "dtype": here["dtype"], "threads": here["threads"], "version": here["version"],
                 "machine": machine, "points": [ours], "choice": choose([ours])},
        "vllm": {"engine": "vllm", "dtype": "float32", "machine": {**machine_info(), "cpu": machine["cpu"]},
                 "points": [vllm], "choice": choose([vllm])}})
    return config


def chain_of(cfg: EvalConfig, export_dir, export_cfg: dict) -> tuple[int, str | None]:
    """The chain length our EAGLE-3 drafter would draft: the tuned config, then its options as build_drafter reads
    them (parse_options: extra, else the export's config.json, else the default)."""
    cfg, line = tuned_eval_config(cfg, export_dir, "eagle3")
    options = parse_options(drafter_family("eagle3").options, "eagle3", cfg.extra, export_cfg)
    return options.num_speculative_tokens, line


def test_config_beats_tuning_json_beats_the_export_for_our_decoder(tmp_path):
    export_cfg = _export(tmp_path)
    own = load_eval_config([], ["extra.eagle3_mode=chain", "extra.num_speculative_tokens=2"])
    assert chain_of(own, tmp_path, export_cfg)[0] == 2  # the config's own
    chain, line = chain_of(EvalConfig(), tmp_path, export_cfg)
    assert chain == TUNED_CHAIN and line.startswith("using tuning.json: ours chain 5")  # tuning.json
    chain, line = chain_of(EvalConfig(use_tuning=False), tmp_path, export_cfg)
    assert chain == EXPORT_CHAIN and line.endswith("not applied: use_tuning=false")  # the export's


def test_a_choice_applies_whole_or_not_at_all(tmp_path):
    """A config that sets one option of a shape (the mode) is not completed from tuning.json: the rest comes from
    the export."""
    export_cfg = _export(tmp_path)
    chain, line = chain_of(load_eval_config([], ["extra.eagle3_mode=chain"]), tmp_path, export_cfg)
    assert chain == EXPORT_CHAIN and line.endswith("not applied: the config sets eagle3_mode")


def test_a_choice_measured_elsewhere_leaves_the_export_default(tmp_path):
    export_cfg = _export(tmp_path, elsewhere=True)
    chain, line = chain_of(EvalConfig(), tmp_path, export_cfg)
    assert chain == EXPORT_CHAIN and "cpu: measured Other CPU" in line
    export_cfg = _export(tmp_path, None, elsewhere=True)  # an export without its own chain: the family default
    cfg, _ = tuned_eval_config(load_eval_config([], ["extra.eagle3_mode=chain"]), tmp_path, "eagle3")
    default = drafter_family("eagle3").options.num_speculative_tokens
    options = parse_options(drafter_family("eagle3").options, "eagle3", cfg.extra, export_cfg)
    assert options.num_speculative_tokens == default


def test_the_same_rule_sets_the_serving_chain_and_the_vllm_export(tmp_path):
    export_cfg = _export(tmp_path)
    cfg = EvalConfig()
    assert tuned_serving_chain(cfg, tmp_path, ("vllm",), "eagle3")[0] == 2  # tuning.json
    assert tuned_serving_chain(dataclasses.replace(cfg, use_tuning=False), tmp_path, ("vllm",), "eagle3")[0] is None
    config, _ = vllm_export_config(tmp_path, export_cfg, trained=3)
    assert speculative_tokens(config, 3) == 2  # tuning.json's count reaches vLLM's speculative_config
    export_cfg = _export(tmp_path, elsewhere=True)
    assert tuned_serving_chain(cfg, tmp_path, ("vllm",), "eagle3")[0] is None  # the trained chain
    config, line = vllm_export_config(tmp_path, export_cfg, trained=3)
    assert speculative_tokens(config, 3) == 3 and "not applied: cpu: measured Other CPU" in line


@pytest.mark.parametrize("config_sets, use_tuning, elsewhere, want", [
    ((), True, False, ("tuning.json", "applied")),
    (("num_speculative_tokens",), True, False, ("config", "config")),
    (("num_speculative_tokens",), False, False, ("config", "use_tuning=false")),
    ((), False, False, ("export", "use_tuning=false")),
    ((), True, True, ("export", "elsewhere")),
])
def test_decide(tmp_path, config_sets, use_tuning, elsewhere, want):
    _export(tmp_path, elsewhere=elsewhere)
    asked = []

    def here():
        asked.append(1)
        return ours_here(EvalConfig())

    d = decide(tmp_path, "ours", here, config_sets=config_sets, use_tuning=use_tuning)
    assert (d.source, d.status) == want
    assert bool(asked) == (want[0] != "config" and use_tuning)  # where the run is: asked only when compared
    assert decide(tmp_path / "none", "ours", here).status == "untuned"
