"""A few seconds' measurement of how fast this machine runs the demo's base: what `cli/demo_plan.py` sizes the
demo by.

It times the forward the hidden-state cache build runs (`models.base.HiddenStates`: the base body, no [B, T, V]
logits) on micro-batches of the cache build's shape (4 rows; PROBE_LENGTH tokens each), in the dtype the cache
will be built in, and returns real tokens per second. The cache build is the demo's largest cost, and the
training and decoding costs scale with the same matmul speed (dtype and CPU), so this one number is enough for
the plan's estimates.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from core.atomic import write_text_atomic

PROBE_ROWS = 4  # the demo's train.micro_batch_size: the cache build's batch
PROBE_LENGTH = 256  # tokens a row; the planner scales to other lengths (cli/demo_plan.py: _cost_per_token)
MIN_SECONDS = 2.5  # timed forwards run until this much time has passed (and at least MIN_RUNS of them)
MIN_RUNS = 2


@torch.no_grad()
def probe_forward_speed(model: torch.nn.Module, *, rows: int = PROBE_ROWS, length: int = PROBE_LENGTH,
                        min_seconds: float = MIN_SECONDS, min_runs: int = MIN_RUNS) -> float:
    """Tokens per second of the base's hidden-state forward over [rows, length] token batches, on the model's
    device and dtype. The fastest of the timed runs counts: a run slowed by another process says nothing about
    the machine, and the plan must be the same on a rerun (docs/quickstart.md, "The demo")."""
    from models.base import HiddenStates

    forward = HiddenStates(model)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)  # fixed ids: the same work on every run (matmul speed ignores them)
    ids = torch.randint(0, int(model.config.vocab_size), (rows, length), generator=gen).to(device)
    attn = torch.ones_like(ids)
    forward(ids[:, :16], attn[:, :16])  # warm-up: oneDNN / MKL pick their kernels on the first call
    best, runs, t_start = float("inf"), 0, time.perf_counter()
    while runs < min_runs or time.perf_counter() - t_start < min_seconds:
        t0 = time.perf_counter()
        forward(ids, attn)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return rows * length / best


def decode_speed(base_path: str, eval_overrides: list[str], device: torch.device,
                 chat_template: str | None = None) -> tuple[float | None, str, str]:
    """(tokens/s of one-token AR decoding, the dtype decoded in, where the number comes from) for the base the demo
    decodes, as its eval will (configs/eval/demo.yaml with `eval_overrides`: the demo's dtype and the user's eval.*
    keys, so the same dtype, backend and threads), the dtype resolved as the eval resolves it (`fast`: the
    decode-dtype probe's choice on this CPU, eval/harness/run_dtype.py). Where that probe ran (or is cached) its
    one-token step is read; elsewhere (fp32 on a CPU without bf16 instructions, an explicit dtype) the step is timed
    here the same way (eval/engine/dtype_probe.py: time_decode_steps). (None, dtype, why) on CUDA: the plan then
    prices decoding from the bulk probe."""
    from cli import CONFIGS
    from eval.harness.config import load_eval_config

    cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")], eval_overrides)
    saved = torch.get_num_threads()
    if cfg.num_threads:  # the eval's threads (the demo's eval sets them the same way)
        torch.set_num_threads(cfg.num_threads)
    try:
        return _decode_speed(cfg, base_path, device, chat_template)
    finally:
        torch.set_num_threads(saved)


def _decode_speed(cfg, base_path: str, device: torch.device, chat_template: str | None):
    """decode_speed once the eval config is loaded and its threads set."""
    from core.dtype_phases import dtype_name
    from core.hardware import resolve_dtype
    from eval.engine.backends.choice import make_backend
    from eval.engine.dtype_probe import time_decode_steps
    from eval.harness.run_dtype import decode_dtypes
    from models.base import load_base

    cfg, phases = decode_dtypes(cfg, base_path)
    decode = dtype_name(resolve_dtype(phases.decode, device))
    if phases.probe and decode in phases.probe.get("ms", {}):
        return 1e3 / phases.probe["ms"][decode]["1"], decode, "the decode-dtype probe"
    if device.type != "cpu":
        return None, decode, f"not measured on {device.type}"
    base = load_base(base_path, dtype=decode, device=device, chat_template=chat_template)
    backend = make_backend(cfg.backend, base.model)
    ms = time_decode_steps({decode: backend}, vocab_size=int(base.model.config.vocab_size))
    return 1e3 / ms[decode]["1"], decode, "timed one-token steps"


def machine_key(dtype: str, device: torch.device) -> str:
    """What a speed class belongs to: the processor, the thread count, the device and the dtype."""
    from core.hardware import device_name

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{device_name(device)} {model} {dtype}".strip()


def _classes_path() -> Path:
    from core.paths import default_cache_dir

    return default_cache_dir() / "demo" / "speed_classes.json"


def remembered_class(key: str) -> int | None:
    """The speed class the last demo on this machine used (cli/demo_plan.py: speed_class's hysteresis), or None."""
    try:
        value = json.loads(_classes_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: measure afresh
        return None
    return value if isinstance(value, int) else None


def remember_class(key: str, k: int) -> None:
    path = _classes_path()
    try:
        table = json.loads(path.read_text())
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    table[key] = k
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(table, indent=1, sort_keys=True) + "\n")
