"""`specdraft tune`: the sweep, engine-agnostic (docs/howto/serve.md, "Tune").

An engine (ours, vLLM, llama.cpp; eval/harness/tune_ours.py, eval/serving/tune_engines.py, or a scripted one in the
tests) lists its speculation settings and opens a session per setting; a session decodes the whole prompt set
once per `run()`. Per setting, the engine's AR session and the setting's session stay open side by side and
alternate A B, B A, A B, ... (`repeats` pairs): a machine that slows down for a minute slows both sides of a pair,
so the pair's ratio survives where two separate runs would not. The setting's speedup is the median of its paired
ratios; its noise is half the range of those ratios, never below `noise_floor`.

The choice: AR ("do not speculate") is a candidate at speedup 1.0 and cost 0. A candidate is out when another one
is faster by more than the noise of either (the larger of the two); of the candidates left, which are all tied
within the noise, the cheapest (fewest tokens drafted / verified per step) wins. So a setting must beat AR by more
than the noise to be chosen, a longer chain must beat a shorter one by more than the noise, and one noisy setting
cannot drag the choice back to AR when a steady one clearly beats it.

tuning.json (TUNING_FILE, in the export) keeps, per engine, its version, dtype, threads, the prompts, every point
(paired runs, acceptance, failures with the engine's last log lines) and the choice; `tuned_choice` reads it back
for `specdraft eval` and `serve-check`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from core.atomic import write_text_atomic

TUNING_FILE = "tuning.json"
TUNING_FORMAT = 1
ENGINE_NAMES = ("ours", "vllm", "llamacpp")
DEFAULT_NOISE_FLOOR = 0.03  # 3 %: paired ratios on a quiet 2-core CPU scatter about this much (docs/lab/serving.md)


class EngineUnavailable(RuntimeError):
    """The engine is not installed or cannot serve this draft at all; the message says how to fix it."""


class PointFailed(RuntimeError):
    """One setting crashed or hung; `log_tail` holds the engine's last log lines."""

    def __init__(self, message: str, log_tail: Sequence[str] = ()):
        super().__init__(message)
        self.log_tail = list(log_tail)


class BudgetTooSmall(ValueError):
    """The budget cannot cover one setting per engine (AR + one point, every repeat)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of an engine's sweep. knobs: what the engine applies (JSON-able; {} = plain AR decoding).
    cost: tokens drafted (or verified besides the root) per step, the tie-break: lower is cheaper."""

    label: str
    knobs: dict
    cost: float

    @property
    def speculative(self) -> bool:
        return bool(self.knobs)


AR = Setting("AR (no speculation)", {}, 0.0)


@dataclasses.dataclass
class Measurement:
    """One pass over the prompt set. tokens: decode tokens (the prefill's token excluded), seconds: decode seconds;
    steps / drafted / accepted when the engine reports them; outputs: generated ids per prompt id."""

    new_tokens: int
    seconds: float
    steps: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    outputs: dict | None = None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None


class Session(Protocol):
    def run(self) -> Measurement: ...

    def close(self) -> None: ...


class Engine(Protocol):
    """What the sweep needs of an engine. open_seconds / pass_seconds: a-priori guesses (seconds to open a session,
    seconds for one pass over the prompts) used only to refuse a budget up front; measured times replace them."""

    name: str
    open_seconds: float
    pass_seconds: float

    def describe(self) -> dict: ...

    def settings(self) -> list[Setting]: ...

    def open(self, setting: Setting) -> Session: ...


# -- budget ---------------------------------------------------------------------------------------------------

def min_seconds(engine: Engine, repeats: int) -> float:
    """The least one engine needs: its AR and one setting opened, `repeats` passes of each."""
    return 2 * engine.open_seconds + 2 * repeats * engine.pass_seconds


def check_budget(engines: Sequence[Engine], repeats: int, budget_s: float) -> None:
    need = sum(min_seconds(e, repeats) for e in engines)
    if budget_s < need:
        per = ", ".join(f"{e.name} {min_seconds(e, repeats) / 60:.1f}" for e in engines)
        raise BudgetTooSmall(f"a budget of {budget_s / 60:.2g} min cannot measure one setting per engine against "
                             f"its AR ({repeats} paired repeats; estimated minutes: {per}); give --budget-minutes "
                             f"{math.ceil(need / 60)} or more, or fewer prompts / tokens / repeats")


# -- the sweep ------------------------------------------------------------------------------------------------

