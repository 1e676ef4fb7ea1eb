"""`specdraft tune`: the sweep, engine-agnostic (docs/howto/serve.md, "Tune").

An engine (ours, vLLM, llama.cpp; eval/tune/ours.py, eval/tune/serving.py, or a scripted one in the tests) lists
its speculation settings and opens a session per setting; a session decodes the whole prompt set once per `run()`.
Per setting, the engine's AR session and the setting's session stay open side by side and alternate A B, B A, A B,
... (`repeats` pairs): a machine that slows down for a minute slows both sides of a pair, so the pair's ratio
survives where two separate runs would not.

The statistics (eval/choice/stats.py) work in log ratios y = ln(setting tok/s / AR tok/s). A setting's speedup
is exp(mean y) over its pairs. The noise is one number for the whole sweep (`pooled_noise`): the pooled within-
setting variance of y over every measured setting, together with AR-vs-AR differences (consecutive AR passes of a
setting, whose true log ratio is 0), so that ten settings of two or three pairs each give one estimate with tens of
degrees of freedom instead of ten estimates from two or three numbers each. A setting's standard error is sd /
sqrt(its pairs).

The choice (`choose`): picking the best of K settings rewards the luckiest one, so every comparison is made at the
Bonferroni level alpha / K, one-sided (K = the settings compared). A setting beats AR when its speedup's lower bound
at that level exceeds 1 + min_gain (min_gain, a minimum effect size worth speculating for, 0 unless asked); one
setting beats another when their difference clears the same level. Of the settings that beat AR, those that another
one beats are out, and of the rest the cheapest (fewest tokens drafted / verified per step) wins; when none beats
AR the choice is "do not speculate". Then the winner is re-timed against AR in fresh sessions (`repeats` pairs; the
budget keeps room for it): those runs were not used to pick it, so their interval (CONFIDENCE, two-sided) is the
reported one, and when it does not clear 1 + min_gain the choice falls back to "do not speculate", saying why. In an
exact dtype (fp32) a setting whose tokens differ from AR's is not a candidate: it is a bug, recorded as one.

The engine records this module returns go into the export's tuning.json (eval/choice/record.py). The pieces
of one sweep (`Clock`, `open_session`, `paired_passes`, `point_record`, ...) are public: eval/tune/concurrency.py
runs the same sweep at several request counts in flight.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from eval.choice.record import repeats_mark
from eval.choice.stats import (
    AR_LABEL,
    CONFIDENCE,
    DEFAULT_ALPHA,
    DEFAULT_MIN_GAIN,
    choose,
    confirmation_interval,
    geomean,
    is_exact,
)

DEFAULT_REPEATS = 3  # paired passes per setting
# MIN_REPEATS: the fewest --repeats tune accepts, the one rule of every chooser (eval/choice/record.py); a sweep
# with fewer marks its record quick (repeats_mark), and a quick choice applies only in the run that made it.


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


AR = Setting(AR_LABEL, {}, 0.0)


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

def min_seconds(engine: Engine, repeats: int, rounds: int = 1) -> float:
    """The least one engine needs: its AR and one setting opened, `repeats` passes of each (at each of `rounds`
    concurrencies), and the same again for the confirmation of the winner in fresh sessions."""
    return 2 * _round_seconds(engine.open_seconds, engine.pass_seconds, repeats * rounds)


def _round_seconds(open_s: float, pass_s: float, repeats: int) -> float:
    """Two sessions opened and `repeats` passes of each (the confirmation; a setting costs one open less)."""
    return 2 * open_s + 2 * repeats * pass_s


def concurrency_rounds(engine: Engine) -> int:
    """How many request counts in flight the engine is measured at (1 unless it has `concurrencies`)."""
    return len(getattr(engine, "concurrencies", (1,)) or (1,))


def check_budget(engines: Sequence[Engine], repeats: int, budget_s: float) -> None:
    """BudgetTooSmall, naming the budget that would do, when `budget_s` cannot fit `min_seconds` of every engine."""
    need = sum(min_seconds(e, repeats, concurrency_rounds(e)) for e in engines)
    if budget_s < need:
        per = ", ".join(f"{e.name} {min_seconds(e, repeats, concurrency_rounds(e)) / 60:.1f}" for e in engines)
        raise BudgetTooSmall(f"a budget of {budget_s / 60:.2g} min cannot measure one setting per engine against "
                             f"its AR and confirm it ({repeats} paired repeats each; estimated minutes: {per}); give "
                             f"--budget-minutes {math.ceil(need / 60)} or more, or fewer prompts / tokens / repeats")


# -- the sweep ------------------------------------------------------------------------------------------------

def _paired(pairs: list[tuple[Measurement, Measurement]]) -> tuple[list[float], list[float]]:
    """Paired tokens/s ratios (setting / AR) and the AR-vs-AR null differences: ln(AR pass k+1 / AR pass k)."""
    ratios = [p.tokens_per_second / a.tokens_per_second for a, p in pairs
              if a.tokens_per_second and p.tokens_per_second]
    ar = [a.tokens_per_second for a, _ in pairs if a.tokens_per_second]
    return ratios, [math.log(b / a) for a, b in zip(ar, ar[1:], strict=False)]


def point_record(setting: Setting, pairs: list[tuple[Measurement, Measurement]]) -> dict:
    """A measured setting: paired AR / point passes -> speedup, acceptance, agreement with AR. Its standard error
    and bound come with the choice (`choose`), from the noise of the whole sweep."""
    ratios, ar_null = _paired(pairs)
    if not ratios:
        return {**setting_record(setting), "status": "failed", "error": "no decode time measured (no tokens?)"}
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
    return {**setting_record(setting), "status": "ok", "speedup": geomean(ratios), "ratios": ratios,
            "ar_null": ar_null,
            "tokens_per_second": statistics.median(p.tokens_per_second for _, p in pairs if p.tokens_per_second),
            "ar_tokens_per_second": statistics.median(a.tokens_per_second for a, _ in pairs
                                                      if a.tokens_per_second),
            # tokens per engine step (steps without a draft included); the counts are summed over the repeats
            "acceptance_length": tokens / steps if steps else None,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "same_tokens_as_ar": same,
            "passes": [{"ar_tokens_per_second": a.tokens_per_second, "tokens_per_second": p.tokens_per_second}
                       for a, p in pairs]}


def setting_record(s: Setting) -> dict:
    """A setting as tuning.json records it (label, knobs, cost)."""
    return {"label": s.label, "knobs": s.knobs, "cost": s.cost}


def failed_record(setting: Setting, exc: Exception, status: str = "failed") -> dict:
    """A setting that failed: its error's first line and the engine's last log lines (`PointFailed.log_tail`)."""
    return {**setting_record(setting), "status": status, "error": str(exc).splitlines()[0] if str(exc) else
            type(exc).__name__, "log_tail": list(getattr(exc, "log_tail", []))[-20:]}


class Clock:
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

    def fits(self, repeats: int, rounds: int = 1) -> bool:
        """One more setting (measured at `rounds` concurrencies), and still room for the confirmation after it."""
        return (self.now() + self.open_s + 2 * repeats * rounds * self.pass_s
                + _round_seconds(self.open_s, self.pass_s, repeats * rounds) <= self.deadline)


def reopen_ar(engine: Engine, ar, clock: Clock, error: str | None):
    """AR's session after it died during a setting: closed and opened again once. Returns (session, error); a
    session that will not reopen is (None, why), and the sweep's settings after it are judged against no AR."""
    ar.close()
    try:
        return open_session(engine, AR, clock), error
    except PointFailed as again:
        return None, f"AR died and could not be reopened: {again}"


