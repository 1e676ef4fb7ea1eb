"""The families table of docs/lab/field_families.md, and the small steps recipes/field_families.sh takes per run.

Every figure comes from the files kept in the repository (REPORTS = docs/lab/field_families/<run>/): each run's
train.json (steps, tokens, CPU-minutes, machine kind) and its field reports (field.json, and the rows, xz-compressed,
from which the paired differences against the equal-budget EAGLE-3 are computed: the same seeded paired bootstrap
as `specdraft field --against`), so the table regenerates without retraining or re-judging:

    .venv/bin/python recipes/field_families_table.py                      # writes docs/lab/field_families.md
    .venv/bin/python recipes/field_families_table.py table --out -        # to stdout

Subcommands the recipe uses: collect (a finished run's train.json), done (is a field report complete), probe /
probe-minutes (the per-prompt cost of a shape on one prompt of every set), keep (copy a report's small files).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling recipes

# the training record (train.json): how it is collected and how its CPU count reads
from field_train_record import (  # noqa: E402,F401  (cpu_cost, cpu_cell: results_page.py and the tests read them here)
    _title,
    cmd_collect,
    cpu_cell,
    cpu_cost,
    machine_kind,
)

REPORTS = Path("docs/lab/field_families")
OUT = Path("docs/lab/field_families.md")
REFS = Path("datasets/smollm2-field-refs")
PLOT_LIMIT = 200_000  # bytes: a field.png over this is not kept
# The seed families' figures before this budget (decoded MT-bench tree / beam / paths AL), by label: a data file.
OFF_POLICY = "off_policy.json"
CLAIMS = "paper_claims.json"  # the seed papers' orderings and the report pairs that answer them
NOTES = "notes.md"  # hand-written, appended to the generated page as it stands
PREFIX = "ff"  # the recipe's run prefix (RUN_PREFIX): runs are <prefix>-<run>
TREE_SHAPES = ("tree16", "beam8x3", "paths8", "mixed10x10", "mixed4x4")
SHAPE_WORDS = {"chain4": "chain of 4", "chain": "chain", "tree16": "16-node tree", "beam8x3": "8 beams x 3",
               "paths8": "8 collapsed paths", "mixed10x10": "10 rows x 10 (context + bigram)",
               "lookup4": "prompt lookup, 4", "mixed4x4": "4 rows x 4 (context + bigram)"}
# The learning-free baseline's shape each learned shape is held against (the issue's "above the N-gram baseline on
# every set"): a chain against one prompt-lookup row of 4, a tree / beam / paths against 4 x 4 rows (16 nodes).
BASELINE_SHAPES = {"chain4": "lookup4", "tree16": "mixed4x4"}


def reference_run(prefix: str = PREFIX) -> str:
    """The equal-budget run every other is paired with: the one its family declares the reference (FieldRun.reference;
    EAGLE-3), "" when none is."""
    from models.registry import field_runs

    ref = next((name for name, run in field_runs().items() if run.reference), None)
    return f"{prefix}-{ref}" if ref else ""


# -- the recipe's steps ------------------------------------------------------------------------------------------

def _stored_prompts(refs: Path) -> int:
    return int(json.loads((refs / "card.json").read_text())["prompts"])


def cmd_done(a) -> int:
    """Exit 0 when the report covers every stored answer (and holds paired.json with --paired)."""
    f = Path(a.report) / "field.json"
    if not f.is_file():
        return 1
    rep = json.loads(f.read_text())
    if rep.get("prompts", 0) < _stored_prompts(Path(a.refs)):
        return 1
    if a.paired and not (Path(a.report) / "paired.json").is_file():
        return 1
    return 0


def cmd_probe(a) -> int:
    rep = json.loads((Path(a.report) / "field.json").read_text())
    n, secs, total = rep["prompts"], rep["meta"]["seconds"], _stored_prompts(Path(a.refs))
    out = {"probe_prompts": n, "seconds": secs, "seconds_per_prompt": round(secs / n, 2),
           "estimated_minutes_all": round(secs / n * total / 60, 1), "stored_prompts": total,
           "path": rep["meta"].get("path"), "shape": rep["meta"].get("shape"),
           "note": "seconds include loading the draft and the base and any field-cache build for these prompts: "
                   "an upper bound", "machine": machine_kind()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


def cmd_probe_minutes(a) -> int:
    print(int(json.loads(Path(a.probe).read_text())["estimated_minutes_all"]))
    return 0


def cmd_keep(a) -> int:
    src, dest = Path(a.report), Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("field.json", "field.md", "paired.json", "paired.md", "probe.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    png = src / "field.png"
    if png.is_file() and png.stat().st_size <= PLOT_LIMIT:
        shutil.copy2(png, dest / "field.png")
    for rows in sorted(src.glob("rows-*.jsonl")):
        with open(rows, "rb") as fin, lzma.open(dest / (rows.name + ".xz"), "wb", preset=9) as fout:
            shutil.copyfileobj(fin, fout)
    size = sum(p.stat().st_size for p in dest.iterdir())
    print(f"kept {src} in {dest}: {size / 1e3:.0f} kB")
    return 0


# -- the table ----------------------------------------------------------------------------------------------------

def read_kept_rows(d: Path) -> list[dict]:
    rows = {}
    for p in sorted(d.glob("rows-*.jsonl.xz")):
        with lzma.open(p, "rt") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    rows[r["id"]] = r
    return list(rows.values())


def load_runs(reports: Path) -> dict[str, dict]:
    runs = {}
    for d in sorted(p for p in reports.iterdir() if p.is_dir()) if reports.is_dir() else []:
        t = json.loads((d / "train.json").read_text()) if (d / "train.json").is_file() else None
        if t and "cpu_basis" not in t and t.get("train_minutes"):
            # a train.json collected before the basis was kept: its CPU-minutes judged by the same rule, from
            # what it recorded (the loop's minutes and the `time` records of its starts)
            t.update(cpu_cost({"train_seconds": 60 * t["train_minutes"]}, t.get("invocations") or []))
        fields = {}
        for f in sorted(d.glob("field-*")):
            shape = f.name.removeprefix("field-")
            entry = {"dir": f}
            if (f / "field.json").is_file():
                entry["report"] = json.loads((f / "field.json").read_text())
            if (f / "probe.json").is_file():
                entry["probe"] = json.loads((f / "probe.json").read_text())
            fields[shape] = entry
        fam = (t or {}).get("family") or d.name.split("-", 1)[-1]
        # a family's own diagnostics (FieldRun.diagnostics: REPORTS/<run>/<script's stem>.json; CTC's)
        diag = next((json.loads(f.read_text()) for f in sorted(d.glob("*diagnostics.json"))), None)
        runs[d.name] = {"family": fam, "train": t, "fields": fields, "diagnostics": diag}
    return runs


def _fmt_iv(v: float, iv) -> str:
    return f"{v:.3f} [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else f"{v:.3f}"


def _set_al(rep: dict, name: str):
    for s in rep["sets"]:
        if s["set"] == name:
            return s
    return None


def _label(r: dict) -> str:
    return (r["train"] or {}).get("label") or _title(r["family"])


def _trainable(family: str) -> bool:
    from models.registry import FAMILIES

    return FAMILIES[family].trainable if family in FAMILIES else True


def _rank(r: dict) -> int:
    from models.registry import FAMILIES

    fam = (r["train"] or {}).get("export_family") or r["family"]
    return list(FAMILIES).index(fam) if fam in FAMILIES else len(FAMILIES)


def build_table(reports: Path, command: str, reference: str | None = None, shown: str | None = None) -> str:
    from eval.field.report import paired

    reference = reference or reference_run()
    runs = load_runs(reports)
    ref = runs.get(reference)
    off = json.loads((reports / OFF_POLICY).read_text()) if (reports / OFF_POLICY).is_file() else {}
    lines = ["# Every family on the field benchmark at one budget", "",
             f"Generated by `{command}` from the reports kept in `{shown or reports}/` (each run's `train.json` and "
             "its field reports: `field.json` and the rows, xz-compressed); do not edit by hand. The recipe that "
             "trains and judges them: `recipes/field_families.sh` (its header gives the budget, the data and every "
             "family's recipe). Field: simulated greedy acceptance length (AL, the bonus token counted) on the "
             "base's stored fp32 answers (`datasets/smollm2-field-refs`, 11 sets), 95 % bootstrap intervals; paired: "
             f"this family minus the equal-budget EAGLE-3 (`{reference}`) on the same prompts (chains against its "
             "chain of 4, trees, beams and paths against its 16-node tree), 95 % paired bootstrap.", ""]
    lines += ["## Training", "",
              "| family | run | steps x batch | tokens seen | epochs | trainable params | lr | train min | CPU-min | "
              "threads | median tok/s | machine | held-out top-1 by depth |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    ordered = sorted(runs.items(), key=lambda kv: (_rank(kv[1]), _label(kv[1])))
    for name, r in ordered:
        t = r["train"]
        if not t:
            what = "learning-free: no training" if not _trainable(r["family"]) else "not finished"
            lines.append(f"| {_label(r)} | `{name}` | {what} | | | | | | | | | | |")
            continue
        top1 = " / ".join(f"{x:.3f}" for x in t.get("heldout", {}).get("top1_by_depth", [])[:5]) or "-"
        tps = t.get("tokens_per_s") or {}
        lines.append(f"| {_label(r)} | `{name}` | {t['steps']} x {t['global_batch']} | "
                     f"{(t.get('tokens_seen') or 0) / 1e6:.2f}M | {t.get('epochs')} | "
                     f"{(t.get('trainable_params') or 0) / 1e6:.2f}M | {t.get('lr')} | {t.get('train_minutes')} | "
                     f"{cpu_cell(t)} | {t.get('threads') or '-'} | {tps.get('median', '-')} | {t['machine']['kind']} | "
                     f"{top1} |")
    lines += ["", "CPU-min: the CPU time of the training process over all its restarts (all its threads): what the "
              "family's tokens cost; the trainer's own count (`train_cpu_seconds`), else `time`'s user + system "
              "summed over the starts (model loading included). *≤*: a start killed with its session left no "
              "record, so the cell is the loop's wall clock, an upper bound at one thread. Threads: the trainer's "
              "(its last start; a run alone on the machine took both cores, which shortens its train min, not its "
              "tokens). Train min: the training "
              "loop's wall clock, which also counts the time the process waited for the CPU or was stopped (other "
              "jobs on a shared machine; the load averages at each start and end are in each `train.json`).", ""]
    all_sets: list[str] = []
    for r in runs.values():
        for e in r["fields"].values():
            for s in e.get("report", {}).get("sets", []):
                if s["set"] not in all_sets:
                    all_sets.append(s["set"])
    lines += ["## Field acceptance length per set", "",
              "| family | shape | path | prompts | " + " | ".join(all_sets) + " | mean over sets [95 %] | "
              "minus EAGLE-3, paired [95 %] |",
              "|---|---|---|---:|" + "---:|" * len(all_sets) + "---|---|"]
    notes = []
    for name, r in ordered:
        for shape, e in r["fields"].items():
            if "report" not in e:
                if "probe" in e:
                    p = e["probe"]
                    notes.append(f"- {_label(r)} {SHAPE_WORDS.get(shape, shape)}: not judged on every prompt: "
                                 f"{p['seconds_per_prompt']} s a prompt on {p['probe_prompts']} prompts, "
                                 f"~{p['estimated_minutes_all']:.0f} min for all {p['stored_prompts']} "
                                 "(over the recipe's FIELD_MAX_MIN).")
                continue
            rep = e["report"]
            m = rep["meta"]
            cells = []
            for s in all_sets:
                st = _set_al(rep, s)
                cells.append(f"{st['acceptance_length']:.3f} [{st['interval'][0]:.2f}, {st['interval'][1]:.2f}]"
                             if st else "-")
            diff = "-"
            if ref and name != reference:
                kind = "tree16" if shape in TREE_SHAPES else "chain4"
                other = ref["fields"].get(kind, {})
                if other.get("report"):
                    pr = paired(read_kept_rows(e["dir"]), read_kept_rows(other["dir"]))
                    if pr["prompts"]:
                        lo, hi = pr["mean_interval"]
                        diff = f"{pr['mean_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({pr['prompts']} prompts, vs {kind})"
            path = m.get("path", "batched" if m.get("lockstep") else "exact")
            if path == "batched" and m.get("agreement"):
                ag = m["agreement"]
                path += f" (agreement: {ag['identical_rows']}/{ag['rows']} prompts' rows identical)"
            lines.append(f"| {_label(r)} | {SHAPE_WORDS.get(shape, shape)} | {path} | {rep['prompts']} | "
                         + " | ".join(cells) + f" | **{_fmt_iv(rep['mean_over_sets'], rep['mean_interval'])}** | "
                         f"{diff} |")
    lines += ["", "N-gram: the learning-free baseline, judged by `recipes/field_ngram.py` (the field benchmark's exact "
              "path with the N-gram drafter: `specdraft field` judges exports only); its prompt-lookup chain of 4 "
              "is paired with EAGLE-3's chain of 4, its 10 x 10 rows with EAGLE-3's 16-node tree.", ""]
    if notes:
        lines += ["Not judged:", ""] + notes + [""]
    lines += depth_section(ordered)
    for _name, r in ordered:
        c = r.get("diagnostics")
        if not c:
            continue
        fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        lines += [f"### {_label(r)}: its greedy frames on the stored answers (teacher forced)", "",
                  f"`{c['command']}`: {c['prompts']} prompts, {c['positions']:,} answer positions, {c['frames']} "
                  "frames; the chain's path is the CTC collapse of each frame's top-1 class.", "",
                  "| measure | by frame / depth 1..M |", "|---|---|",
                  f"| blank rate per frame | {fmt(c['blank_rate_per_frame'])} |",
                  f"| repeats merged (frame pairs) | {fmt(c['repeat_merged_per_frame_pair'])} |",
                  f"| collapsed path length 0..M (share) | {fmt(c['path_length_share'])} (mean "
                  f"{c['path_length_mean']:.2f}) |",
                  f"| path right at depths 1..k | {fmt(c['depth_accuracy'])} |",
                  f"| the same, given the path reaches depth k | {fmt(c['depth_accuracy_given_long_enough'])} |",
                  f"| frame k's top real token = its aligned target | {fmt(c['frame_top_real_accuracy'])} |", ""]
    seed = []
    for _name, r in ordered:
        before = off.get("mtbench_tree", {}).get(_label(r))
        tree = next((e for s, e in r["fields"].items() if s in TREE_SHAPES and e.get("report")), None)
        if before is None or tree is None:
            continue
        mt = _set_al(tree["report"], "mtbench")
        al = mt["acceptance_length"]
        seed.append(f"| {_label(r)} | {before:.2f} | {al:.3f} [{mt['interval'][0]:.3f}, {mt['interval'][1]:.3f}] | "
                    f"{al - before:+.2f} | {'met' if al >= before + 0.2 else 'missed'} |")
    if seed:
        lines += ["## MT-bench tree / beam / paths AL against the off-policy 32-prompt figure", "",
                  f"Off-policy: {off.get('source', '')}; field: MT-bench's 80 first turns, whole stored answers (up "
                  "to 256 tokens), simulated. Target: field ≥ off-policy + 0.2.", "",
                  "| family | off-policy (32 prompts) | field MT-bench [95 %] | difference | target +0.2 |",
                  "|---|---:|---|---:|---|"] + seed + [""]
    lines += claims_section(reports, runs)
    lines += baseline_section(ordered)
    notes_file = reports / NOTES
    if notes_file.is_file():  # the hand-written part: set-up, budget, what the rows say
        lines += [notes_file.read_text().rstrip(), ""]
    return "\n".join(lines) + "\n"


def baseline_section(ordered) -> list[str]:
    """Every learned run's judged shapes against the learning-free baseline of the same budget (BASELINE_SHAPES), set
    by set: paired differences on the same prompts, and on how many of the 11 sets the learned draft is above, below
    or not told apart at 95 %."""
    from eval.field.report import paired

    base = next((r for _n, r in ordered if not _trainable(r["family"])), None)
    if base is None:
        return []
    out = ["## Against the learning-free N-gram baseline, set by set", "",
           "Target: each learned family above the N-gram baseline on every set. Paired on the same prompts: chains "
           f"against its {SHAPE_WORDS['lookup4']} (what serving engines draft), trees, beams and paths against its "
           f"{SHAPE_WORDS['mixed4x4']} (16 nodes, the learned trees' budget). Above / below: the set's 95 % paired "
           "interval excludes 0.", "",
           "| family | shape | vs N-gram | minus N-gram, mean of sets [95 %] | sets above / below / not told apart "
           "| sets below | target |", "|---|---|---|---|---:|---|---|"]
    for _name, r in ordered:
        if r is base:
            continue
        for shape, e in r["fields"].items():
            other = base["fields"].get(BASELINE_SHAPES["tree16" if shape in TREE_SHAPES else "chain4"], {})
            if not (e.get("report") and other.get("report")):
                continue
            pr = paired(read_kept_rows(e["dir"]), read_kept_rows(other["dir"]))
            if not pr["prompts"]:
                continue
            above = [s for s, v in pr["sets"].items() if v["interval"][0] > 0]
            below = sorted(s for s, v in pr["sets"].items() if v["interval"][1] < 0)
            lo, hi = pr["mean_interval"]
            target = "met" if len(above) == len(pr["sets"]) else "missed"
            out.append(f"| {_label(r)} | {SHAPE_WORDS.get(shape, shape)} | "
                       f"{SHAPE_WORDS.get(other['dir'].name.removeprefix('field-'), '')} | "
                       f"{pr['mean_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {len(above)} / {len(below)} / "
                       f"{len(pr['sets']) - len(above) - len(below)} | {', '.join(below) or '-'} | {target} |")
    return out + [""]


def claims_section(reports: Path, runs: dict[str, dict]) -> list[str]:
    """The seed papers' orderings (CLAIMS), each answered by a paired difference of two kept reports on the same
    prompts: over all 11 sets (the mean of the per-set differences) and on the claim's own set when it names one."""
    from eval.field.report import paired

    f = reports / CLAIMS
    if not f.is_file():
        return []
    spec = json.loads(f.read_text())
    out = ["## The seed papers' orderings on the field", "", spec["note"], "",
           "| claim | paper | a - b, mean of 11 sets [95 %] | a - b, MT-bench [95 %] | verdict |",
           "|---|---|---|---|---|"]
    for c in spec["claims"]:
        (ra, sa), (rb, sb) = c["a"], c["b"]
        ea, eb = (runs.get(r, {}).get("fields", {}).get(s, {}) for r, s in ((ra, sa), (rb, sb)))
        if not (ea.get("report") and eb.get("report")):
            missing = [f"{r} {s}" for (r, s), e in (((ra, sa), ea), ((rb, sb), eb)) if not e.get("report")]
            out.append(f"| {c['claim']} | {c['paper']} | | | not judged yet ({', '.join(missing)}) |")
            continue
        pr = paired(read_kept_rows(ea["dir"]), read_kept_rows(eb["dir"]))
        lo, hi = pr["mean_interval"]
        mt = pr["sets"].get("mtbench")
        mt_cell = f"{mt['diff']:+.3f} [{mt['interval'][0]:+.3f}, {mt['interval'][1]:+.3f}]" if mt else "-"
        if c["test"] == "within":
            d = pr["sets"].get(c["set"]) if c.get("set") else {"diff": pr["mean_diff"], "interval": [lo, hi]}
            ok = abs(d["diff"]) <= c["margin"]
            verdict = (f"{'holds' if ok else 'fails'}: {d['diff']:+.3f}, {'within' if ok else 'beyond'} ±{c['margin']}"
                       + (f" on {c['set']}" if c.get("set") else ""))
        else:
            verdict = ("holds (beyond the interval)" if lo > 0 else "fails (beyond the interval)" if hi < 0
                       else "not resolved (the interval spans 0)")
        out.append(f"| {c['claim']} (`{ra}` {SHAPE_WORDS.get(sa, sa)} vs `{rb}` {SHAPE_WORDS.get(sb, sb)}) | "
                   f"{c['paper']} | {pr['mean_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({pr['prompts']} prompts) | "
                   f"{mt_cell} | {verdict} |")
    return out + [""]


