"""The `EAGLE-3 levers on the field benchmark` table of docs/lab/results.md and its plot, from the arms that
recipes/eagle3_levers_field.sh trained and judged (runs/levers-field-<arm>/: metrics.jsonl, field-chain4/field.json
and paired.json, the arm's paired difference from the base arm on the same prompts).

    .venv/bin/python recipes/levers_field_table.py [--plot docs/lab/img/levers_field.png] [arm ...]

An arm wins when the lower end of its paired 95 % interval (mean over sets) is above 0, loses when the upper end is
below 0, and ties otherwise. Arms not trained or not judged yet are listed as such, not skipped in silence.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ARMS = ("base", "noise", "tv", "rkl", "muon", "lk", "vocab32k", "dspark_mix", "ttt5", "layers2", "peagle",
        "dspark_family")
CHANGE = {  # what each arm changes from the base arm (recipes/eagle3_levers_field.sh arm_args)
    "base": "the store recipe: forward KL (soft CE), TTT 3, AdamW lr 2e-3, 16k draft vocab",
    "noise": "Gaussian noise std 0.05 on the aux hidden states",
    "tv": "total variation instead of KL",
    "rkl": "reverse KL instead of KL",
    "muon": "Muon for the 2-D weights",
    "lk": "LK hybrid: λ·KL + (1-λ)·TV, λ = exp(-3·α)",
    "vocab32k": "32,768-token draft vocabulary",
    "dspark_mix": "DSpark's mix: 0.1·CE + 0.9·TV",
    "ttt5": "5 TTT steps (the base arm's compute: 870 / 1.79 steps)",
    "layers2": "2 decoder layers (870 / 1.46 steps)",
    "peagle": "P-EAGLE: 4 tokens from one forward (870 / 1.19 steps)",
    "dspark_family": "the DSpark family, its default chain of 8 (75 wall minutes beside another arm)",
}


def arm_row(arm: str, runs: Path) -> dict:
    """One arm's numbers; `status` says what is missing when it is not judged."""
    run = runs / f"levers-field-{arm}"
    row = {"arm": arm, "change": CHANGE.get(arm, "?")}
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return {**row, "status": "not trained"}
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "tokens_per_s" in s]
    row["steps"] = max((s["step"] for s in steps), default=0)
    row["tok_s"] = statistics.median(s["tokens_per_s"] for s in steps) if steps else None
    # EAGLE-3 arms are judged as a chain of 4 (field-chain4/), another family as its own default chain (field-chain/)
    judged = next((run / d for d in ("field-chain4", "field-chain") if (run / d / "field.json").exists()),
                  run / "field-chain4")
    field = judged / "field.json"
    if not field.exists():
        return {**row, "status": "trained, not judged" if (run / "export").exists()
                else f"stopped at step {row['steps']}: the recipe resumes it from its last checkpoint"}
    report = json.loads(field.read_text())
    mtbench = next((s["acceptance_length"] for s in report["sets"] if s["set"] == "mtbench"), None)
    row.update(prompts=report["prompts"], mean=report["mean_over_sets"], interval=report["mean_interval"],
               mtbench=mtbench, status="judged")
    paired = judged / "paired.json"
    if paired.exists():
        p = json.loads(paired.read_text())
        lo, hi = p["mean_interval"]
        row.update(diff=p["mean_diff"], diff_interval=[lo, hi],
                   verdict="wins" if lo > 0 else "loses" if hi < 0 else "ties")
    return row


def markdown(rows: list[dict]) -> str:
    out = ["| arm | changed from the base arm | steps | median train tok/s (shared CPU: no speed claim) | prompts | "
           "MT-bench chain-4 AL | mean over sets [95 %] | minus base, paired [95 %] | verdict |",
           "|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        if r["status"] != "judged":
            out.append(f"| {r['arm']} | {r['change']} | {r.get('steps', '—')} | "
                       f"{_f(r.get('tok_s'), '.0f')} | — | — | — | — | {r['status']} |")
            continue
        lo, hi = r["interval"]
        diff = (f"{r['diff']:+.3f} [{r['diff_interval'][0]:+.3f}, {r['diff_interval'][1]:+.3f}]"
                if "diff" in r else "—")
        out.append(f"| {r['arm']} | {r['change']} | {r['steps']} | {_f(r['tok_s'], '.0f')} | {r['prompts']} | "
                   f"{_f(r['mtbench'], '.3f')} | {r['mean']:.3f} [{lo:.3f}, {hi:.3f}] | {diff} | "
                   f"{r.get('verdict', 'reference' if r['arm'] == 'base' else '—')} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Each arm's paired difference from the base arm with its interval: one look says which arms clear 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judged = [r for r in rows if "diff" in r]
    if not judged:
        return
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(judged) + 1.2))
    for i, r in enumerate(judged):
        lo, hi = r["diff_interval"]
        color = {"wins": "tab:green", "loses": "tab:red"}.get(r["verdict"], "tab:gray")
        ax.errorbar(r["diff"], i, xerr=[[r["diff"] - lo], [hi - r["diff"]]], fmt="o", color=color, capsize=3)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(judged)), [r["arm"] for r in judged])
    ax.invert_yaxis()
    ax.set_xlabel("acceptance length minus the base arm's\n"
                  "(chain of 4, another family its default chain; mean over sets, paired 95 %)", fontsize=9)
    ax.set_title(f"Training levers at the base arm's compute, field benchmark ({judged[0]['prompts']} prompts)",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _f(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms", nargs="*", default=list(ARMS))
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--plot", type=Path, default=None, help="write the paired-difference plot here")
    args = ap.parse_args()
    rows = [arm_row(a, args.runs) for a in args.arms]
    print(markdown(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
