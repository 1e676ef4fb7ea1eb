"""`specdraft tune`'s sweep over its engines (`run_sweeps`: one request in flight through eval/tune/sweep.py's
`sweep_engine`, or several with `--concurrency 1,2,4,8`), the sweep at several request counts in flight, and the
per-batch-size schedule of speculative tokens it implies (docs/howto/serve.md, "Tune under concurrency").

Each setting's session is opened once and measured at every concurrency c in turn: `repeats` pairs against the
engine's AR session at c requests in flight (the engine's session runs c prompts at once: `run(concurrency=c)`).
Per c, the choice is the same rule as for one request (eval/choice/stats.py: the noise pooled over that
concurrency's settings, Bonferroni over its K settings, the cheapest that no other beats), and each winner is
re-timed against AR in fresh sessions at the concurrencies it won (one fresh pair of sessions per winner), so every
concurrency's choice is confirmed as a single-concurrency choice is. Each concurrency is its own decision (as each
engine is): alpha is shared over a concurrency's settings, not over the concurrencies.

The schedule (`speculation_schedule`) is vLLM's `num_speculative_tokens_per_batch_size`
(vllm/config/speculative.py; validated by vllm/v1/spec_decode/dynamic/utils.py): inclusive batch-size ranges
[start, end, k], sorted, non-overlapping, the first starting at 1; k = 0 drafts nothing at that batch size (allowed:
k >= 0); vLLM caps every k at num_speculative_tokens, so that must be the largest k, and carries the last entry's k
forward to max_num_seqs. Each measured concurrency covers itself up to the next one less 1: 1,2,4,8 ->
[[1,1,k1],[2,3,k2],[4,7,k4],[8,8,k8]] (adjacent equal k merged), batch sizes past 8 keep k8.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from eval.choice.record import TOKENS_KNOB
from eval.choice.stats import DEFAULT_ALPHA, DEFAULT_MIN_GAIN, choose, is_exact
from eval.tune.sweep import (
    AR,
    Clock,
    Engine,
    EngineUnavailable,
    PointFailed,
    Setting,
    check_budget,
    concurrency_rounds,
    confirmation_failed,
    failed_record,
    judge_confirmation,
    min_seconds,
    open_session,
    paired_passes,
    point_record,
    reopen_ar,
    setting_record,
    sweep_engine,
)

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"  # vLLM's speculative_config key


def parse_concurrency(text: str) -> tuple[int, ...]:
    """--concurrency: request counts in flight, strictly increasing, starting at 1 (vLLM's schedule starts at batch
    size 1); a ValueError of one line with an example otherwise."""
    example = "e.g. --concurrency 1,2,4,8 (requests in flight, strictly increasing, from 1)"
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--concurrency {text!r} is not a list of whole numbers; {example}") from None
    if not values:
        raise ValueError(f"--concurrency is empty; {example}")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)) or values[0] < 1:
        raise ValueError(f"--concurrency {text} is not strictly increasing from at least 1; {example}")
    if values[0] != 1:
        raise ValueError(f"--concurrency {text} does not start at 1: vLLM's per-batch-size schedule must cover batch "
                         f"size 1; {example}")
    return values


def speculation_schedule(choices: dict[int, dict], knob: str = TOKENS_KNOB) -> dict:
    """Per-concurrency choices -> {"per_concurrency": {c: k}, SCHEDULE_KEY: [[start, end, k], ...] or None (no
    concurrency speculates), "num_speculative_tokens": the largest k (vLLM caps every entry at it) or None}.
    k = 0 where the choice is "do not speculate"."""
    per = {int(c): (int(ch["knobs"][knob]) if ch.get("speculate") else 0) for c, ch in choices.items()}
    cs = sorted(per)
    ranges: list[list[int]] = []
    for i, c in enumerate(cs):
        start = 1 if i == 0 else c
        end = cs[i + 1] - 1 if i + 1 < len(cs) else c
        if ranges and ranges[-1][2] == per[c]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, per[c]])
    top = max(per.values()) if per else 0
    return {"per_concurrency": {str(c): per[c] for c in cs}, SCHEDULE_KEY: ranges if top > 0 else None,
            "num_speculative_tokens": top or None}


def sweep_concurrencies(engine: Engine, concurrencies: Sequence[int], repeats: int, deadline: float,
                        progress: Callable[[str, dict | None], None] = lambda label, rec: None,
                        now: Callable[[], float] = time.monotonic, alpha: float = DEFAULT_ALPHA,
                        min_gain: float = DEFAULT_MIN_GAIN) -> dict:
    """Every setting of `engine` against its AR at each concurrency (module docstring), the choice per concurrency,
    each winner's confirmation, and the schedule. The record has the first concurrency's (1's) points, AR and
    choice where a single-concurrency record has them (serve-check and `specdraft eval` run one request), the
    schedule in choice["schedule"] and record["schedule"], and every concurrency's own in "by_concurrency"."""
    cs = [int(c) for c in concurrencies]
    clock = Clock(deadline, engine, now)
    settings = engine.settings()
    described = engine.describe()
    points: dict[int, list[dict]] = {c: [] for c in cs}
    ar_runs: dict[int, list[float]] = {c: [] for c in cs}
    try:
        ar = open_session(engine, AR, clock)
    except PointFailed as exc:
        for s in settings:
            progress(s.label, None)
        return {**described, "status": "failed", "error": f"AR failed: {exc}", "log_tail": exc.log_tail[-20:],
                "concurrencies": cs, "points": [], "ar": None, "choice": None, "by_concurrency": {}}
    error = None
    try:
        for setting in settings:
            if ar is None or not clock.fits(repeats, len(cs)):
                why = "budget spent" if ar is not None else "not measured: AR was lost"
                for c in cs:
                    points[c].append({**setting_record(setting), "status": "skipped", "error": why})
                progress(setting.label, points[cs[0]][-1])
                continue
            try:
                session = open_session(engine, setting, clock)
            except PointFailed as exc:
                for c in cs:
                    points[c].append(failed_record(setting, exc))
                progress(setting.label, points[cs[0]][-1])
                continue
            before = {c: len(points[c]) for c in cs}
            try:
                for c in cs:
                    pairs = paired_passes(ar, session, repeats, clock, c)
                    ar_runs[c] += [a.tokens_per_second for a, _ in pairs if a.tokens_per_second]
                    points[c].append(point_record(setting, pairs))
            except PointFailed as exc:
                lost_ar = getattr(exc, "ar", False)
                why = PointFailed(f"AR died during this setting: {exc}", exc.log_tail) if lost_ar else exc
                for c in cs:
                    if len(points[c]) == before[c]:  # the concurrencies this setting did not finish
                        points[c].append(failed_record(setting, why))
                if lost_ar:
                    ar, error = reopen_ar(engine, ar, clock, error)
            finally:
                session.close()
            progress(setting.label, points[cs[0]][-1])
    finally:
        if ar is not None:
            ar.close()
    exact = is_exact(described.get("dtype"))
    choices = {c: choose(points[c], alpha, min_gain, exact=exact) for c in cs}
    choices = _confirm_winners(engine, choices, points, repeats, clock, min_gain)
    command = getattr(engine, "command", None)
    by_c = {}
    for c in cs:
        if command is not None:
            ch = choices[c]
            choices[c] = {**ch, "command": command(Setting(ch["label"], ch["knobs"], ch["cost"]))}
        runs = ar_runs[c]
        by_c[str(c)] = {"points": points[c], "choice": choices[c],
                        "ar": {"tokens_per_second_runs": runs,
                               "tokens_per_second": statistics.median(runs) if runs else None}}
    schedule = speculation_schedule(choices)
    ranges = schedule[SCHEDULE_KEY]
    serve = getattr(engine, "schedule_command", None)
    if ranges and serve is not None:
        schedule["command"] = serve(ranges)  # how a user serves it (None: the method drafts a fixed count)
    first = by_c[str(cs[0])]
    return {**described, "status": "ok" if error is None else "partial", "error": error, "concurrencies": cs,
            "points": first["points"], "ar": first["ar"], "choice": {**first["choice"], "schedule": schedule},
            "schedule": schedule, "by_concurrency": by_c}


def _confirm_winners(engine: Engine, choices: dict[int, dict], points: dict[int, list[dict]], repeats: int,
                     clock: Clock, min_gain: float) -> dict[int, dict]:
    """Each distinct winner re-timed against AR in one fresh pair of sessions, at every concurrency it won."""
    out = dict(choices)
    winners: dict[str, list[int]] = {}
    for c, ch in choices.items():
        if ch["speculate"]:
            winners.setdefault(ch["label"], []).append(c)
    for label, cs in winners.items():
        ch = choices[cs[0]]
        setting = Setting(label, ch["knobs"], ch["cost"])
        sessions = []
        try:
            sessions.append(open_session(engine, AR, clock))
            sessions.append(open_session(engine, setting, clock))
            for c in cs:
                pairs = paired_passes(sessions[0], sessions[1], repeats, clock, c)
                out[c] = judge_confirmation(choices[c], points[c], pairs, min_gain)
        except PointFailed as exc:
            for c in cs:
                if out[c] is choices[c]:  # not confirmed yet
                    out[c] = confirmation_failed(choices[c], exc)
        finally:
            for s in sessions:
                s.close()
    return out


def run_sweeps(engines: Sequence[Engine], repeats: int, budget_s: float,
               progress: Callable[[str, dict | None], None] = lambda label, rec: None,
               now: Callable[[], float] = time.monotonic, alpha: float = DEFAULT_ALPHA,
               min_gain: float = DEFAULT_MIN_GAIN) -> dict[str, dict]:
    """Each engine in turn, after refusing a budget that cannot fit one setting per engine. Each engine gets an
    equal share of what is left of the budget (at least its minimum), so the first cannot starve the last."""
    check_budget(engines, repeats, budget_s)
    end = now() + budget_s
    out: dict[str, dict] = {}
    for i, engine in enumerate(engines):
        left = end - now()
        rest = engines[i:]
        share = max(min_seconds(engine, repeats, concurrency_rounds(engine)), left / len(rest))
        deadline = min(end, now() + share)
        try:
            concurrencies = tuple(getattr(engine, "concurrencies", (1,)) or (1,))
            if concurrencies == (1,):
                out[engine.name] = sweep_engine(engine, repeats, deadline, progress, now, alpha, min_gain)
            else:
                out[engine.name] = sweep_concurrencies(engine, concurrencies, repeats, deadline, progress, now,
                                                       alpha, min_gain)
        except EngineUnavailable as exc:  # e.g. vLLM has no method for this family: a result, not a crash
            out[engine.name] = {**engine.describe(), "status": "unservable", "error": str(exc), "points": [],
                                "ar": None, "choice": None}
    return out