def depth_stats(rows: list[dict], depths: int = 4) -> dict:
    """Over every decode step of these rows: drafted tokens a step (the chain's or collapsed path's length, from
    proposed_per_depth), the share of steps accepting >= k drafts, and that share among the steps that proposed
    depth k (the draft's accuracy where it drafted at all)."""
    steps = sum(len(r["accept_lengths"]) for r in rows)
    acc = [sum(r["accepted_per_depth"][k] for r in rows if len(r["accepted_per_depth"]) > k) for k in range(depths)]
    prop = [sum(r["proposed_per_depth"][k] for r in rows if len(r["proposed_per_depth"]) > k) for k in range(depths)]
    drafted = sum(sum(r["proposed_per_depth"]) for r in rows)
    return {"steps": steps, "drafted_per_step": drafted / max(steps, 1),
            "accept": [a / max(steps, 1) for a in acc],
            "accept_given_proposed": [a / p if p else float("nan") for a, p in zip(acc, prop)],
            "proposed": [p / max(steps, 1) for p in prop]}


def depth_section(ordered) -> list[str]:
    """Each chain depth by depth on MT-bench (first turns) and over every prompt: where a chain loses its tokens."""
    out = []
    for _name, r in ordered:
        for shape, e in r["fields"].items():
            if shape in TREE_SHAPES or "report" not in e:
                continue
            rows = read_kept_rows(e["dir"])
            for where, sel in (("MT-bench", [x for x in rows if x["set"] == "mtbench"]), ("all", rows)):
                if not sel:
                    continue
                d = depth_stats(sel)
                out.append(f"| {_label(r)} | {SHAPE_WORDS.get(shape, shape)} | {where} | {d['steps']:,} | "
                           f"{d['drafted_per_step']:.2f} | " + " / ".join(f"{x:.2f}" for x in d["proposed"]) + " | "
                           + " / ".join(f"{x:.3f}" for x in d["accept"]) + " | "
                           + " / ".join(f"{x:.3f}" for x in d["accept_given_proposed"]) + " |")
    if not out:
        return []
    return ["## Chains depth by depth (from the field rows)", "",
            "Drafted: tokens the chain (for CTC: the collapsed path) put up per step; reached: share of steps whose "
            "chain reached depth k; accepted: share of steps accepting ≥ k drafts; given reached: accepted / reached "
            "(how often the draft is right at depth k where it drafted at all, after k-1 right).", "",
            "| family | shape | prompts | steps | drafted a step | reached k = 1..4 | accepted k = 1..4 | "
            "given reached k = 1..4 |", "|---|---|---|---:|---:|---|---|---|"] + out + [""]


