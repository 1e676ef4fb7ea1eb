"""`specdraft tune`'s choices applied where they were measured (the tuning itself is eval/tune/sweep.py and its
engines): our decoder's shape in an eval config (`specdraft eval`, `specdraft field`), and vLLM's token count in an
export (`specdraft export --format vllm / speculators`); `serving_here` says where serve-check's engine runs. A
choice measured on another device, CPU, dtype, thread count or engine version is named and left unused, with the
command that tunes for this machine (eval/tune/choice/record.py: applicable).

`cfg` is an eval config (eval/harness/config.py: EvalConfig), read by its fields: this module sits below the
harness, which applies tuning.json through it (docs/architecture.md, the layer rule)."""

from __future__ import annotations

import dataclasses

from eval.tune.choice.record import (
    applicable,
    describe_choice,
    engine_device,
    machine_info,
    retune_command,
    tuned_choice,
)


def ours_here(cfg) -> dict:
    """Where this eval runs, in record.py's WHERE_FIELDS: device, CPU / GPU, the base's dtype, torch's threads (set
    from num_threads before the eval loads anything), specdraft's version (as eval/tune/ours.py records it)."""
    from importlib import metadata

    import torch

    from core.hardware import resolve_device, resolve_dtype

    device = resolve_device(cfg.device)
    try:
        version = metadata.version("specdraft")
    except metadata.PackageNotFoundError:
        version = "unknown"
    machine = machine_info(device=str(device))
    return {**{k: machine[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")},
            "dtype": str(resolve_dtype(cfg.dtype, device)).removeprefix("torch."),
            "threads": torch.get_num_threads(), "version": f"specdraft {version}"}


def tuned_eval_config(cfg, export_dir, family: str) -> tuple[object, str | None]:
    """`specdraft eval`: the eval config with our decoder's tuned shape from the export's tuning.json, and the line
    to print about it. The config's own shape wins (tree, tree_choices, any of the family's extra options, or
    use_tuning=false), and a choice measured elsewhere (another device, CPU, dtype, thread count, version) is not
    applied: then the tuning is named and left unused."""
    from eval.engine.drafters.registry import drafter_family

    choice = tuned_choice(export_dir, "ours")
    if choice is None:
        return cfg, None
    own = [k for k in drafter_family(family).option_names() if k in cfg.extra]
    if cfg.tree != "auto" or cfg.tree_choices:
        own.append("tree" if cfg.tree != "auto" else "tree_choices")
    if not cfg.use_tuning or own:
        why = "use_tuning=false" if not cfg.use_tuning else f"the config sets {', '.join(own)}"
        return cfg, f"{describe_choice('ours', choice)}; not applied: {why}"
    here = ours_here(cfg)
    ok, why = applicable(choice, here)
    if not ok:
        return cfg, (f"tuning.json's choice for ours not applied: {why}; tune for this machine: "
                     f"{retune_command(export_dir, 'ours', here['threads'])}")
    if not choice["speculate"]:
        return cfg, f"{describe_choice('ours', choice)}; evaluating the export's default shape"
    return apply_knobs(cfg, choice["knobs"]), f"using {describe_choice('ours', choice)}"


def apply_knobs(cfg, knobs: dict):
    """An eval config with a setting's overrides: tree / tree_choices replace, extra merges."""
    knobs = dict(knobs)
    extra = {**cfg.extra, **knobs.pop("extra", {})}
    return dataclasses.replace(cfg, **knobs, extra=extra)


def vllm_export_config(export_dir, config: dict, trained: int | None = None) -> tuple[dict, str | None]:
    """`specdraft export --format vllm / speculators`: the export's config.json with tune's vLLM token count
    (models/export/vllm.py TUNED_TOKENS_KEY) kept only where the choice applies (this machine's device and CPU /
    GPU: an export cannot know the dtype or threads it will be served with), and the line to print. A "do not
    speculate" choice is said in one line: the export still speculates, at the trained depth (`trained`, when
    known), since a vLLM draft export exists to speculate."""
    from models.export.vllm import TUNED_SCHEDULE_KEY, TUNED_TOKENS_KEY

    choice = tuned_choice(export_dir, "vllm")
    if choice is None:
        return config, None
    machine = machine_info(device=_vllm_device())
    ok, why = applicable(choice, {k: machine[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")})
    depth = f" ({trained} tokens)" if trained else ""
    if not ok:
        config = {k: v for k, v in config.items() if k not in (TUNED_TOKENS_KEY, TUNED_SCHEDULE_KEY)}
        return config, (f"tuning.json's vLLM choice not applied: {why}; the export speculates at the trained "
                        f"depth{depth}; tune for this machine: {retune_command(export_dir, 'vllm')}")
    schedule = config.get(TUNED_SCHEDULE_KEY)
    per_batch = (f"; per batch size (tune --concurrency): num_speculative_tokens_per_batch_size {schedule}"
                 if schedule else "")
    if not choice["speculate"] and schedule:
        return config, f"{describe_choice('vllm', choice)} for one request{per_batch}"
    if not choice["speculate"]:
        return config, (f"{describe_choice('vllm', choice)}: tuning found that speculation does not pay on vLLM on "
                        f"that machine; this export still speculates at the trained depth{depth}; serve the base "
                        "without --speculative-config there")
    return config, f"using {describe_choice('vllm', choice)}{per_batch}"


def _vllm_device() -> str:
    return engine_device("vllm")


def serving_here(engine: str, cfg, llamacpp_version: str | None = None) -> dict:
    """Where a serving engine runs in this serve-check, in the terms tune records (record.py: WHERE_FIELDS). vLLM:
    device, CPU / GPU and the base's dtype (its version is known only once it runs; it uses its own threads);
    llama.cpp: device, CPU, the GGUF types, -t/-td threads and `llamacpp_version`, the pinned llama.cpp
    (eval/serving/llamacpp_paths.py LLAMACPP_VERSION), as eval/tune/serving.py describes them."""
    from core.hardware import resolve_device, resolve_dtype

    machine = machine_info(device=engine_device(engine))
    here = {k: machine[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}
    if engine == "llamacpp":
        return {**here, "dtype": f"base {cfg.serve_llamacpp_base_type}, draft {cfg.serve_llamacpp_draft_type} GGUF",
                "threads": cfg.serve_llamacpp_threads, "version": llamacpp_version}
    return {**here, "dtype": str(resolve_dtype(cfg.dtype, resolve_device(cfg.device))).removeprefix("torch.")}
