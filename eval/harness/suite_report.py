"""The suite's one table and one plot: suite.json, suite.md and suite.png (per-set acceptance length bars beside
per-position acceptance lines, one line per set)."""

from __future__ import annotations

import json
from pathlib import Path

from core.atomic import write_bytes_atomic, write_text_atomic
from eval.harness.run_dtype import format_dtypes
from eval.harness.untuned import untuned_line

SUITE_FILES = {"json": "suite.json", "md": "suite.md", "plot": "suite.png"}


def _f(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def suite_markdown(summary: dict) -> str:
    """The per-set table: prompts, acceptance length (AL), speedup vs own AR, tok/s, acceptance per position."""
    depth = max((len(r["accept_rate_per_position"]) for r in summary["sets"]), default=0)
    head = ["set", "prompts", "AL", "speedup vs own AR", "tok/s", "own AR tok/s"] + [f"acc@{k + 1}"
                                                                                   for k in range(depth)]
    first = untuned_line(summary.get("untuned"))  # an untuned speed column is said before anything else
    lines = [f"**{first}**", ""] if first else []
    lines += [f"# Suite `{summary['suite']}`: {summary['method']}", "",
              f"{summary['num_prompts_per_set']} prompts per set, greedy unless the eval config says otherwise. AL = "
              "new tokens / base decode steps (plain decoding = 1.0); acc@k = share of steps whose k-th draft token "
              "was accepted.", ""]
    if summary.get("dtypes"):
        lines += [format_dtypes(summary["dtypes"]) + ".", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["sets"]:
        rates = list(r["accept_rate_per_position"]) + [None] * (depth - len(r["accept_rate_per_position"]))
        cells = [r["set"], str(r["num_prompts"]), _f(r["acceptance_length"]), _f(r["speedup"]),
                 _f(r["tokens_per_second"], ".1f"), _f(r["ar_tokens_per_second"], ".1f")] + [_f(x) for x in rates]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"![per-set acceptance]({SUITE_FILES['plot']})", ""]
    return "\n".join(lines)


def plot_suite(summary: dict) -> bytes:
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    bars, lines = fig.subplots(1, 2)
    names = [r["set"] for r in summary["sets"]]
    bars.bar(range(len(names)), [r["acceptance_length"] or 0 for r in summary["sets"]])
    bars.set_xticks(range(len(names)), names, rotation=30, ha="right")
    bars.axhline(1.0, color="k", linewidth=0.8, linestyle=":")
    bars.set_ylabel("acceptance length (tokens / base step)")
    bars.set_title("Acceptance length per set")
    for r in summary["sets"]:
        rates = r["accept_rate_per_position"]
        lines.plot(range(1, len(rates) + 1), [x if x is not None else float("nan") for x in rates], marker="o",
                   label=r["set"])
    from matplotlib.ticker import MaxNLocator

    lines.xaxis.set_major_locator(MaxNLocator(integer=True))  # draft positions are whole numbers
    lines.set_xlabel("draft position")
    lines.set_ylabel("share of steps accepting it")
    lines.set_ylim(0, 1)
    lines.set_title("Acceptance per position")
    lines.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_suite_report(out_dir: Path, summary: dict) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / v for k, v in SUITE_FILES.items()}
    write_bytes_atomic(paths["plot"], plot_suite(summary))
    write_text_atomic(paths["md"], suite_markdown(summary))
    write_text_atomic(paths["json"], json.dumps(summary, indent=2, allow_nan=False) + "\n")  # last: marks finished
    return paths