def open_session(engine: Engine, setting: Setting, clock: Clock):
    """engine.open(setting), its seconds noted on the clock."""
    t0 = clock.now()
    session = engine.open(setting)
    clock.note_open(clock.now() - t0)
    return session


def _run(session, clock: Clock, is_ar: bool, concurrency: int | None = None) -> Measurement:
    t0 = clock.now()
    try:
        m = session.run() if concurrency is None else session.run(concurrency=concurrency)
    except PointFailed as exc:
        exc.ar = is_ar  # the sweep must know whether the setting or its AR died
        raise
    clock.note_pass(clock.now() - t0)
    return m


def paired_passes(ar, session, repeats: int, clock: Clock,
                  concurrency: int | None = None) -> list[tuple[Measurement, Measurement]]:
    """`repeats` (AR, setting) pairs in the order A B, B A, A B, ...: drift within a pair hits both sides, and a
    trend across pairs cancels. concurrency: requests in flight per pass (None: the session's one way)."""
    pairs = []
    for r in range(repeats):
        if r % 2 == 0:
            a = _run(ar, clock, True, concurrency)
            p = _run(session, clock, False, concurrency)
        else:
            p = _run(session, clock, False, concurrency)
            a = _run(ar, clock, True, concurrency)
        pairs.append((a, p))
    return pairs


