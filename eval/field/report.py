"""The field report: per set, acceptance length with a 95 % bootstrap interval over prompts and acceptance by depth;
the mean over sets; a table (field.md) and one plot (field.png); paired intervals between two drafts judged on the
same prompts (`paired`).

AL of a set = its decode steps' (accepted drafts + 1) summed over its prompts / its steps (pooled, as decoding's
reports pool tokens over steps). Intervals resample prompts (BOOT draws, seed 0); the mean over sets resamples
every set's prompts at once.
"""

from __future__ import annotations

import random
from pathlib import Path

from core.atomic import write_json_atomic, write_text_atomic
from core.jsonl import read_finished_rows

BOOT = 2000


def _al(rows: list[dict]) -> float:
    steps = sum(len(r["accept_lengths"]) for r in rows)
    return sum(sum(r["accept_lengths"]) for r in rows) / steps if steps else float("nan")


def _interval(values: list[float]) -> list[float]:
    v = sorted(values)
    return [v[int(0.025 * len(v))], v[int(0.975 * len(v)) - 1]]


def _depth_rates(rows: list[dict]) -> list[float]:
    depth = max((len(r["proposed_per_depth"]) for r in rows), default=0)
    acc, prop = [0] * depth, [0] * depth
    for r in rows:
        for k, (a, p) in enumerate(zip(r["accepted_per_depth"], r["proposed_per_depth"])):
            acc[k] += a
            prop[k] += p
    return [a / p if p else 0.0 for a, p in zip(acc, prop)]


def by_set(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["set"], []).append(r)
    return out


def field_report(rows: list[dict], meta: dict, draws: int = BOOT) -> dict:
    rng = random.Random(0)
    sets = by_set(rows)
    boots = {s: [_al([rng.choice(rs) for _ in rs]) for _ in range(draws)] for s, rs in sets.items()}
    table = []
    for s, rs in sets.items():
        table.append({"set": s, "prompts": len(rs), "steps": sum(len(r["accept_lengths"]) for r in rs),
                      "acceptance_length": _al(rs), "interval": _interval(boots[s]),
                      "accept_rate_per_depth": _depth_rates(rs),
                      "tree_nodes_per_step": sum(r["tree_nodes"] for r in rs) / max(1, sum(len(r["accept_lengths"])
                                                                                            for r in rs)),
                      "tf_differs_prompts": sum(bool(r.get("tf_differs")) for r in rs)})
    mean = sum(t["acceptance_length"] for t in table) / len(table) if table else float("nan")
    mean_boot = [sum(boots[s][k] for s in sets) / len(sets) for k in range(draws)] if sets else []
    return {"meta": meta, "sets": table, "prompts": len(rows), "mean_over_sets": mean,
            "mean_interval": _interval(mean_boot) if mean_boot else None, "pooled": _al(rows)}


def paired(rows_a: list[dict], rows_b: list[dict], draws: int = BOOT) -> dict:
    """AL(a) - AL(b) per set and over sets on the prompts both were judged on, with 95 % paired bootstrap intervals
    (the same resampled prompts for both)."""
    rng = random.Random(0)
    a, b = {r["id"]: r for r in rows_a}, {r["id"]: r for r in rows_b}
    common = [i for i in a if i in b]
    sets: dict[str, list[str]] = {}
    for i in common:
        sets.setdefault(a[i]["set"], []).append(i)
    out, mean_draws = {}, [0.0] * draws
    for s, ids in sets.items():
        diffs = []
        for k in range(draws):
            pick = [rng.choice(ids) for _ in ids]
            d = _al([a[i] for i in pick]) - _al([b[i] for i in pick])
            diffs.append(d)
            mean_draws[k] += d / len(sets)
        out[s] = {"prompts": len(ids), "diff": _al([a[i] for i in ids]) - _al([b[i] for i in ids]),
                  "interval": _interval(diffs)}
    mean = sum(v["diff"] for v in out.values()) / len(out) if out else float("nan")
    return {"sets": out, "mean_diff": mean, "mean_interval": _interval(mean_draws) if out else None,
            "prompts": len(common)}


EXACT = "exact (one prompt at a time through the decoder loop, --no-lockstep)"


