"""`specdraft tune`'s statistics (eval/tune/sweep.py runs the sweep; docs/howto/serve.md, "How it decides"): the
noise pooled over a sweep, the decision rule among K settings, and the confirmation's interval. Pure functions of
the measured log ratios y = ln(setting tok/s / AR tok/s); no engine, no clock.

- `pooled_noise`: one sd for the whole sweep, from each setting's residuals about its own mean and the AR-vs-AR
  differences (whose true value is 0), over their degrees of freedom.
- `choose`: every comparison at the Bonferroni level alpha / K, one-sided, Student's t on the noise's degrees of
  freedom; of the settings that beat AR (lower bound above 1 + min_gain), those another one beats are out, and the
  cheapest of the rest wins; none: "do not speculate". In an exact dtype a setting whose tokens differ from AR's
  is a bug, not a candidate.
- `confirmation_interval`: the winner's fresh paired runs, their speedup and two-sided CONFIDENCE interval with the
  sd pooled over the sweep and those runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

AR_LABEL = "AR (no speculation)"
DEFAULT_ALPHA = 0.05  # the chance, over all K comparisons of a sweep together, of calling a setting faster than it is
DEFAULT_MIN_GAIN = 0.0  # a minimum effect size: speculate only when the gain over AR clears it (0: any real gain)
CONFIDENCE = 0.95  # two-sided level of the confirmation's interval
EXACT_DTYPES = ("float32", "fp32", "f32")  # where speculation must return AR's tokens exactly


def geomean(ratios: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def is_exact(dtype) -> bool:
    """fp32 (llama.cpp: an f32 base GGUF): speculation must give AR's tokens exactly there."""
    text = str(dtype or "").lower()
    return text in EXACT_DTYPES or text.startswith("base f32")