def sweep_engine(engine: Engine, repeats: int, deadline: float,
                 progress: Callable[[str, dict | None], None] = lambda label, rec: None,
                 now: Callable[[], float] = time.monotonic, alpha: float = DEFAULT_ALPHA,
                 min_gain: float = DEFAULT_MIN_GAIN, tie: str = "cheaper") -> dict:
    """Every setting of `engine` against its AR, paired and interleaved, the choice (`tie`: which of the settings
    the noise cannot separate wins, eval/choice/stats.py: choose), and the winner's confirmation;
    returns the engine's tuning record. A setting that crashes or hangs is recorded with the engine's last log lines
    and the sweep goes on (an AR that dies is reopened once); settings the budget cannot fit (it keeps room for the
    confirmation) are recorded as skipped. `progress(label, record)` is called once per setting."""
    clock = Clock(deadline, engine, now)
    settings = engine.settings()
    described = engine.describe()
    points: list[dict] = []
    try:
        ar = open_session(engine, AR, clock)
    except PointFailed as exc:  # without its AR no setting of this engine can be judged
        for s in settings:
            progress(s.label, None)
        return {**described, "status": "failed", "error": f"AR failed: {exc}",
                "log_tail": exc.log_tail[-20:], "points": [], "ar": None, "choice": None, **repeats_mark(repeats)}
    ar_runs: list[float] = []
    error = None
    try:
        for setting in settings:
            if ar is None or not clock.fits(repeats):
                why = "budget spent" if ar is not None else "not measured: AR was lost"
                points.append({**setting_record(setting), "status": "skipped", "error": why})
                progress(setting.label, points[-1])
                continue
            try:
                session = open_session(engine, setting, clock)
            except PointFailed as exc:
                points.append(failed_record(setting, exc))
                progress(setting.label, points[-1])
                continue
            try:
                pairs = paired_passes(ar, session, repeats, clock)
                ar_runs += [a.tokens_per_second for a, _ in pairs if a.tokens_per_second]
                points.append(point_record(setting, pairs))
            except PointFailed as exc:
                if getattr(exc, "ar", False):
                    points.append(failed_record(setting, PointFailed(f"AR died during this setting: {exc}",
                                                               exc.log_tail)))
                    ar, error = reopen_ar(engine, ar, clock, error)
                else:
                    points.append(failed_record(setting, exc))
            finally:
                session.close()
            progress(setting.label, points[-1])
    finally:
        if ar is not None:
            ar.close()
    choice = choose(points, alpha, min_gain, exact=is_exact(described.get("dtype")), tie=tie)
    if choice["speculate"]:
        choice = confirm(engine, choice, points, repeats, clock, min_gain)
    command = getattr(engine, "command", None)  # how a user serves the choice (llama.cpp: its command line)
    if command is not None:
        choice["command"] = command(Setting(choice["label"], choice["knobs"], choice["cost"]))
    return {**described, "status": "ok" if error is None else "partial", "error": error, "points": points,
            "ar": {"tokens_per_second_runs": ar_runs,
                   "tokens_per_second": statistics.median(ar_runs) if ar_runs else None},
            "choice": choice, **repeats_mark(repeats)}


