"""One table (markdown) + plots from finished runs: trainable parameters, training time, held-out per-depth
top-1, and each run's eval reports (acceptance length, per-depth acceptance, tokens/s, speedups).

    python bench/compare_families.py runs/cmp-medusa runs/cmp-hydra ... --eval mtbench-cpu --out docs/lab/img/cmp

Reads only files the runs wrote: export/config.json + model.safetensors (parameter count from tensor
shapes; safetensors headers, nothing unpickled), heldout.json, eval/<name>/report.json. Training time is
the export's `train_seconds`, else the last tqdm elapsed time in runs/logs/<run>.log. Times nothing itself: the
speeds are the eval reports' own (each run's arms timed side by side). With --out, <out>.json holds every run's
row (bench/harness.py: Results, one arm per run, on disk after each) beside <out>.md and the plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results  # noqa: E402
from core.atomic import write_text_atomic  # noqa: E402
from eval.harness.results_doc import train_seconds, trainable_params  # noqa: E402


def describe(run: Path, eval_names: list[str]) -> dict:
    cfg = json.loads((run / "export" / "config.json").read_text())
    heldout = json.loads((run / "heldout.json").read_text()) if (run / "heldout.json").is_file() else None
    row = {"run": run.name, "family": cfg["family"], "params": trainable_params(run / "export", cfg),
           "train_s": train_seconds(run, cfg), "steps": cfg.get("trained_steps"),
           "tree": "searched" if isinstance(cfg.get("tree"), list) else cfg.get("tree", "default"),
           "heldout_top1": [d["top1"] for d in heldout["depths"]] if heldout else None,
           "heldout_est": heldout["summary"]["est_accept_len"] if heldout else None, "evals": {}}
    for name in eval_names:
        path = run / "eval" / name / "report.json"
        if path.is_file():
            row["evals"][name] = json.loads(path.read_text())
    return row


def _f(x, spec=".2f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(rows: list[dict], eval_names: list[str]) -> str:
    out = ["| run | family | trainable params | train time | held-out top-1 by depth | est. τ (teacher-forced) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        t = "—" if r["train_s"] is None else f"{r['train_s'] / 60:.1f} min"
        top1 = " / ".join(f"{a:.3f}" for a in r["heldout_top1"]) if r["heldout_top1"] else "—"
        out.append(f"| {r['run']} | {r['family']} | {r['params'] / 1e6:.2f}M | {t} | {top1} | {_f(r['heldout_est'])} |")
    for name in eval_names:
        out += ["", f"**eval `{name}`**", "",
                "| run | acceptance length | accept rate by depth | tokens/s | own AR tokens/s | speedup vs own AR "
                "| speedup vs generate | draft time | lossless | tree / beams |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            rep = r["evals"].get(name)
            if rep is None:
                continue
            ex = rep.get("extra", {})
            shape = (f"W={ex['beam_width']} L={ex['beam_length']}" if "beam_width" in ex else
                     f"{ex.get('tree', '?')} ({ex.get('tree_nodes', ex.get('max_nodes', '?'))} nodes)")
            rates = " / ".join(f"{a:.2f}" for a in rep["accept_rate_per_position"])
            out.append(f"| {r['run']} | **{rep['acceptance_length']:.2f}** | {rates} "
                       f"| {_f(rep['tokens_per_second'], '.1f')} | {_f(rep['ar_tokens_per_second'], '.1f')} "
                       f"| {_f(rep['speedup'])}× | {_f(rep['speedup_vs_hf'])} | {_f(rep['draft_time_fraction'])} "
                       f"| {_f(rep['lossless_fraction'])} | {shape} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], eval_name: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    for r in rows:
        if r["heldout_top1"]:
            ax.plot(range(1, len(r["heldout_top1"]) + 1), r["heldout_top1"], marker="o", label=r["run"])
    ax.set(xlabel="depth k (predicts x_{t+1+k})", ylabel="held-out top-1 (teacher forced)",
           title="per-depth accuracy")
    ax.legend(fontsize=8)
    ax = axes[1]
    named = [(r["run"], r["evals"][eval_name]) for r in rows if eval_name in r["evals"]]
    ax.bar([n for n, _ in named], [rep["acceptance_length"] for _, rep in named], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="acceptance length", title=f"MT-bench acceptance ({eval_name})")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    path = out.with_name(out.name + "_families.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--eval", action="append", default=None, help="eval report name(s) under <run>/eval/")
    ap.add_argument("--out", type=Path, default=None, help="prefix for <out>.md and <out>_families.png")
    a = ap.parse_args()
    names = a.eval or ["mtbench-cpu"]
    missing = [r for r in a.runs if not (r / "export" / "config.json").is_file()]
    for r in missing:
        print(f"skipping {r}: no export/config.json (the run has not finished)")
    results = Results(a.out.with_suffix(".json") if a.out else None, {"evals": names, "runs": {}})
    rows = []
    for r in a.runs:
        if r in missing:
            continue
        with results.arm("runs", r.name) as row:
            rows.append(describe(r, names))
            row.update({k: v for k, v in rows[-1].items() if k != "evals"},
                       evals={n: str(r / "eval" / n / "report.json") for n in rows[-1]["evals"]})
    md = markdown(rows, names)
    print(md)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.out.with_suffix(".md"), md)
        for p in plot(rows, names[0], a.out):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