def pooled_noise(runs: Sequence[dict]) -> dict:
    """The sweep's one noise estimate, in log ratios: sum of squared residuals of each run set's ln(ratio) about
    its own mean, plus the squared AR-vs-AR differences (mean 0), over the degrees of freedom (sum of n_i - 1,
    plus one per AR difference). `runs`: dicts with "ratios" and "ar_null" (points, the confirmation). sd is
    infinite when nothing was repeated (df 0): then no difference can be told from noise."""
    ss, df = 0.0, 0
    for r in runs:
        logs = [math.log(x) for x in r.get("ratios") or []]
        if len(logs) > 1:
            m = statistics.fmean(logs)
            ss += sum((y - m) ** 2 for y in logs)
            df += len(logs) - 1
        null = r.get("ar_null") or []
        ss += sum(d * d for d in null)
        df += len(null)
    return {"sd": math.sqrt(ss / df) if df else math.inf, "df": df}


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function for a whole number of degrees of freedom, exactly (the finite series of
    Abramowitz & Stegun 26.7.3-4; no scipy here)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c, total, term = math.cos(theta), 0.0, 1.0
    if df % 2:  # odd: (2/pi) (theta + sin(theta) (cos + 2/3 cos^3 + ...))
        for k in range((df - 1) // 2):
            total += term * c ** (2 * k + 1)
            term *= (2 * k + 2) / (2 * k + 3)
        inside = 2 / math.pi * (theta + math.sin(theta) * total)
    else:  # even: sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        for k in range(df // 2):
            total += term * c ** (2 * k)
            term *= (2 * k + 1) / (2 * k + 2)
        inside = math.sin(theta) * total
    return 0.5 + math.copysign(inside / 2, t)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (p > 0.5) by bisection on `t_cdf`; the normal one from 10,000 degrees of freedom."""
    if df >= 10_000 or not math.isfinite(df):
        return statistics.NormalDist().inv_cdf(p)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, int(df)) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, int(df)) < p else (lo, mid)
    return (lo + hi) / 2


def bonferroni_quantile(alpha: float, comparisons: int, df: float) -> float:
    """The one-sided t quantile for `alpha` shared over `comparisons` tests, with the noise's degrees of freedom."""
    return t_quantile(1 - alpha / max(1, comparisons), df)


def log_mean(p: dict) -> float:
    return statistics.fmean(math.log(r) for r in p["ratios"])


TIE_RULES = ("cheaper", "faster")


def choose(points: Sequence[dict], alpha: float = DEFAULT_ALPHA, min_gain: float = DEFAULT_MIN_GAIN,
           exact: bool = False, tie: str = "cheaper") -> dict:
    """The sweep's choice (module docstring): among the settings that beat AR at the Bonferroni level, the cheapest
    that no other one beats; AR ("do not speculate") when none beats it. tie="faster" takes the fastest of those
    instead (the interval cannot separate them, so the measured speed decides: what a run that reports the speed
    it reached wants, e.g. the demo; "cheaper" is the safer default for serving, fewer nodes verified a step).
    Adds to each measured point its standard
    error ("log_se", of its ln speedup), its lower bound at that level and whether it beats AR; in an exact dtype a
    point whose tokens differ from AR's gets "bug" and is no candidate. Returns the chosen point (label, knobs,
    cost, speedup), its margin over the runner-up, the noise and the rule, and why."""
    if tie not in TIE_RULES:
        raise ValueError(f"tie={tie!r}: use one of {', '.join(TIE_RULES)}")
    measured = [p for p in points if p.get("status") == "ok"]
    noise = pooled_noise(measured)
    for p in measured:
        same = p.get("same_tokens_as_ar")
        if exact and same is not None and same < 1:
            p["bug"] = (f"tokens differ from AR's in an exact dtype (same on {same:.0%} of prompts): speculation "
                        "must be lossless here, so this is a bug in the engine or the draft's serving, not a speed")
    cands = [p for p in measured if not p.get("bug")]
    cand_ids = {id(p) for p in cands}
    k = len(cands)
    z = bonferroni_quantile(alpha, k, noise["df"]) if noise["df"] else math.inf
    bar = math.log1p(min_gain)
    for p in measured:
        se = noise["sd"] / math.sqrt(len(p["ratios"]))
        p["log_se"] = se if math.isfinite(se) else None  # None: nothing repeated, the noise is unknown
        p["lower_bound"] = math.exp(log_mean(p) - z * se) if math.isfinite(se) else 0.0
        p["beats_ar"] = id(p) in cand_ids and log_mean(p) - z * se > bar
    rule = {"alpha": alpha, "settings_compared": k, "t": z if math.isfinite(z) else None, "min_gain": min_gain,
            "noise_sd": noise["sd"] if math.isfinite(noise["sd"]) else None, "noise_df": noise["df"]}
    bugs = [p["label"] for p in measured if p.get("bug")]
    ar = {"label": AR_LABEL, "knobs": {}, "cost": 0.0, "speedup": 1.0}
    base = {"rule": rule, "bugs": bugs, "interval": None, "confirmation": None}
    if not cands:
        why = ("no setting was measured to the end (each failed or was skipped)" if not bugs else
               f"every measured setting changed the tokens in an exact dtype ({', '.join(bugs)}: a bug)")
        return {**base, "label": AR_LABEL, "knobs": {}, "cost": 0.0, "speculate": False, "speedup_vs_ar": 1.0,
                "sweep_speedup": 1.0, "lower_bound": None, "runner_up": None, "runner_up_speedup": None,
                "margin_over_runner_up": None, "fastest": AR_LABEL, "reason": f"{why}: nothing shown to beat AR"}
    fastest = max(cands, key=lambda p: p["speedup"])
    winners = [p for p in cands if p["beats_ar"]]

    def beats(q, p) -> bool:  # q faster than p beyond the noise, at the same corrected level (both have a log_se:
        # a winner beat AR, which needs a finite noise)
        return log_mean(q) - log_mean(p) - z * math.hypot(q["log_se"], p["log_se"]) > 0

    level = f"one-sided {alpha:g} / {k} settings"
    if not winners:
        chosen = ar
        best = f"{fastest['label']}: {fastest['speedup']:.3f}x, lower bound {fastest['lower_bound']:.3f}x"
        gain = f" + {min_gain:g}" if min_gain else ""
        why = ("every setting is slower than AR" if fastest["speedup"] <= 1 else
               f"no setting's lower bound ({level}) clears 1{gain}") + f" ({best}): do not speculate on this " \
            "engine and machine"
    else:
        unbeaten = [p for p in winners if not any(beats(q, p) for q in winners)]
        if tie == "faster":
            chosen = max(unbeaten, key=lambda p: (p["speedup"], -p["cost"]))
        else:
            chosen = min(unbeaten, key=lambda p: (p["cost"], -p["speedup"]))
        why = f"beats AR (lower bound {chosen['lower_bound']:.3f}x, {level})"
        tied = [p["label"] for p in unbeaten if p is not chosen]
        if chosen is not fastest and tie == "faster":  # the fastest point was measured fewer times
            why += (f"; the fastest ({fastest['label']}, {fastest['speedup']:.3f}x) is not shown to beat AR at this "
                    "level")
        elif chosen is not fastest:
            why += (f"; tied with the fastest ({fastest['label']}, {fastest['speedup']:.3f}x) within the noise: the "
                    "cheaper setting wins")
        elif tie == "faster" and tied:
            why += f"; tied with {', '.join(tied)} within the noise: the faster measured setting wins"
    others = [p for p in [ar, *cands] if p is not chosen]
    runner = max(others, key=lambda p: p["speedup"])
    return {**base, "label": chosen["label"], "knobs": chosen["knobs"], "cost": chosen["cost"],
            "speculate": bool(chosen["knobs"]), "speedup_vs_ar": chosen["speedup"], "sweep_speedup":
            chosen["speedup"], "lower_bound": chosen.get("lower_bound"), "runner_up": runner["label"],
            "runner_up_speedup": runner["speedup"], "margin_over_runner_up": chosen["speedup"] - runner["speedup"],
            "fastest": fastest["label"], "reason": why}


def confirmation_interval(ratios: Sequence[float], ar_null: Sequence[float], points: Sequence[dict]) -> dict:
    """The confirmation's fresh paired ratios (and their AR-vs-AR differences) -> their speedup and two-sided
    CONFIDENCE interval, the sd pooled over the sweep's measured `points` and these runs."""
    run = {"ratios": list(ratios), "ar_null": list(ar_null)}
    noise = pooled_noise([*[p for p in points if p.get("status") == "ok"], run])
    m = statistics.fmean(math.log(r) for r in ratios)
    half = t_quantile(0.5 + CONFIDENCE / 2, noise["df"]) * noise["sd"] / math.sqrt(len(ratios))
    lo, hi = (math.exp(m - half), math.exp(m + half)) if math.isfinite(half) else (0.0, math.inf)
    return {**run, "speedup": math.exp(m), "interval": [lo, hi], "confidence": CONFIDENCE, "noise_sd": noise["sd"],
            "noise_df": noise["df"]}