def _ratio_stats(ratios: list[float], floor: float) -> tuple[float, float]:
    speed = statistics.median(ratios)
    noise = (max(ratios) - min(ratios)) / 2 if len(ratios) > 1 else 0.0
    return speed, max(floor, noise)


def _point_record(setting: Setting, pairs: list[tuple[Measurement, Measurement]], floor: float) -> dict:
    """A measured setting: paired AR / point passes -> speedup, noise, acceptance, agreement with AR."""
    ratios = [p.tokens_per_second / a.tokens_per_second for a, p in pairs
              if a.tokens_per_second and p.tokens_per_second]
    if not ratios:
        return {**_setting_dict(setting), "status": "failed", "error": "no decode time measured (no tokens?)"}
    speed, noise = _ratio_stats(ratios, floor)
    last = pairs[-1][1]
    steps = sum(p.steps or 0 for _, p in pairs)
    tokens = sum(p.new_tokens for _, p in pairs)
    drafted = sum(p.drafted or 0 for _, p in pairs)
    accepted = sum(p.accepted or 0 for _, p in pairs)
    ar_out, pt_out = pairs[-1][0].outputs, last.outputs
    same = None
    if ar_out and pt_out:
        ids = [i for i in ar_out if i in pt_out]
        same = sum(ar_out[i] == pt_out[i] for i in ids) / len(ids) if ids else None
    return {**_setting_dict(setting), "status": "ok", "speedup": speed, "noise": noise, "ratios": ratios,
            "tokens_per_second": statistics.median(p.tokens_per_second for _, p in pairs if p.tokens_per_second),
            "ar_tokens_per_second": statistics.median(a.tokens_per_second for a, _ in pairs
                                                      if a.tokens_per_second),
            # tokens per engine step (steps without a draft included); the counts are summed over the repeats
            "acceptance_length": tokens / steps if steps else None,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "same_tokens_as_ar": same,
            "passes": [{"ar_tokens_per_second": a.tokens_per_second, "tokens_per_second": p.tokens_per_second}
                       for a, p in pairs]}


def _setting_dict(s: Setting) -> dict:
    return {"label": s.label, "knobs": s.knobs, "cost": s.cost}


def _failed(setting: Setting, exc: Exception, status: str = "failed") -> dict:
    return {**_setting_dict(setting), "status": status, "error": str(exc).splitlines()[0] if str(exc) else
            type(exc).__name__, "log_tail": list(getattr(exc, "log_tail", []))[-20:]}


class _Clock:
    """Budget bookkeeping: the deadline, and the seconds an open and a pass take (a-priori guesses until measured;
    then the slowest seen, so a setting slower than AR does not overrun the budget)."""

    def __init__(self, deadline: float, engine: Engine, now: Callable[[], float]):
        self.deadline, self.now = deadline, now
        self.open_s, self.pass_s = engine.open_seconds, engine.pass_seconds
        self.opened = self.passed = False

    def note_open(self, seconds: float) -> None:
        self.open_s = max(self.open_s, seconds) if self.opened else seconds
        self.opened = True

    def note_pass(self, seconds: float) -> None:
        self.pass_s = max(self.pass_s, seconds) if self.passed else seconds
        self.passed = True

    def fits(self, repeats: int) -> bool:
        return self.now() + self.open_s + 2 * repeats * self.pass_s <= self.deadline


def _open(engine: Engine, setting: Setting, clock: _Clock):
    t0 = clock.now()
    session = engine.open(setting)
    clock.note_open(clock.now() - t0)
    return session


def _run(session, clock: _Clock, is_ar: bool) -> Measurement:
    t0 = clock.now()
    try:
        m = session.run()
    except PointFailed as exc:
        exc.ar = is_ar  # the sweep must know whether the setting or its AR died
        raise
    clock.note_pass(clock.now() - t0)
    return m


def _pairs(ar, session, repeats: int, clock: _Clock) -> list[tuple[Measurement, Measurement]]:
    """`repeats` (AR, setting) pairs in the order A B, B A, A B, ...: drift within a pair hits both sides, and a
    trend across pairs cancels."""
    pairs = []
    for r in range(repeats):
        if r % 2 == 0:
            a = _run(ar, clock, True)
            p = _run(session, clock, False)
        else:
            p = _run(session, clock, False)
            a = _run(ar, clock, True)
        pairs.append((a, p))
    return pairs