def confirm(engine: Engine, choice: dict, points: Sequence[dict], repeats: int, clock: Clock,
            min_gain: float = DEFAULT_MIN_GAIN) -> dict:
    """The winner re-timed against AR in fresh sessions, `repeats` pairs. These runs did not pick it, so their
    speedup and interval (CONFIDENCE, two-sided; the sd pooled over the sweep and these runs) are the ones reported;
    an interval that does not clear 1 + min_gain, or a confirmation that fails, falls back to "do not speculate"."""
    setting = Setting(choice["label"], choice["knobs"], choice["cost"])
    sessions = []
    try:
        sessions.append(open_session(engine, AR, clock))
        sessions.append(open_session(engine, setting, clock))
        pairs = paired_passes(sessions[0], sessions[1], repeats, clock)
    except PointFailed as exc:
        return confirmation_failed(choice, exc)
    finally:
        for s in sessions:
            s.close()
    return judge_confirmation(choice, points, pairs, min_gain)


def confirmation_failed(choice: dict, exc: PointFailed) -> dict:
    """"Do not speculate" when the winner's confirmation crashed or hung."""
    return _fall_back(choice, {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                               "log_tail": exc.log_tail[-20:]},
                      f"the confirmation of {choice['label']} failed ({exc}): nothing confirmed to beat AR")


def judge_confirmation(choice: dict, points: Sequence[dict], pairs: list[tuple[Measurement, Measurement]],
                       min_gain: float = DEFAULT_MIN_GAIN) -> dict:
    """The choice after its confirmation's fresh `pairs`: their speedup and interval reported, or "do not
    speculate" when the interval does not clear 1 + min_gain."""
    setting = Setting(choice["label"], choice["knobs"], choice["cost"])
    ratios, ar_null = _paired(pairs)
    if not ratios:
        return _fall_back(choice, {"error": "no decode time measured"}, "the confirmation measured no decode time")
    conf = {**confirmation_interval(ratios, ar_null, points),
            "passes": [{"ar_tokens_per_second": a.tokens_per_second, "tokens_per_second": p.tokens_per_second}
                       for a, p in pairs]}
    m, (lo, hi) = math.log(conf["speedup"]), conf["interval"]
    shown = (f"{math.exp(m):.3f}x AR, {CONFIDENCE:.0%} interval {lo:.3f}-{hi:.3f}x over {len(ratios)} fresh "
             "paired passes")
    if lo <= 1 + min_gain:
        clears = "exclude 1" if not min_gain else f"clear 1 + {min_gain:g}"
        return _fall_back(choice, conf, f"the confirmation re-timed {setting.label} at {shown}, which does not "
                          f"{clears}: do not speculate on this engine and machine")
    return {**choice, "speedup_vs_ar": math.exp(m), "interval": [lo, hi], "confirmation": conf,
            "reason": f"{choice['reason']}; confirmed at {shown}"}


def _fall_back(choice: dict, confirmation: dict, why: str) -> dict:
    """"Do not speculate", keeping what the sweep picked and what its confirmation measured."""
    return {**choice, "label": AR.label, "knobs": {}, "cost": 0.0, "speculate": False, "speedup_vs_ar": 1.0,
            "interval": None, "confirmation": confirmation, "unconfirmed": choice["label"], "reason": why}