def cmd_table(a) -> int:
    from core.paths import repo_relative

    command = "python recipes/field_families_table.py"
    shown = repo_relative(a.reports)  # the folder as the page names it: in the checkout, whichever machine wrote it
    if shown != str(REPORTS):
        command += f" --reports {shown}"
    text = build_table(Path(a.reports), command, a.reference, shown=shown)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("table", help="write the families table (the default)")
    p.add_argument("--reports", default=str(REPORTS))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--reference", default=None, help="the run the others are paired with (default: the one its "
                   "family declares the reference, ff-eagle3)")
    p = sub.add_parser("collect", help="a finished run's train.json")
    p.add_argument("--run", required=True)
    p.add_argument("--family", required=True)
    p.add_argument("--reports", default=str(REPORTS))
    p.add_argument("--command", default="")
    p.add_argument("--label", default="", help="the row's name (default: the family's title)")
    p = sub.add_parser("done", help="exit 0 when a field report covers every stored answer")
    p.add_argument("--report", required=True)
    p.add_argument("--refs", default=str(REFS))
    p.add_argument("--paired", action="store_true")
    p = sub.add_parser("probe", help="per-prompt cost of a probe report")
    p.add_argument("--report", required=True)
    p.add_argument("--refs", default=str(REFS))
    p.add_argument("--out", required=True)
    p = sub.add_parser("probe-minutes", help="the estimated minutes of a probe over every stored answer")
    p.add_argument("--probe", required=True)
    p = sub.add_parser("keep", help="copy a field report's small files into the repository")
    p.add_argument("--report", required=True)
    p.add_argument("--dest", required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in sub.choices:
        argv = ["table", *argv]
    a = ap.parse_args(argv)
    import os

    os.chdir(ROOT)
    return {"table": cmd_table, "collect": cmd_collect, "done": cmd_done, "probe": cmd_probe,
            "probe-minutes": cmd_probe_minutes, "keep": cmd_keep}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