def sweep_engine(engine: Engine, repeats: int, noise_floor: float, deadline: float,
                 progress: Callable[[str, dict | None], None] = lambda label, rec: None,
                 now: Callable[[], float] = time.monotonic) -> dict:
    """Every setting of `engine` against its AR, paired and interleaved; returns the engine's tuning record.
    A setting that crashes or hangs is recorded with the engine's last log lines and the sweep goes on (an AR that
    dies is reopened once); settings the budget cannot fit are recorded as skipped. `progress(label, record)` is
    called once per setting."""
    clock = _Clock(deadline, engine, now)
    settings = engine.settings()
    points: list[dict] = []
    try:
        ar = _open(engine, AR, clock)
    except PointFailed as exc:  # without its AR no setting of this engine can be judged
        for s in settings:
            progress(s.label, None)
        return {**engine.describe(), "status": "failed", "error": f"AR failed: {exc}",
                "log_tail": exc.log_tail[-20:], "points": [], "ar": None, "choice": None}
    ar_runs: list[float] = []
    error = None
    try:
        for setting in settings:
            if ar is None or not clock.fits(repeats):
                why = "budget spent" if ar is not None else "not measured: AR was lost"
                points.append({**_setting_dict(setting), "status": "skipped", "error": why})
                progress(setting.label, points[-1])
                continue
            try:
                session = _open(engine, setting, clock)
            except PointFailed as exc:
                points.append(_failed(setting, exc))
                progress(setting.label, points[-1])
                continue
            try:
                pairs = _pairs(ar, session, repeats, clock)
                ar_runs += [a.tokens_per_second for a, _ in pairs if a.tokens_per_second]
                points.append(_point_record(setting, pairs, noise_floor))
            except PointFailed as exc:
                if getattr(exc, "ar", False):
                    points.append(_failed(setting, PointFailed(f"AR died during this setting: {exc}",
                                                               exc.log_tail)))
                    ar.close()
                    try:
                        ar = _open(engine, AR, clock)
                    except PointFailed as again:
                        ar, error = None, f"AR died and could not be reopened: {again}"
                else:
                    points.append(_failed(setting, exc))
            finally:
                session.close()
            progress(setting.label, points[-1])
    finally:
        if ar is not None:
            ar.close()
    choice = choose(points, noise_floor)
    command = getattr(engine, "command", None)  # how a user serves the choice (llama.cpp: its command line)
    if command is not None:
        choice["command"] = command(Setting(choice["label"], choice["knobs"], choice["cost"]))
    return {**engine.describe(), "status": "ok" if error is None else "partial", "error": error, "points": points,
            "ar": {"tokens_per_second_runs": ar_runs,
                   "tokens_per_second": statistics.median(ar_runs) if ar_runs else None},
            "choice": choice}


def run_sweeps(engines: Sequence[Engine], repeats: int, noise_floor: float, budget_s: float,
               progress: Callable[[str, dict | None], None] = lambda label, rec: None,
               now: Callable[[], float] = time.monotonic) -> dict[str, dict]:
    """Each engine in turn, after refusing a budget that cannot fit one setting per engine. Each engine gets an
    equal share of what is left of the budget (at least its minimum), so the first cannot starve the last."""
    check_budget(engines, repeats, budget_s)
    end = now() + budget_s
    out: dict[str, dict] = {}
    for i, engine in enumerate(engines):
        left = end - now()
        rest = engines[i:]
        share = max(min_seconds(engine, repeats), left / len(rest))
        deadline = min(end, now() + share)
        try:
            out[engine.name] = sweep_engine(engine, repeats, noise_floor, deadline, progress, now)
        except EngineUnavailable as exc:  # e.g. vLLM has no method for this family: a result, not a crash
            out[engine.name] = {**engine.describe(), "status": "unservable", "error": str(exc), "points": [],
                                "ar": None, "choice": None}
    return out


# -- the choice -----------------------------------------------------------------------------------------------

