"""`specdraft tune`'s choices applied where they were measured (the tuning itself is eval/tune/sweep.py and its
engines): our decoder's shape in an eval config (`specdraft eval`, `specdraft field`), and vLLM's token count in an
export (`specdraft export --format vllm / speculators`); `serving_here` says where serve-check's engine runs. A
choice measured on another device, CPU, dtype, thread count or engine version is named and left unused, with the
command that tunes for this machine (eval/choice/record.py: applicable).

`cfg` is an eval config (eval/harness/config.py: EvalConfig), read by its fields: this module sits below the
harness, which applies tuning.json through it (docs/architecture.md, the layer rule)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from eval.choice.record import (
    applicable,
    describe_choice,
    engine_device,
    machine_info,
    retune_command,
    tuned_choice,
    tuned_num_speculative_tokens,
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


# -- which shape a run decodes: the one rule ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a run's draft shape comes from (`decide`). source: "config" (the run's own shape), "tuning.json" (the
    export's tuned choice) or "export" (the export's default: its config.json, else the family's defaults). status
    says why: "untuned" (no choice for the engine), "config" (the config names a shape), "use_tuning=false",
    "elsewhere" (measured on another machine / dtype / threads / version: `why` names the field), "no speculation"
    (the choice is "do not speculate"), "applied". here: where the run is, when the choice was compared with it."""

    source: str
    status: str
    choice: dict | None = None
    why: str = ""
    here: dict | None = None


def decide(export_dir, engine: str, here: Callable[[], dict], *, config_sets: Sequence[str] = (),
           use_tuning: bool = True) -> Decision:
    """The precedence of a run's shape, which every reader of tuning.json applies (our decoder in `specdraft eval` /
    `field`, vLLM's count in `export --format vllm`, the serving chain in `serve-check`; docs/howto/evaluate.md,
    "Which shape a run decodes"):

    1. the config: a config that names a shape (`config_sets`: eval's tree, tree_choices or any of the family's
       options) decodes that shape; use_tuning=false keeps tuning.json out too;
    2. tuning.json: the export's choice for `engine`, where it was measured (`applicable` against `here()`, called
       only when needed) and when it speculates;
    3. the export: its config.json (the options it carries, e.g. a P-EAGLE draft's chain; vLLM's trained depth),
       else the family's defaults (eval/engine/drafters/options.py: parse_options reads an option from the
       config, else the export, else the default).

    A tuned choice is one measured setting, so it applies whole or not at all: a config that sets one option of a
    shape is never completed from tuning.json."""
    choice = tuned_choice(export_dir, engine)
    own = "config" if config_sets else "export"
    if choice is None:
        return Decision(own, "untuned")
    if not use_tuning:
        return Decision(own, "use_tuning=false", choice, "use_tuning=false")
    if config_sets:
        return Decision("config", "config", choice, f"the config sets {', '.join(config_sets)}")
    where = here()
    ok, why = applicable(choice, where)
    if not ok:
        return Decision("export", "elsewhere", choice, why, where)
    if not choice["speculate"]:
        return Decision("export", "no speculation", choice, "do not speculate", where)
    return Decision("tuning.json", "applied", choice, "", where)


def shape_keys_set(cfg, family: str) -> list[str]:
    """The shape keys an eval config sets itself: any of the family's options (extra.*), tree, tree_choices."""
    from eval.engine.drafters.registry import drafter_family

    own = [k for k in drafter_family(family).option_names() if k in cfg.extra]
    if cfg.tree != "auto" or cfg.tree_choices:
        own.append("tree" if cfg.tree != "auto" else "tree_choices")
    return own


def tuned_eval_config(cfg, export_dir, family: str) -> tuple[object, str | None]:
    """`specdraft eval` / `field`: the eval config with our decoder's tuned shape where `decide` picks tuning.json,
    and the line to print about it (None: nothing tuned)."""
    d = decide(export_dir, "ours", lambda: ours_here(cfg), config_sets=shape_keys_set(cfg, family),
               use_tuning=cfg.use_tuning)
    if d.status == "untuned":
        return cfg, None
    if d.status in ("config", "use_tuning=false"):
        return cfg, f"{describe_choice('ours', d.choice)}; not applied: {d.why}"
    if d.status == "elsewhere":
        return cfg, (f"tuning.json's choice for ours not applied: {d.why}; tune for this machine: "
                     f"{retune_command(export_dir, 'ours', d.here['threads'], d.here['dtype'])}")
    if d.status == "no speculation":
        return cfg, f"{describe_choice('ours', d.choice)}; evaluating the export's default shape"
    return apply_knobs(cfg, d.choice["knobs"]), f"using {describe_choice('ours', d.choice)}"


