"""docs/results.md: the one page a user reads to choose a draft family, generated from files kept in the repository.

Every figure comes from a file, none is typed here: the equal-budget families' field reports and training records
(docs/lab/field_families/<run>/: train.json, field-<shape>/field.json and its rows, a tuning.json where the family
was tuned), the shipped drafts' field reports and tuning (drafts/<name>/field/, drafts/<name>/export/tuning.json),
and what each family declares about the engines that serve it (the model registry). Missing measurements are said
as missing, with the command that makes them.

    .venv/bin/python recipes/results_page.py            # writes docs/results.md   (make results)
    .venv/bin/python recipes/results_page.py --out -    # to stdout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT))

import field_families_table as ff  # noqa: E402  (the recipe's own reader of the kept reports)

from models.export.schema import upgrade_keys  # noqa: E402  (older reports' key names read as today's)

OUT = Path("docs/results.md")
DRAFTS = Path("drafts")
# The sets shown on the one screen (every set is in docs/lab/field_families.md): the field's headline chat set,
# code, the long-history set and a math set; the mean is over all 11.
HEADLINE_SETS = (("mtbench", "MT-bench"), ("humaneval", "HumanEval"), ("long-context", "long ctx"),
                 ("gsm8k", "GSM8K"))
ENGINES = (("ours", "ours"), ("vllm", "vLLM"), ("llamacpp", "llama.cpp"))


def _iv(v: float, iv, nd: int = 2) -> str:
    return f"{v:.{nd}f} [{iv[0]:.{nd}f}, {iv[1]:.{nd}f}]" if iv else f"{v:.{nd}f}"


def _set_cells(rep: dict) -> list[str]:
    cells = []
    for key, _ in HEADLINE_SETS:
        s = ff._set_al(rep, key)
        cells.append(f"{s['acceptance_length']:.2f}" if s else "-")
    return cells


def _speed(tuning: dict | None) -> str:
    """Our decoder's tuned ratio to its own AR with the interval, and whether its output was AR's, or what is
    missing."""
    rec = (tuning or {}).get("engines", {}).get("ours") or {}
    ch = rec.get("choice")
    if not ch:
        return "not measured"
    loaded = ((tuning or {}).get("load") or {}).get("loaded")
    conf = ch.get("confirmation") or {}
    iv = conf.get("interval") or ch.get("interval")
    same = [p.get("same_tokens_as_ar") for p in rec.get("points", []) if p.get("label") == ch.get("label")]
    verdict = "" if not same or same[0] is None else (" lossless" if same[0] == 1.0 else " NOT lossless")
    ratio = ch.get("speedup_vs_ar") or 1.0
    if ch.get("speculate") is False:  # no setting cleared AR: say how far the best fell short, not a bare 1.00x
        best = next((p for p in rec.get("points", []) if p.get("label") == ch.get("runner_up")), {})
        text = (f"slower than AR: best {best.get('label', '?')} {best.get('speedup', 0):.2f}x, lower bound "
                f"{best.get('lower_bound') or 0:.2f}x") if best else "slower than AR"
        return text + (" loaded" if loaded else "")
    text = f"{ratio:.2f}x {_iv(ratio, iv)[len(f'{ratio:.2f}'):].strip()} ({ch.get('label')}{verdict})"
    return text + (" loaded" if loaded else "")


def _served(family: str, tuning: dict | None) -> str:
    """The engines the family declares (vLLM method, llama.cpp spec type), and whether a tune there was kept."""
    from models.registry import FAMILIES

    facts = FAMILIES.get(family)
    if facts is None:
        return "-"
    out = []
    for key, word in ENGINES[1:]:
        declared = facts.vllm_method if key == "vllm" else facts.llamacpp_spec_type
        if not declared:
            continue
        rec = (tuning or {}).get("engines", {}).get(key) or {}
        ch = rec.get("choice") or {}
        out.append(f"{word} ({ch['speedup_vs_ar']:.2f}x)" if ch.get("speedup_vs_ar") else f"{word}: not checked")
    return ", ".join(out) or "ours only"


def family_rows(reports: Path, reference: str) -> list[str]:
    runs = ff.load_runs(reports)
    ref = runs.get(reference)
    ordered = sorted(runs.items(), key=lambda kv: (ff._rank(kv[1]), ff._label(kv[1])))
    rows = []
    for name, r in ordered:
        tuning_file = reports / name / "tuning.json"
        tuning = json.loads(tuning_file.read_text()) if tuning_file.is_file() else None
        t = r["train"] or {}
        cost = ff.cpu_cell(t) if t.get("cpu_minutes") is not None else (
            "0 (learning-free)" if not ff._trainable(r["family"]) else "training")
        judged = [(s, e) for s, e in r["fields"].items() if e.get("report")]
        if not judged:
            rows.append(f"| {ff._label(r)} | not judged yet | " + " | ".join("" for _ in HEADLINE_SETS)
                        + f" | | | | | {cost} | `{t.get('command') or ff_command(r['family'])}` |")
            continue
        for shape, e in judged:
            rep = e["report"]
            diff = "-"
            if ref and name != reference:
                kind = "tree16" if shape in ff.TREE_SHAPES else "chain4"
                other = ref["fields"].get(kind, {})
                if other.get("report"):
                    from eval.field.report import paired

                    pr = paired(ff.read_kept_rows(e["dir"]), ff.read_kept_rows(other["dir"]))
                    if pr["prompts"]:
                        diff = f"{pr['mean_diff']:+.2f} {_iv(0, pr['mean_interval'])[5:]}"
            rows.append(f"| {ff._label(r)} | {ff.SHAPE_WORDS.get(shape, shape)} | " + " | ".join(_set_cells(rep))
                        + f" | **{_iv(rep['mean_over_sets'], rep['mean_interval'])}** | {diff} | {_speed(tuning)} | "
                        f"{_served(r['family'], tuning)} | {cost} | `{t.get('command') or ff_command(r['family'])}` |")
    return rows


def ff_command(family: str) -> str:
    return f"FAMILIES={family} recipes/field_families.sh"


def _shape_words(meta: dict) -> str:
    """A report's shape in words: its named shape, else what its meta says it decoded (a dynamic tree's nodes)."""
    meta = upgrade_keys(meta, "a field report's meta")
    shape = meta.get("shape")
    if shape and shape != "default":
        return ff.SHAPE_WORDS.get(shape, shape)
    if meta.get("tree_nodes"):
        return f"{meta['tree_nodes']}-node tree"
    if meta.get("num_speculative_tokens"):
        return f"chain of {meta['num_speculative_tokens']}"
    return "default"


def shipped_rows(drafts: Path) -> list[str]:
    rows = []
    for d in sorted(p for p in drafts.iterdir() if p.is_dir()) if drafts.is_dir() else []:
        tuning_file = d / "export" / "tuning.json"
        tuning = json.loads(tuning_file.read_text()) if tuning_file.is_file() else None
        family = json.loads((d / "export" / "config.json").read_text()).get("family", "?")
        for f in sorted((d / "field").glob("*/field.json")):
            rep = json.loads(f.read_text())
            rows.append(f"| [`{d.name}`](../{d.as_posix()}/README.md) | {family} | {_shape_words(rep['meta'])} | "
                        + " | ".join(_set_cells(rep))
                        + f" | **{_iv(rep['mean_over_sets'], rep['mean_interval'])}** | {_speed(tuning)} | "
                        f"{_served(family, tuning)} |")
    return rows


def machine_kinds(runs: dict[str, dict]) -> str:
    """Where the families trained: 'on a <kind>', or each kind with the families trained on it (the kind changes
    between machines, and a run finished on another machine than it started on is named by where it finished)."""
    by_kind: dict[str, list[str]] = {}
    for r in runs.values():
        if r["train"]:
            by_kind.setdefault(r["train"]["machine"]["kind"], []).append(ff._label(r))
    if len(by_kind) <= 1:
        return f"on a {next(iter(by_kind), '-')}"
    return "on " + "; ".join(f"a {k} ({', '.join(sorted(v))})" for k, v in sorted(by_kind.items()))


def build_page(reports: Path, drafts: Path, reference: str) -> str:
    sets = " | ".join(w for _, w in HEADLINE_SETS)
    kind = machine_kinds(ff.load_runs(reports))
    lines = [
        "# Results: which draft to train", "",
        "Generated by `make results` (`recipes/results_page.py`) from the field reports, training records and tune "
        "records kept in the repository; do not edit by hand. Field: the **simulated greedy acceptance length** "
        "(tokens a decode step emits, the bonus counted) on the base's 1,088 stored fp32 answers over 11 sets "
        "(`datasets/smollm2-field-refs`; [what the field benchmark is](concepts.md#simulated-acceptance)), with 95 % "
        "bootstrap intervals; four sets shown, the mean over all 11. Base: SmolLM2-135M-Instruct.", "",
        "## The shipped draft", "",
        f"| draft | family | shape | {sets} | mean of 11 [95 %] | decoded vs own AR (ours) | engines |",
        "|---|---|---|" + "---:|" * len(HEADLINE_SETS) + "---|---|---|"]
    lines += shipped_rows(drafts) or ["| none shipped | | | | | | | | | |"]
    lines += [
        "", "## Every family at one budget", "",
        "Each family trained on the same on-policy records (`datasets/smollm2-sharegpt-onpolicy`, the first 256 "
        "tokens of each conversation, 1,880 steps x 8 conversations: the tokens EAGLE-3 trains on in 60 CPU-minutes "
        f"at one thread) with its best recipe, {kind}. *vs EAGLE-3*: paired difference against the "
        "equal-budget EAGLE-3 on the same prompts (chains against its chain of 4, trees, beams and paths against its "
        "16-node tree). *CPU-min*: what the family's training cost. *Decoded*: `specdraft tune --engine ours` on the "
        "family's export, its tuned shape's ratio to its own autoregressive decoding with the 95 % interval; "
        "*engines*: those the family declares, with the serving engine's tuned ratio where it was measured.", "",
        f"| family | shape | {sets} | mean of 11 [95 %] | vs EAGLE-3 [95 %] | decoded vs own AR | engines | CPU-min "
        "| reproduce |",
        "|---|---|" + "---:|" * len(HEADLINE_SETS) + "---|---|---|---|---:|---|"]
    lines += family_rows(reports, reference)
    lines += [
        "", "*not measured*: `TUNE=2 FAMILIES=<family> recipes/field_families.sh` retrains the family and tunes it "
        "(`specdraft tune --engine ours`; a ratio taken at a load above the core count is marked *loaded*). Every "
        "set, the training table, depth-by-depth acceptance and the seed papers' claims: "
        "[docs/lab/field_families.md](lab/field_families.md). All runs resume: "
        "`setsid nohup recipes/field_families.sh > runs/logs/field-families.log 2>&1 &` "
        "(rebuilds the hidden-state cache on a fresh machine).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reports", default=str(ff.REPORTS))
    ap.add_argument("--drafts", default=str(DRAFTS))
    ap.add_argument("--reference", default=None, help="the run the others are paired with (default: the declared one)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    import os

    os.chdir(ROOT)
    text = build_page(Path(a.reports), Path(a.drafts), a.reference or ff.reference_run())
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