def choose(points: Sequence[dict], noise_floor: float) -> dict:
    """The cheapest candidate no other one beats by more than the noise (module docstring); AR is one, at 1.0.
    Returns the chosen point (label, knobs, cost, speedup), its margin over AR and over the runner-up, and why."""
    ar = {"label": AR.label, "knobs": {}, "cost": 0.0, "speedup": 1.0, "noise": noise_floor}
    cands = [ar, *[p for p in points if p.get("status") == "ok"]]
    if len(cands) == 1:
        return {"label": AR.label, "knobs": {}, "cost": 0.0, "speculate": False, "speedup_vs_ar": 1.0,
                "noise": noise_floor, "runner_up": None, "runner_up_speedup": None, "margin_over_runner_up": None,
                "fastest": AR.label, "reason": "no setting was measured to the end (each failed or was skipped): "
                "nothing shown to beat AR"}
    fastest = max(cands, key=lambda p: p["speedup"])

    def beaten(p):  # some candidate is faster than p by more than the noise of either
        return any(q["speedup"] - p["speedup"] > max(p["noise"], q["noise"]) for q in cands)

    chosen = min((p for p in cands if not beaten(p)), key=lambda p: (p["cost"], -p["speedup"]))
    others = [p for p in cands if p is not chosen]
    runner = max(others, key=lambda p: p["speedup"])
    if chosen is ar:
        best = f"{runner['label']}: {runner['speedup']:.3f}x, noise {max(runner['noise'], noise_floor):.3f}"
        why = ("every setting is slower than AR" if fastest is ar else "no setting beats AR by more than the noise") \
            + f" ({best}): do not speculate on this engine and machine"
    elif chosen is fastest:
        why = "fastest"
        if not beaten(runner):  # only a dearer setting can be tied with the chosen one here
            why = f"fastest; {runner['label']} is inside the noise but dearer"
    else:
        why = (f"tied with the fastest ({fastest['label']}, {fastest['speedup']:.3f}x) within the noise "
               f"({max(fastest['noise'], chosen['noise']):.3f}): the cheaper setting wins")
    return {"label": chosen["label"], "knobs": chosen["knobs"], "cost": chosen["cost"],
            "speculate": bool(chosen["knobs"]), "speedup_vs_ar": chosen["speedup"],
            "noise": chosen["noise"], "runner_up": runner["label"], "runner_up_speedup": runner["speedup"],
            "margin_over_runner_up": chosen["speedup"] - runner["speedup"],
            "fastest": fastest["label"], "reason": why}


# -- machine and tuning.json ----------------------------------------------------------------------------------

def machine_info(cpuinfo: str | None = None) -> dict:
    """CPU model (lscpu's "Model name", from /proc/cpuinfo), core count, bf16 instructions, OS."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.lower().startswith("model name")), platform.processor() or platform.machine())
    flags = set(cpuinfo.split())
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "platform": platform.platform()}


def read_tuning(export_dir: Path) -> dict | None:
    """The export's tuning.json, or None when it has none. A damaged file is an error naming it."""
    path = Path(export_dir) / TUNING_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); delete it or rerun `specdraft tune`") from None
    if data.get("format") != TUNING_FORMAT or not isinstance(data.get("engines"), dict):
        raise ValueError(f"{path} is not a tuning.json of format {TUNING_FORMAT}; rerun `specdraft tune`")
    return data


def write_tuning(export_dir: Path, context: dict, engines: dict[str, dict]) -> Path:
    """Merge this run's engine records into the export's tuning.json (engines tuned earlier stay), atomically."""
    old = read_tuning(export_dir) or {"engines": {}}
    merged = {**old["engines"], **engines}
    data = {"format": TUNING_FORMAT, **context, "updated": _now(), "engines": merged}
    path = Path(export_dir) / TUNING_FILE
    write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def tuned_choice(export_dir: Path | None, engine: str) -> dict | None:
    """The engine's choice in the export's tuning.json, with where and how it was measured; None without one."""
    if export_dir is None:
        return None
    data = read_tuning(export_dir)
    rec = (data or {}).get("engines", {}).get(engine)
    if not rec or not rec.get("choice"):
        return None
    return {**rec["choice"], "machine": rec.get("machine", {}).get("cpu"), "dtype": rec.get("dtype"),
            "threads": rec.get("threads"), "tuned": rec.get("tuned")}


def describe_choice(engine: str, choice: dict) -> str:
    """One line: what tuning.json chose for `engine` and where it was measured."""
    where = f"{choice.get('machine') or '?'}, {choice.get('dtype') or '?'}, {choice.get('threads') or '?'} threads"
    if not choice.get("speculate"):
        return f"tuning.json: do not speculate on {engine} ({where}; {choice.get('reason', '')})"
    return (f"tuning.json: {engine} {choice['label']} ({choice['speedup_vs_ar']:.2f}x its AR on {where}, tuned "
            f"{choice.get('tuned') or '?'})")