def untuned_speed(cfg, export_dir, family: str) -> dict | None:
    """`specdraft eval`: when the run decodes the export's default shape because no tuning.json choice applies here
    (status "untuned": none for our decoder; "elsewhere": measured on another machine / dtype / threads / version),
    what the summary's first line says: {"status", "why", "retune_command"}. None when the shape is tuned here, or
    is the config's own, or tuning.json says not to speculate."""
    d = decide(export_dir, "ours", lambda: ours_here(cfg), config_sets=shape_keys_set(cfg, family),
               use_tuning=cfg.use_tuning)
    if d.source != "export" or d.status not in ("untuned", "elsewhere"):
        return None
    here = d.here or ours_here(cfg)
    why = d.why if d.status == "elsewhere" else "the export has no tuning.json choice for our decoder"
    return {"status": d.status, "why": why,
            "retune_command": retune_command(export_dir, "ours", here["threads"], here["dtype"])}


def apply_knobs(cfg, knobs: dict):
    """An eval config with a setting's overrides: tree / tree_choices replace, extra merges."""
    knobs = dict(knobs)
    extra = {**cfg.extra, **knobs.pop("extra", {})}
    return dataclasses.replace(cfg, **knobs, extra=extra)


def vllm_export_config(export_dir, config: dict, trained: int | None = None) -> tuple[dict, str | None]:
    """`specdraft export --format vllm / speculators`: the export's config.json with tune's vLLM token count
    (models/export/vllm.py TUNED_TOKENS_KEY) kept only where `decide` picks tuning.json (this machine's device and
    CPU / GPU: an export cannot know the dtype or threads it will be served with), and the line to print. A "do
    not speculate" choice is said in one line: the export still speculates, at the trained depth (`trained`, when
    known), since a vLLM draft export exists to speculate."""
    from models.export.vllm import TUNED_SCHEDULE_KEY, TUNED_TOKENS_KEY

    def here() -> dict:
        machine = machine_info(device=_vllm_device())
        return {k: machine[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}

    d = decide(export_dir, "vllm", here)
    if d.status == "untuned":
        return config, None
    depth = f" ({trained} tokens)" if trained else ""
    if d.status == "elsewhere":
        config = {k: v for k, v in config.items() if k not in (TUNED_TOKENS_KEY, TUNED_SCHEDULE_KEY)}
        return config, (f"tuning.json's vLLM choice not applied: {d.why}; the export speculates at the trained "
                        f"depth{depth}; tune for this machine: {retune_command(export_dir, 'vllm')}")
    schedule = config.get(TUNED_SCHEDULE_KEY)
    per_batch = (f"; per batch size (tune --concurrency): num_speculative_tokens_per_batch_size {schedule}"
                 if schedule else "")
    if d.status == "no speculation" and schedule:
        return config, f"{describe_choice('vllm', d.choice)} for one request{per_batch}"
    if d.status == "no speculation":
        return config, (f"{describe_choice('vllm', d.choice)}: tuning found that speculation does not pay on vLLM "
                        f"on that machine; this export still speculates at the trained depth{depth}; serve the base "
                        "without --speculative-config there")
    return config, f"using {describe_choice('vllm', d.choice)}{per_batch}"


def tuned_serving_chain(cfg, export_dir, engines: Sequence[str], family: str,
                        llamacpp_version: str | None = None) -> tuple[int | None, str]:
    """`serve-check`: the chain length `specdraft tune` chose for the engine the check is about (vLLM where it runs,
    else llama.cpp) where `decide` picks tuning.json, and the line that says so; (None, line) when the check runs
    the draft's trained chain. Every engine's record keeps the count as num_speculative_tokens (record.py:
    TOKENS_KNOB; llama.cpp is given it as --spec-draft-n-max)."""
    from models.registry import family_facts

    engine = "vllm" if "vllm" in engines else "llamacpp"
    d = decide(export_dir, engine, lambda: serving_here(engine, cfg, llamacpp_version), use_tuning=cfg.use_tuning)
    if d.status == "untuned":
        return None, ""
    line = describe_choice(engine, d.choice)
    if d.status == "use_tuning=false":
        return None, f"{line}; not applied (use_tuning=false): checking the draft's trained chain"
    if d.status == "elsewhere":  # measured on another machine, dtype, thread count or version
        return None, (f"tuning.json's choice for {engine} not applied: {d.why}; checking the draft's trained chain; "
                      f"tune for this machine: {retune_command(export_dir, engine, d.here.get('threads'))}")
    if d.status == "no speculation":
        return None, f"{line}; checking the draft's trained chain"
    facts = family_facts(family)
    if facts.llamacpp_whole_block and "llamacpp" in engines:  # llama.cpp drafts DFlash's whole block only
        return None, f"{line}; not applied: llama.cpp checks a {facts.title} draft's whole block"
    knobs = d.choice["knobs"]
    if knobs.get("p_min"):  # serve-check passes --spec-draft-n-max only (llama.cpp keeps its default p-min)
        line += f"; applying n-max {tuned_num_speculative_tokens(knobs)} only, not its p-min {knobs['p_min']:g}"
    return tuned_num_speculative_tokens(knobs), f"using {line}"


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
