"""The shape `specdraft tune` chose for our decoder, applied to an eval config (`specdraft eval`; the tuning itself
is eval/harness/tune.py + tune_ours.py)."""

from __future__ import annotations

import dataclasses

from eval.harness.config import EvalConfig


def tuned_eval_config(cfg: EvalConfig, export_dir, family: str) -> tuple[EvalConfig, str | None]:
    """`specdraft eval`: the eval config with our decoder's tuned shape from the export's tuning.json, and the line
    to print about it. The config's own shape wins (tree, tree_choices, any of the family's extra options, or
    use_tuning=false): then the tuning is named and left unused."""
    from eval.engine.drafters.registry import drafter_family
    from eval.harness.tune import describe_choice, tuned_choice

    choice = tuned_choice(export_dir, "ours")
    if choice is None:
        return cfg, None
    own = [k for k in drafter_family(family).option_names() if k in cfg.extra]
    if cfg.tree != "auto" or cfg.tree_choices:
        own.append("tree" if cfg.tree != "auto" else "tree_choices")
    if not cfg.use_tuning or own:
        why = "use_tuning=false" if not cfg.use_tuning else f"the config sets {', '.join(own)}"
        return cfg, f"{describe_choice('ours', choice)}; not applied: {why}"
    if not choice["speculate"]:
        return cfg, f"{describe_choice('ours', choice)}; evaluating the export's default shape"
    return apply_knobs(cfg, choice["knobs"]), f"using {describe_choice('ours', choice)}"


def apply_knobs(cfg: EvalConfig, knobs: dict) -> EvalConfig:
    """An eval config with a setting's overrides: tree / tree_choices replace, extra merges."""
    knobs = dict(knobs)
    extra = {**cfg.extra, **knobs.pop("extra", {})}
    return dataclasses.replace(cfg, **knobs, extra=extra)
