"""`specdraft tune`'s acceptance side from the field benchmark (docs/howto/serve.md, "Tune"; eval/field/simulation.py).

Why: tune times each setting against AR by decoding a few prompts (default 4 x 64 tokens), which is what a speed
needs; but the acceptance length those passes count rests on those few prompts. The field benchmark computes the
greedy acceptance length a shape reaches under our decoder from the base's stored greedy answers (hundreds of
prompts over 11 sets), at the drafter's cost only, with a bootstrap interval. So tune keeps decoding for speed and
reads the acceptance side from the field (each report names its path: exact, or batched with its measured agreement;
and a dtype other than the stored answers', bf16 against fp32, is marked in every output):

- `plan_field`: the stored answers for the draft's base (`--field-refs`, default DEFAULT_REFS when present), each
  set's first `--field-prompts`; stored answers of another base are one note and tune goes on without them.
- `field_columns`: after the sweep, the settings that matter (`settings_to_simulate`: every setting that beats AR,
  the choice, the decoded fastest; `--field-all`: every measured one) are replayed with `run_field` in tune's own
  dtype and backend (the base pass cache is `specdraft field`'s), rows under the tune report's field/<setting>/.
  Each simulated point gets `field_acceptance_length`, its interval, prompt count and sets, and
  `speedup_at_field_acceptance` = decoded speedup x field AL / decoded AL: the per-step cost from decoding, the
  acceptance from many prompts. That last figure is an estimate, never measured; the choice stays on the decoded
  paired statistics (eval/choice/stats.py `choose` is not touched), and `ranking_note` says when the field
  would rank the settings that beat AR differently.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from core.paths import REPO_ROOT

# The SmolLM2 store kept in the repository; used when present and made with the draft's base.
DEFAULT_REFS = REPO_ROOT / "datasets" / "smollm2-field-refs"
# Prompts per set: 10 x 11 sets = 110 stored answers, ~1 min for a 16-32 node tree at ~0.5 s a prompt on a 2-core
# CPU, so the few settings that matter cost minutes, not the sweep's hour.
DEFAULT_FIELD_PROMPTS = 10
# The point keys this module adds (report.py and tuning.json carry them as they are).
FIELD_KEYS = ("field_acceptance_length", "field_interval", "field_prompts", "field_sets",
              "speedup_at_field_acceptance", "field_report", "field_path", "field_dtype_mark")
# A batched setting's agreement with the exact path: this many of its stored answers re-decoded one at a time.
AGREEMENT_SAMPLE = 4


@dataclasses.dataclass
class FieldPlan:
    """The stored answers tune simulates on: where (as shown), their card, and each set's first `per_set`."""

    refs_dir: Path
    shown: str  # the directory as reports show it: relative to the repository when inside it (no machine paths)
    card: dict
    refs: list  # eval.field.refs.RefPrompt
    per_set: int

    @property
    def sets(self) -> list[str]:
        return list(dict.fromkeys(r.set for r in self.refs))


