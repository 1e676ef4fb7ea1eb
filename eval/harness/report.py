"""Benchmark report: aggregate per-prompt results, then write report.json/.md, samples.jsonl and plots.

`report.json` has exactly the contract keys (`REPORT_KEYS`, docs/howto/evaluate.md), plus one optional `"extra"` object
for everything else (prefill time, config, tree size, ...), so tools reading the contract keys never
meet a surprise. All files are written atomically (temp file in the same directory, then rename), so a
crashed run never leaves a half-written report that looks complete.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.atomic import atomic_open
from eval.harness.lossless import format_verdict
from eval.harness.run_dtype import format_dtypes
from eval.harness.untuned import untuned_line

REPORT_KEYS = (
    "method", "base_model", "device", "dataset", "num_prompts", "new_tokens", "base_steps",
    "acceptance_length", "accept_rate_per_position", "tokens_per_second", "ar_tokens_per_second",
    "hf_tokens_per_second", "speedup", "speedup_vs_hf", "draft_time_fraction", "lossless",
    "lossless_fraction",
)
# Labels of the two baselines in `speeds`; the throughput plot annotates ratios against them.
AR_LABEL, HF_LABEL = "own AR", "HF generate"
_BASELINE_ALIASES = {AR_LABEL: ("own ar", "ar"), HF_LABEL: ("hf generate", "hf")}
PLOT_FILES = {
    "accept_hist": "accept_length_hist.png",
    "accept_rate": "accept_rate_by_depth.png",
    "throughput": "throughput.png",
}


@dataclass
class PromptResult:
    """What the decoder measured on one prompt.

    new_tokens: tokens generated (after any trim to max_new_tokens / eos).
    base_steps: base-model forward passes in decode (the decoder's convention must make plain
      decoding give new_tokens == base_steps, i.e. acceptance length 1.0).
    decode_time / prefill_time / draft_time: seconds; draft_time is the part of decode_time spent
      in the drafter (prefill is not part of decode_time).
    accept_lengths: one entry per verification step, accepted drafts + 1 (bonus token), so >= 1.
    accepted_per_depth[k]: steps whose accepted path reached depth k+1 (accepted drafts >= k+1).
    proposed_per_depth[k]: steps whose draft had at least one node at depth k+1.
      `per_depth_counts` derives both from per-step data.
    matches_greedy: output identical to plain greedy decoding; None when not checked.
    divergence: the tie-aware verdict for this prompt (kind identical | tie | mismatch, first differing
      position, the plain run's top-2 gap there); None when not checked.
    """

    id: str
    new_tokens: int
    base_steps: int
    decode_time: float
    prefill_time: float = 0.0
    draft_time: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    proposed_per_depth: list[int] = field(default_factory=list)
    matches_greedy: bool | None = None
    category: str = ""
    prompt: str = ""
    output: str = ""
    tokens: list[int] = field(default_factory=list)
    divergence: dict | None = None  # eval/lossless.Divergence.to_dict(): first difference vs plain decoding

    def __post_init__(self):
        problems = []
        if self.new_tokens < 0 or self.base_steps < 0:
            problems.append(f"negative counts (new_tokens={self.new_tokens}, base_steps={self.base_steps})")
        if self.new_tokens > 0 and self.base_steps == 0:
            problems.append("new_tokens > 0 with base_steps == 0")
        if min(self.decode_time, self.prefill_time, self.draft_time) < 0:
            problems.append("negative time")
        if any(n < 1 for n in self.accept_lengths):
            problems.append("an accept length < 1 (it counts the bonus token, so every step is >= 1)")
        if len(self.accepted_per_depth) > len(self.proposed_per_depth) or any(
                a > p for a, p in zip(self.accepted_per_depth, self.proposed_per_depth)):
            problems.append(f"accepted_per_depth {self.accepted_per_depth} exceeds proposed_per_depth "
                            f"{self.proposed_per_depth} at some depth")
        if any(b > a for a, b in zip(self.accepted_per_depth, self.accepted_per_depth[1:])):
            problems.append(f"accepted_per_depth {self.accepted_per_depth} increases with depth (reaching "
                            "depth k+1 implies reaching depth k)")
        if problems:
            raise ValueError(f"PromptResult {self.id!r} is inconsistent: " + "; ".join(problems)
                             + ". Fix the decoder's bookkeeping (see the PromptResult docstring)")

    def to_sample(self) -> dict:
        """The samples.jsonl line for this prompt."""
        return {"id": self.id, "category": self.category, "prompt": self.prompt, "output": self.output,
                "tokens": list(self.tokens), "new_tokens": self.new_tokens,
                "accept_lengths": list(self.accept_lengths), "matches_greedy": self.matches_greedy,
                **({"divergence": self.divergence} if self.divergence is not None else {})}


def per_depth_counts(accept_lengths: Sequence[int], draft_depths: Sequence[int]
                     ) -> tuple[list[int], list[int]]:
    """(accepted_per_depth, proposed_per_depth) from per-step data.

    accept_lengths[s]: accepted drafts + 1 at step s; draft_depths[s]: deepest draft node offered at
    step s (0 = no draft). Both lists have length max(draft_depths).
    """
    if len(accept_lengths) != len(draft_depths):
        raise ValueError(f"{len(accept_lengths)} accept lengths but {len(draft_depths)} draft depths; "
                         "give one of each per verification step")
    depth = max(draft_depths, default=0)
    accepted, proposed = [0] * depth, [0] * depth
    for length, offered in zip(accept_lengths, draft_depths):
        if length - 1 > offered:
            raise ValueError(f"a step accepted {length - 1} drafts but offered only depth {offered}")
        for k in range(offered):
            proposed[k] += 1
        for k in range(length - 1):
            accepted[k] += 1
    return accepted, proposed


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0 (JSON has no inf/NaN)."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def build_report(results: Sequence[PromptResult], *, method: str, base_model: str, device: str,
                 dataset: str, ar_tokens_per_second: float | None = None,
                 hf_tokens_per_second: float | None = None, extra: dict | None = None) -> dict:
    """Aggregate per-prompt results into the report dict (contract keys + "extra").

    Totals over prompts (token-weighted, not a mean of per-prompt ratios):
      acceptance_length = Σ new_tokens / Σ base_steps.
      accept_rate_per_position[k] = Σ accepted_per_depth[k] / Σ proposed_per_depth[k]: among the
        steps whose draft reached depth k+1, the fraction whose accepted path reached depth k+1.
        Not conditional on depth k being accepted (with a fixed draft depth it can only fall with
        depth; with varying depths the denominators differ). One entry per depth ever proposed
        (None where no step proposed it); [] when nothing was drafted.
      tokens_per_second = Σ new_tokens / Σ decode_time (prefill excluded; reported in extra).
      speedup = tokens_per_second / ar_tokens_per_second; speedup_vs_hf likewise (None if missing).
      draft_time_fraction = Σ draft_time / Σ decode_time.
      lossless_fraction = share of checked prompts (matches_greedy not None) that matched;
      lossless = every checked prompt matched. Both None when no prompt was checked; extra records
      how many were checked.
    """
    if not results:
        raise ValueError("build_report got no results; run at least one prompt")
    new_tokens = sum(r.new_tokens for r in results)
    base_steps = sum(r.base_steps for r in results)
    decode_time = sum(r.decode_time for r in results)
    prefill_time = sum(r.prefill_time for r in results)
    draft_time = sum(r.draft_time for r in results)

    depth = max(len(r.proposed_per_depth) for r in results)
    accepted = [sum(r.accepted_per_depth[k] for r in results if k < len(r.accepted_per_depth))
                for k in range(depth)]
    proposed = [sum(r.proposed_per_depth[k] for r in results if k < len(r.proposed_per_depth))
                for k in range(depth)]
    rates = [_ratio(a, p) for a, p in zip(accepted, proposed)]

    checked = [r.matches_greedy for r in results if r.matches_greedy is not None]
    tokens_per_second = _ratio(new_tokens, decode_time)
    steps = [n for r in results for n in r.accept_lengths]
    report = {
        "method": method,
        "base_model": base_model,
        "device": device,
        "dataset": dataset,
        "num_prompts": len(results),
        "new_tokens": new_tokens,
        "base_steps": base_steps,
        "acceptance_length": _ratio(new_tokens, base_steps),
        "accept_rate_per_position": rates,
        "tokens_per_second": tokens_per_second,
        "ar_tokens_per_second": ar_tokens_per_second,
        "hf_tokens_per_second": hf_tokens_per_second,
        "speedup": _ratio(tokens_per_second, ar_tokens_per_second),
        "speedup_vs_hf": _ratio(tokens_per_second, hf_tokens_per_second),
        "draft_time_fraction": _ratio(draft_time, decode_time),
        "lossless": all(checked) if checked else None,
        "lossless_fraction": sum(checked) / len(checked) if checked else None,
        "extra": {
            "decode_seconds": decode_time,
            "prefill_seconds": prefill_time,
            "prefill_seconds_per_prompt": prefill_time / len(results),
            "draft_seconds": draft_time,
            "verify_steps": len(steps),
            "accepted_per_depth": accepted,
            "proposed_per_depth": proposed,
            "lossless_checked": len(checked),
            **(extra or {}),
        },
    }
    return report


def validate_report(report: dict) -> None:
    """Raise ValueError unless `report` has every contract key, nothing else but "extra", and finite
    numbers (JSON has no inf/NaN; use None for "not measured")."""
    missing = [k for k in REPORT_KEYS if k not in report]
    unknown = sorted(set(report) - set(REPORT_KEYS) - {"extra"})
    if missing or unknown:
        raise ValueError(f"report.json keys must be exactly the contract's (REPORT_KEYS): missing {missing}, unknown "
                         f"{unknown}. Set missing ones (None if not measured), move other keys under "
                         "\"extra\"")
    if "extra" in report and not isinstance(report["extra"], dict):
        raise ValueError(f"report['extra'] must be a dict, got {type(report['extra']).__name__}")

    def bad_floats(value, where):
        if isinstance(value, float) and not math.isfinite(value):
            yield where
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from bad_floats(v, f"{where}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from bad_floats(v, f"{where}[{i}]")

    bad = [w for k, v in report.items() for w in bad_floats(v, k)]
    if bad:
        raise ValueError(f"report has inf/NaN at {bad}; JSON cannot hold them, use None for 'not measured'")


def write_report(out_dir: str | os.PathLike, report: dict, samples: Sequence[dict],
                 step_accept_lengths: Sequence[int], accept_rate_per_position: Sequence[float | None],
                 speeds: dict[str, float | None] | None = None, *, extra: dict | None = None
                 ) -> dict[str, Path]:
    """Write report.json, report.md, samples.jsonl and three PNG plots into `out_dir`.

    report: the contract dict (e.g. from `build_report`); `extra` is merged into its "extra" object.
    samples: one dict per prompt (e.g. `PromptResult.to_sample()`).
    step_accept_lengths: every verification step's accept length, all prompts (histogram).
    accept_rate_per_position: bar per depth (None entries are drawn as 0).
    speeds: label -> tokens/s for the throughput bar chart; default spec / own AR / HF generate from
      the report. Bars are annotated with the ratio to the "own AR" and "HF generate" entries.
    Returns {"report_json", "report_md", "samples", "accept_hist", "accept_rate", "throughput"} paths.
    """
    if extra:
        report = {**report, "extra": {**report.get("extra", {}), **extra}}
    validate_report(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if speeds is None:
        speeds = default_speeds(report)

    paths = {"report_json": out / "report.json", "report_md": out / "report.md",
             "samples": out / "samples.jsonl", **{k: out / v for k, v in PLOT_FILES.items()}}
    _atomic_write(paths["accept_hist"], lambda f: _plot_accept_hist(step_accept_lengths, f), binary=True)
    _atomic_write(paths["accept_rate"], lambda f: _plot_accept_rate(accept_rate_per_position, f), binary=True)
    _atomic_write(paths["throughput"], lambda f: _plot_throughput(speeds, f), binary=True)
    _atomic_write(paths["samples"], lambda f: f.write("".join(json.dumps(s, ensure_ascii=False) + "\n"
                                                              for s in samples)))
    _atomic_write(paths["report_md"], lambda f: f.write(_markdown(report, speeds)))
    # report.json last: its presence marks a finished report.
    _atomic_write(paths["report_json"],
                  lambda f: f.write(json.dumps(report, indent=2, allow_nan=False) + "\n"))
    return paths


def default_speeds(report: dict) -> dict[str, float | None]:
    return {report["method"]: report["tokens_per_second"], AR_LABEL: report["ar_tokens_per_second"],
            HF_LABEL: report["hf_tokens_per_second"]}


def _atomic_write(path: Path, write: Callable, binary: bool = False) -> None:
    """`write(f)` into a temp file that then takes `path`'s name: a killed run never leaves half a report."""
    with atomic_open(path, binary) as f:
        write(f)


def _figure():
    # Figure without pyplot: renders with Agg, touches no global backend state (other code may use
    # pyplot interactively in the same process).
    from matplotlib.figure import Figure
    return Figure(figsize=(6, 4), dpi=100, layout="constrained")


def _plot_accept_hist(step_accept_lengths: Sequence[int], f) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    if step_accept_lengths:
        top = max(step_accept_lengths)
        ax.hist(step_accept_lengths, bins=[x - 0.5 for x in range(1, top + 2)], rwidth=0.85)
        mean = sum(step_accept_lengths) / len(step_accept_lengths)
        ax.axvline(mean, color="k", linestyle="--", label=f"mean {mean:.2f}")
        ax.legend()
        ax.set_xticks(range(1, top + 1))
    else:
        ax.text(0.5, 0.5, "no verification steps", ha="center", va="center", transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # step counts are whole numbers
    ax.set_xlabel("tokens committed per base step (accepted drafts + 1)")
    ax.set_ylabel("steps")
    ax.set_title("Accepted length per step")
    fig.savefig(f, format="png")


def _plot_accept_rate(rates: Sequence[float | None], f) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    depths = list(range(1, len(rates) + 1))
    values = [r or 0.0 for r in rates]
    if rates:
        bars = ax.bar(depths, values)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values])
        ax.set_xticks(depths)
    else:
        ax.text(0.5, 0.5, "no drafts proposed", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("accept rate")
    ax.set_title("Acceptance rate by depth\n"
                 "(steps whose accepted path reached depth d / steps drafting depth d)", fontsize=10)
    fig.savefig(f, format="png")


def _speedup_labels(speeds: dict[str, float | None]) -> list[str]:
    def find(label):  # accept "ar"/"hf" spellings too
        names = [n for n in speeds if n.lower() in _BASELINE_ALIASES[label]]
        return (names[0], speeds[names[0]]) if names else (None, None)

    ar_name, ar = find(AR_LABEL)
    hf_name, hf = find(HF_LABEL)
    labels = []
    for name, v in speeds.items():
        if v is None:
            labels.append("n/a")
            continue
        parts = [f"{v:.1f} tok/s"]
        if ar and name != ar_name:
            parts.append(f"{v / ar:.2f}x vs AR")
        if hf and name != hf_name:
            parts.append(f"{v / hf:.2f}x vs HF")
        labels.append("\n".join(parts))
    return labels


def _plot_throughput(speeds: dict[str, float | None], f) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    names = list(speeds)
    bars = ax.bar(names, [v or 0.0 for v in speeds.values()], color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(bars, labels=_speedup_labels(speeds), fontsize=8)
    ax.margins(y=0.3)  # room for the multi-line labels
    ax.set_ylabel("new tokens / s (prefill excluded)")
    ax.set_title("Decode throughput")
    fig.savefig(f, format="png")


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _markdown(report: dict, speeds: dict[str, float | None]) -> str:
    extra = report.get("extra") or {}
    first = untuned_line(extra.get("untuned"))  # an untuned speed column is said before anything else
    lines = [f"**{first}**", ""] if first else []
    lines += [f"# {report['method']} on {report['dataset']}", "",
              f"Base `{report['base_model']}` on {report['device']}, {report['num_prompts']} prompts.", "",
              f"**Verdict:** {format_verdict(report)}.", ""]
    if extra.get("dtypes"):
        lines += [f"**{format_dtypes(extra['dtypes'])}**", ""]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(report[k])} |" for k in REPORT_KEYS
              if k not in ("method", "accept_rate_per_position")]
    rates = report["accept_rate_per_position"]
    if rates:
        lines += ["", "## Acceptance rate by depth", "",
                  "| depth | " + " | ".join(str(k + 1) for k in range(len(rates))) + " |",
                  "|---|" + "---|" * len(rates),
                  "| rate | " + " | ".join(_fmt(r) for r in rates) + " |"]
    lines += ["", "## Throughput", "", "| engine | tokens/s |", "|---|---|"]
    lines += [f"| {name} | {_fmt(v)} |" for name, v in speeds.items()]
    lines += ["", "## Plots", ""]
    titles = {"accept_hist": "Accepted length per step", "accept_rate": "Acceptance rate by depth",
              "throughput": "Decode throughput"}
    lines += [f"![{titles[k]}]({name})" for k, name in PLOT_FILES.items()]
    if report.get("extra"):
        lines += ["", "## Extra", "", "| key | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v) if not isinstance(v, dict) else json.dumps(v)} |"
                  for k, v in report["extra"].items()]
    return "\n".join(lines) + "\n"


__all__ = ["REPORT_KEYS", "PLOT_FILES", "PromptResult", "per_depth_counts", "build_report",
           "validate_report", "write_report", "default_speeds"]