def path_label(meta: dict) -> str:
    """The path a field report's figures took, in the words every output uses: `exact` (one prompt at a time
    through the decoder loop) or `batched (lockstep B; measured agreement: ...)` with the agreement of a sample of
    its own prompts re-decoded one at a time (eval/field/simulation.py: measure_agreement), or that none was measured.
    A report written before the path was recorded says what its lockstep width implies."""
    width = meta.get("lockstep") or 0
    if meta.get("path", "batched" if width else "exact") == "exact":
        return EXACT
    a = meta.get("agreement")
    redone = meta.get("near_tie_redone")
    width = f"{width}, {redone} prompts with a near tie redone exactly" if redone else width
    if not a:
        return f"batched (lockstep {width}; agreement with the exact path not measured in this run)"
    where = f" on {a['max_set_al_diff_set']}" if a.get("max_set_al_diff_set") and a["max_set_al_diff"] else ""
    return (f"batched (lockstep {width}; measured agreement: {a['identical_steps']:,} of {a['steps']:,} steps "
            f"identical, {a['identical_rows']} of {a['rows']} prompts' rows identical, max per-set AL diff "
            f"{a['max_set_al_diff']:.3f}{where}; on {a['rows']} of its prompts re-decoded one at a time: "
            f"{', '.join(a['prompts'])})")


def dtype_words(meta: dict) -> str:
    """The judged dtype, with the mark of a judgement against stored answers of another dtype."""
    mark = meta.get("dtype_mark")
    return f"{meta['dtype']}; MARKED: {mark}" if mark else meta["dtype"]


def headline(report: dict) -> str:
    """One line: what was judged, how many prompts, on which path."""
    m = report["meta"]
    of = f" of {m['stored_prompts']:,} stored" if m.get("stored_prompts") else ""
    return (f"Field benchmark (simulated greedy acceptance on stored base answers): {m['draft']} ({m['family']}, "
            f"{m['shape']}, {dtype_words(m)}), {report['prompts']} prompts{of}; path: {path_label(m)}")


def field_markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"{headline(report)}; {m['seconds'] / 60:.1f} min with {m['threads']} threads", "",
             "| set | prompts | AL | 95 % interval | accept rate by depth | tokens verified per step |",
             "|---|---:|---:|---|---|---:|"]
    for t in report["sets"]:
        depth = " / ".join(f"{x:.2f}" for x in t["accept_rate_per_depth"][:6])
        lo, hi = t["interval"]
        lines.append(f"| {t['set']} | {t['prompts']} | **{t['acceptance_length']:.3f}** | {lo:.3f}-{hi:.3f} | {depth} "
                     f"| {t['tree_nodes_per_step']:.1f} |")
    if report["mean_interval"]:
        lo, hi = report["mean_interval"]
        lines.append(f"| **mean over sets** | {report['prompts']} | **{report['mean_over_sets']:.3f}** | "
                     f"{lo:.3f}-{hi:.3f} | | |")
    if m.get("dtype_mark"):
        lines += ["", f"MARKED: {m['dtype_mark']}: the replayed hidden states come from another dtype than the "
                      "greedy answers they are checked against, so these figures match neither decoding."]
    differ = sum(t["tf_differs_prompts"] for t in report["sets"])
    if differ:
        lines += ["", f"{differ} prompts' stored answers differ from this machine's teacher-forced argmax somewhere "
                      "(near-exact ties between engines; there simulation and a decode here can part)."]
    return "\n".join(lines) + "\n"


def write_field_report(out_dir: Path, report: dict) -> None:
    out_dir = Path(out_dir)
    write_json_atomic(out_dir / "field.json", report)
    write_text_atomic(out_dir / "field.md", field_markdown(report))
    plot_field(report, out_dir / "field.png")


def plot_field(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = report["sets"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    names = [t["set"] for t in sets] + ["mean"]
    vals = [t["acceptance_length"] for t in sets] + [report["mean_over_sets"]]
    ivs = [t["interval"] for t in sets] + [report["mean_interval"] or [vals[-1], vals[-1]]]
    err = [[v - lo for v, (lo, _) in zip(vals, ivs)], [hi - v for v, (_, hi) in zip(vals, ivs)]]
    ax.bar(range(len(vals)), vals, yerr=err, capsize=3, color=["C0"] * len(sets) + ["C1"])
    ax.set_xticks(range(len(vals)), names, rotation=30, ha="right")
    ax.set_ylabel("acceptance length (tokens / step)")
    ax.set_ylim(1.0, max(max(v for _, v in ivs) * 1.05, 1.1))
    m = report["meta"]
    how = "exact" if path_label(m) == EXACT else f"batched (lockstep {m.get('lockstep')})"
    ax.set_title(f"{m['family']} {m['shape']} ({dtype_words(m)}): {report['prompts']} prompts, {how}, 95 % "
                 "intervals", fontsize=9)
    for t in sets:
        bx.plot(range(1, len(t["accept_rate_per_depth"]) + 1), t["accept_rate_per_depth"], marker="o", label=t["set"])
    bx.set_xlabel("depth")
    bx.set_ylabel("accept rate")
    bx.set_title("acceptance by depth")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_rows(out_dir: Path) -> list[dict]:
    """Every rank's finished rows of a field report directory (read only: a rank may still be writing)."""
    return [row for p in sorted(Path(out_dir).glob("rows-*.jsonl")) for row in read_finished_rows(p, repair=False)]