def shown_path(path: Path) -> str:
    """A path as a report or tuning.json names it: relative to the repository when inside it (an export's
    tuning.json may be committed, and must not name this machine's directories), else as given."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def check_field_args(refs_dir: str | None, num_prompts: int) -> None:
    """Before any model work: a negative count, or an explicit --field-refs that holds no stored answers, is one
    line saying what to give instead (the default store may be absent: then tune runs without field columns)."""
    from eval.field.refs import CARD

    if num_prompts < 0:
        raise ValueError(f"--field-prompts {num_prompts}: give the stored answers per set to simulate (0 turns the "
                         "field columns off)")
    if num_prompts and refs_dir is not None and not (Path(refs_dir) / CARD).is_file():
        raise ValueError(f"--field-refs {refs_dir} holds no stored answers ({CARD} missing); build them with "
                         f"`specdraft field-refs --out {refs_dir}`, give another directory, or --field-prompts 0")


def plan_field(refs_dir: str | None, num_prompts: int, base_fingerprint: str) -> tuple[FieldPlan | None, str | None]:
    """(plan, None), or (None, one line saying why tune goes on without field columns); (None, None) when
    --field-prompts 0 turned them off. Stored answers of another base are that one line, not an error: the sweep's
    own measurements stand without them."""
    from eval.field.refs import CARD, read_refs
    from eval.field.simulation import first_per_set

    if num_prompts == 0:
        return None, None
    path = Path(refs_dir) if refs_dir is not None else DEFAULT_REFS
    shown = shown_path(path)
    if not (path / CARD).is_file():  # only the default can be missing here (check_field_args refused the rest)
        return None, (f"field: no stored answers at {shown}: acceptance lengths are the decoded prompts' only; "
                      "give --field-refs DIR (`specdraft field-refs`)")
    card = json.loads((path / CARD).read_text())
    if card.get("base_fingerprint") != base_fingerprint:
        return None, (f"field: the stored answers in {shown} are of base {card.get('base')!r} (fingerprint "
                      f"{card.get('base_fingerprint')}), not this draft's (fingerprint {base_fingerprint}): no field "
                      "columns; `specdraft field-refs --base <its base> --out DIR` builds them, then --field-refs DIR")
    card, refs = read_refs(path, base_fingerprint)  # checks the data file against its card
    if not refs:
        raise ValueError(f"{shown} holds no stored answers (card.json counts {card.get('counts')}); rebuild it with "
                         "`specdraft field-refs`, or give --field-prompts 0")
    return FieldPlan(path, shown, card, first_per_set(refs, num_prompts), num_prompts), None


def settings_to_simulate(record: dict, every: bool = False) -> list[dict]:
    """The measured points worth a simulation: each that beats AR, the choice (or the one whose confirmation
    failed), and the decoded fastest (so a sweep where nothing beats AR still shows whether its best try's
    acceptance was the few prompts' luck); every measured speculative point with `every`. In sweep order."""
    ok = [p for p in record.get("points") or [] if p.get("status") == "ok" and p.get("knobs")]
    if every:
        return ok
    c = record.get("choice") or {}
    wanted = {c.get("label"), c.get("unconfirmed"), c.get("fastest")}
    return [p for p in ok if p.get("beats_ar") or p["label"] in wanted]


def slug(label: str) -> str:
    """A setting's label as a directory name: "searched tree, 16 nodes" -> "searched-tree-16-nodes"."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "setting"


def _rows_key(engine, knobs: dict, plan: FieldPlan, backend_name: str, lockstep: int) -> dict:
    """What a setting's rows depend on: a rerun with the same key resumes them, any other starts afresh (a
    re-trained export in the same run directory must never reuse the last draft's rows)."""
    return {"model_sha256": engine.loaded.config.get("model_sha256"), "knobs": knobs,
            "dtype": str(next(engine.base.model.parameters()).dtype), "backend": backend_name,
            "refs_sha256": plan.card["data_sha256"], "lockstep": lockstep}


def simulate_setting(engine, label: str, knobs: dict, plan: FieldPlan, out_dir: Path, progress: bool = True) -> dict:
    """The field report of one setting of an OursEngine (eval/tune/ours.py): its knobs applied to tune's eval
    config as the sweep applies them (apply_knobs), replayed with run_field on the plan's stored answers in
    tune's dtype and backend; rows, field.json / field.md / field.png in out_dir. Returns the report."""
    import torch

    from core.atomic import write_json_atomic
    from eval.choice.apply import apply_knobs
    from eval.engine.backends.choice import choose_backend
    from eval.engine.drafters.registry import build_drafter
    from eval.field.refs import dtype_mark
    from eval.field.report import field_report, write_field_report
    from eval.field.simulation import LOCKSTEP_WIDTH, measure_agreement, run_field, uses_lockstep

    t0 = time.perf_counter()
    drafter, info = build_drafter(engine.loaded.draft, engine.loaded.config, apply_knobs(engine.cfg, knobs))
    backend_name, _ = choose_backend(engine.cfg.backend, engine.base.model)
    lockstep = LOCKSTEP_WIDTH if uses_lockstep(drafter, LOCKSTEP_WIDTH) else 0
    key = _rows_key(engine, knobs, plan, backend_name, lockstep)
    out_dir.mkdir(parents=True, exist_ok=True)
    key_file = out_dir / "key.json"
    if not key_file.is_file() or json.loads(key_file.read_text()) != key:
        for old in out_dir.glob("rows-*.jsonl"):
            old.unlink()
        write_json_atomic(key_file, key)
    # max_new_tokens None: each stored answer's full length, as `specdraft field` judges it by default (tune's
    # --max-new-tokens only keeps the timed passes short)
    rows = run_field(drafter, plan.refs, engine.base, backend_name=backend_name, out_dir=out_dir,
                     progress=progress, lockstep=lockstep)
    dtype = str(next(engine.base.model.parameters()).dtype).removeprefix("torch.")
    seconds = round(time.perf_counter() - t0, 1)
    # tune's dtype may differ from the stored answers' (bf16 against fp32): judged anyway, marked in every output
    agreement = measure_agreement(drafter, rows, plan.refs, engine.base, backend_name=backend_name,
                                  sample=AGREEMENT_SAMPLE) if lockstep else None
    meta = {"draft": f"specdraft tune: {label}", "family": engine.family, "shape": label, "knobs": knobs,
            "dtype": dtype, "backend": backend_name, "refs": plan.shown, "refs_sha256": plan.card["data_sha256"],
            "refs_dtype": plan.card.get("dtype", "float32"), "dtype_mark": dtype_mark(plan.card, dtype),
            "base": plan.card["base"], "seconds": seconds, "path": "batched" if lockstep else "exact",
            "agreement": agreement, "near_tie_redone": sum(bool(r.get("exact_redo")) for r in rows),
            "threads": torch.get_num_threads(), "simulated": True, "lockstep": lockstep,
            "max_new_tokens": plan.card["max_new_tokens"], "tree": info.get("tree")}
    report = field_report(rows, meta)
    write_field_report(out_dir, report)
    return report


def field_point(point: dict, report: dict, report_dir: str) -> dict:
    """The FIELD_KEYS of one simulated point: the field's mean over sets and its interval, and the decoded
    speedup rescaled from the decoded acceptance length to the field's (None when the passes counted no steps);
    the path its figures took and the dtype mark, when judged against answers of another dtype."""
    from eval.field.report import path_label

    al, decoded = report["mean_over_sets"], point.get("acceptance_length")
    return {"field_acceptance_length": al, "field_interval": report["mean_interval"],
            "field_prompts": report["prompts"], "field_sets": [t["set"] for t in report["sets"]],
            "speedup_at_field_acceptance": point["speedup"] * al / decoded if decoded else None,
            "field_report": report_dir, "field_path": path_label(report["meta"]),
            "field_dtype_mark": report["meta"].get("dtype_mark")}


def ranking_note(points: list[dict]) -> str | None:
    """One line when the settings that beat AR (all simulated) rank otherwise at field acceptance than decoded;
    None when they agree or fewer than two can be ranked."""
    ranked = [p for p in points if p.get("beats_ar") and p.get("speedup_at_field_acceptance") is not None]
    if len(ranked) < 2:
        return None
    decoded = [p["label"] for p in sorted(ranked, key=lambda p: -p["speedup"])]
    field = [p["label"] for p in sorted(ranked, key=lambda p: -p["speedup_at_field_acceptance"])]
    if decoded == field:
        return None
    return (f"At field acceptance the settings that beat AR would rank {' > '.join(field)}; decoded they rank "
            f"{' > '.join(decoded)}. The choice stays on the decoded paired statistics.")


def field_columns(engine, record: dict, plan: FieldPlan, out_dir: Path, every: bool = False,
                  progress: bool = True) -> dict:
    """Simulate `settings_to_simulate` of our decoder's tune record on the plan's stored answers: FIELD_KEYS into
    each simulated point (and into the choice when it was simulated), and record["field"]: what was simulated, on
    which stored answers, and the ranking note. Returns record["field"]."""
    t0 = time.perf_counter()
    chosen = settings_to_simulate(record, every)
    for k, p in enumerate(chosen, 1):
        if progress:
            print(f"field: {p['label']} ({k}/{len(chosen)})", file=sys.stderr, flush=True)
        directory = Path(out_dir) / slug(p["label"])
        report = simulate_setting(engine, p["label"], p["knobs"], plan, directory, progress)
        p.update(field_point(p, report, f"field/{directory.name}"))
    choice = record.get("choice") or {}
    done = {p["label"]: p for p in chosen}
    if choice.get("label") in done:
        point = done[choice["label"]]
        choice.update({k: point[k] for k in FIELD_KEYS})
        # the choice reports its confirmation's speedup, so its estimate rescales that one (greedy: the same
        # tokens, so the same decoded acceptance length as its sweep point)
        if point.get("acceptance_length"):
            choice["speedup_at_field_acceptance"] = (choice["speedup_vs_ar"] * point["field_acceptance_length"]
                                                     / point["acceptance_length"])
    left = [p["label"] for p in record.get("points") or [] if p.get("status") == "ok" and p.get("knobs")
            and p["label"] not in done]
    rule = ("every measured setting (--field-all)" if every else
            "every setting that beats AR, the choice and the decoded fastest")
    note = ranking_note(chosen)
    marks = {p.get("field_dtype_mark") for p in chosen} - {None}
    summary = {"refs": plan.shown, "refs_sha256": plan.card["data_sha256"], "base": plan.card["base"],
               "dtype_mark": next(iter(marks), None), "paths": {p["label"]: p.get("field_path") for p in chosen},
               "per_set": plan.per_set, "prompts": len(plan.refs), "sets": plan.sets, "rule": rule,
               "simulated": list(done), "not_simulated": left, "max_new_tokens": plan.card["max_new_tokens"],
               "seconds": round(time.perf_counter() - t0, 1), "ranking": note}
    record["field"] = summary  # report.py shows the ranking note with the field's paragraph
    return summary


def add_field_columns(engine, record: dict | None, plan: FieldPlan, out_dir: Path, every: bool = False,
                      progress: bool = True) -> dict | None:
    """`specdraft tune` after its sweep: `field_columns` on our decoder's record when it measured anything. A
    simulation that fails is one note in the record (and on stderr), not a lost sweep: the timed passes, which the
    choice rests on, are written either way."""
    if not record or not record.get("points"):
        return None
    try:
        return field_columns(engine, record, plan, out_dir, every, progress)
    except (RuntimeError, ValueError, OSError) as exc:
        for p in [*record["points"], record.get("choice") or {}]:  # no half-filled columns beside the note
            for k in FIELD_KEYS:
                p.pop(k, None)
        note = f"field: the simulation failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): " \
               "no field columns"
        record.setdefault("notes", []).append(note)
        print(note, file=sys.stderr)
        return None
