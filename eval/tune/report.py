"""`specdraft tune` outputs: report.json / report.md / tune.png under <run>/tune/<name>/, and in the export the
tuned settings where each engine or user finds them: tuning.json (eval/choice/record.py), vLLM's speculative-token
count in config.json (models/export/vllm.py writes it into every vLLM / speculators export), and NOTES.md with the
command line of each engine's choice. The serving engines' lines name no path of the tuning machine: placeholders
($VLLM_PYTHON, $BASE_DIR, ...), listed with their meaning under the lines (each record's "placeholders")."""

from __future__ import annotations

import json
from pathlib import Path

from core.atomic import atomic_open, write_text_atomic
from core.load import describe, is_loaded
from eval.choice.record import tuned_num_speculative_tokens, write_tuning
from models.export.vllm import TUNED_SCHEDULE_KEY, TUNED_TOKENS_KEY
from models.registry import vllm_schedule_methods

NOTES_FILE = "NOTES.md"
NOTES_BEGIN = "<!-- specdraft tune: begin (rewritten by every tune) -->"
NOTES_END = "<!-- specdraft tune: end -->"
TITLES = {"ours": "our decoder", "vllm": "vLLM", "llamacpp": "llama.cpp"}
# What of a tune's context each engine record keeps (tuning.json merges engines tuned by different commands).
TUNE_CONTEXT = ("command", "repeats", "num_prompts", "max_new_tokens", "budget_minutes", "dataset")


def _f(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(context: dict, engines: dict[str, dict]) -> str:
    m = context["machine"]
    gain = f", minimum gain {context['min_gain']:g}" if context.get("min_gain") else ""
    lines = [f"# specdraft tune: {context['export']}", "",
             f"Machine: {m['cpu']} ({m['cores']} cores, avx512_bf16: {'yes' if m['avx512_bf16'] else 'no'}). "
             f"Prompts: {context['num_prompts']} x {context['max_new_tokens']} new tokens of {context['dataset']}; "
             f"{context['repeats']} paired repeats per setting (AR and the setting alternating) and for the "
             f"winner's confirmation; alpha {context['alpha']:g} over the settings compared (Bonferroni){gain}; "
             f"budget {context['budget_minutes']:g} min, used {context['wall_seconds'] / 60:.1f} min.", "",
             "speedup: geometric mean of the paired ratios; lower bound: at the Bonferroni level, from the noise "
             "pooled over the sweep; a setting is a candidate only when that bound clears 1.", ""]
    for name, rec in engines.items():
        lines += [f"## {TITLES.get(name, name)}", ""]
        head = [f"{k}: {rec[k]}" for k in ("version", "dtype", "threads") if rec.get(k) is not None]
        device = (rec.get("machine") or {}).get("device")
        if device:
            gpu = (rec.get("machine") or {}).get("gpu")
            head.append(f"device: {device}" + (f" ({gpu})" if gpu else ""))
        if head:
            lines += ["; ".join(head), ""]
        if rec.get("status") in ("failed", "unservable"):
            lines += [f"**{rec['status']}**: {rec.get('error')}", ""]
            if rec.get("log_tail"):
                lines += ["```", *rec["log_tail"], "```", ""]
            continue
        if rec.get("by_concurrency"):
            lines += concurrency_lines(rec)
        else:
            lines += _view_lines(rec)
            lines += field_lines(rec)
        for note in rec.get("notes") or []:
            lines += ["", f"- {note}"]
        lines.append("")
    lines += placeholder_lines(engines, everywhere=True)
    return "\n".join(lines)


def _commands(rec: dict, everywhere: bool) -> list[str]:
    """The serving lines of a record: its choice's, and with `everywhere` the schedule's and each concurrency's."""
    cmds = [(rec.get("choice") or {}).get("command")]
    if everywhere:
        cmds.append((rec.get("schedule") or {}).get("command"))
        cmds += [(v.get("choice") or {}).get("command") for v in (rec.get("by_concurrency") or {}).values()]
    return [c for c in cmds if c]


def placeholder_lines(engines: dict[str, dict], everywhere: bool = False) -> list[str]:
    """One line per placeholder the shown serving lines use, saying what it stands for and how to find it (the
    engine's record carries the meanings: eval/tune/serving.py placeholders)."""
    meanings: dict[str, str] = {}
    for rec in engines.values():
        text = "\n".join(_commands(rec, everywhere))
        for name, meaning in (rec.get("placeholders") or {}).items():
            if name in text:
                meanings.setdefault(name, meaning)
    if not meanings:
        return []
    return ["Placeholders in these lines (set each as an environment variable before running a line):", "",
            *[f"- `{name}`: {meaning}" for name, meaning in meanings.items()], ""]


def _view_lines(rec: dict) -> list[str]:
    """One measured view of an engine (the record, or one concurrency of it): AR, the points table, the choice."""
    lines: list[str] = []
    ar = rec.get("ar") or {}
    c = rec.get("choice") or {}
    rule = c.get("rule") or {}
    noise = (f" Noise (sd of a ln paired ratio, pooled over every setting and AR-vs-AR differences): "
             f"{_f(rule.get('noise_sd'), '.3f')} on {rule.get('noise_df')} degrees of freedom; "
             f"{rule.get('settings_compared')} settings compared, one-sided t {_f(rule.get('t'))}.") if rule else ""
    # the field's columns (eval/tune/field.py) only where a setting was simulated; the decoded ones say so then
    field = any(p.get("field_acceptance_length") is not None for p in rec["points"])
    al_head = "acceptance length (decoded)" if field else "acceptance length"
    field_head = " field AL, simulated (95 % interval) | speedup at field AL (estimate) |" if field else ""
    lines += [f"AR: {_f(ar.get('tokens_per_second'), '.1f')} tok/s (median of its paired passes).{noise}", "",
              "| setting | tok/s | AR tok/s (paired) | speedup vs AR | lower bound | beats AR | "
              f"{al_head} |{field_head} accepted / drafted | same tokens as AR | status |",
              "|---|---:|---:|---:|---:|---|---:|" + ("---:|---:|" if field else "") + "---:|---:|---|"]
    chosen = (rec.get("choice") or {}).get("label")
    for p in rec["points"]:
        mark = " **(chosen)**" if p["label"] == chosen else ""
        if p["status"] != "ok":
            blank = " |" * (10 if field else 8)  # every cell between the label and the status
            lines.append(f"| {p['label']} |{blank} {p['status']}: {p.get('error', '')} |")
            continue
        status = "**BUG**: tokens differ from AR's in an exact dtype" if p.get("bug") else "ok"
        lines.append(f"| {p['label']}{mark} | {_f(p['tokens_per_second'], '.1f')} | "
                     f"{_f(p['ar_tokens_per_second'], '.1f')} | {p['speedup']:.3f}x | "
                     f"{_f(p.get('lower_bound'), '.3f')}x | {'yes' if p.get('beats_ar') else 'no'} | "
                     f"{_f(p['acceptance_length'])} |{field_cells(p) if field else ''} "
                     f"{_f(p['accepted_per_drafted'], '.3f')} | {_f(p['same_tokens_as_ar'])} | {status} |")
    if c:
        lines += ["", choice_line(c)]
        if c.get("command"):
            lines += ["", "```bash", c["command"], "```"]
        for label in c.get("bugs") or []:
            bug = next(p.get("bug") for p in rec["points"] if p["label"] == label)
            lines += ["", f"- **Bug**: {label}: {bug}."]
    for p in rec["points"]:
        if p["status"] == "failed" and p.get("log_tail"):
            lines += ["", f"Last log lines of {p['label']}:", "", "```", *p["log_tail"], "```"]
    return lines


def field_cells(p: dict) -> str:
    """A point's two field cells (eval/tune/field.py), "not simulated" where it was not."""
    al = p.get("field_acceptance_length")
    if al is None:
        return " not simulated | |"
    lo, hi = p["field_interval"] or (al, al)
    return f" {al:.3f} ({lo:.3f}-{hi:.3f}) | {_f(p.get('speedup_at_field_acceptance'), '.3f')}x |"


def field_lines(rec: dict) -> list[str]:
    """What the field columns are and which settings were simulated, and the ranking note (eval/tune/field.py)."""
    f = rec.get("field")
    if not f:
        return []
    sets = ", ".join(f["sets"])
    mark = f" MARKED: {f['dtype_mark']} (these field figures match neither decoding)." if f.get("dtype_mark") else ""
    paths = "; ".join(f"{k}: {v}" for k, v in (f.get("paths") or {}).items() if v)
    lines = ["", f"Field (simulated): {f['prompts']} stored answers of {f['refs']} (base {f['base']}; the first "
             f"{f['per_set']} of each of {len(f['sets'])} sets: {sets}; up to {f['max_new_tokens']} tokens each), "
             "the greedy acceptance length our decoder reaches, replayed on the base's stored answers in this "
             f"dtype and backend ({f['seconds']:.0f} s); the mean over sets with its 95 % bootstrap interval.{mark} "
             + (f"Paths: {paths}. " if paths else "") +
             "Decoded: every other column, from the timed passes over the prompts above. \"speedup at field AL\" = "
             "decoded speedup x field AL / decoded AL (the per-step cost from decoding, the acceptance from the "
             "stored answers): an estimate, never measured; the choice rests on the decoded paired passes only.",
             "", f"Simulated ({f['rule']}): {', '.join(f['simulated']) or 'none'}; not simulated: "
             f"{', '.join(f['not_simulated']) or 'none'}."]
    if f.get("ranking"):
        lines += ["", f["ranking"]]
    return lines


def field_line(rec: dict) -> str:
    """`specdraft tune`'s printed line about the field (eval/tune/field.py): what was simulated, the choice's
    field acceptance against its decoded one, and the ranking note when there is one."""
    f = rec["field"]
    c = rec.get("choice") or {}
    line = (f"field acceptance simulated for {len(f['simulated'])} setting(s) on {f['prompts']} stored answers "
            f"({len(f['sets'])} sets) in {f['seconds']:.0f} s"
            + (f" (MARKED: {f['dtype_mark']})" if f.get("dtype_mark") else ""))
    point = next((p for p in rec.get("points") or [] if p["label"] == c.get("label")), {})
    if c.get("field_acceptance_length") is not None:
        lo, hi = c["field_interval"] or (None, None)
        line += (f"; {c['label']}: AL {c['field_acceptance_length']:.2f} ({_f(lo)}-{_f(hi)}) simulated, "
                 f"{_f(point.get('acceptance_length'))} decoded; "
                 f"{_f(c.get('speedup_at_field_acceptance'))}x AR at field AL (estimate)")
    return line + (f". {f['ranking']}" if f.get("ranking") else "")


def concurrency_lines(rec: dict) -> list[str]:
    """tune --concurrency: each count's speedup at each concurrency, the count chosen there, and the one-request
    choice held fixed at every concurrency beside it; then the schedule and each concurrency's own table."""
    views = rec["by_concurrency"]
    first = next(iter(views.values()))
    labels = [p["label"] for p in first["points"]]
    fixed = (first.get("choice") or {}).get("label")
    engine = {"vllm": "vLLM", "llamacpp": "llama.cpp"}.get(rec.get("engine"), rec.get("engine"))
    lines = [f"Speedup vs {engine} AR at each concurrency (requests in flight), geometric mean of the paired passes; "
             f"**chosen** per concurrency; \"fixed\": the one-request choice ({fixed}) kept at every concurrency.",
             "", "| requests in flight | AR tok/s | " + " | ".join(labels) + " | chosen (confirmed) | fixed |",
             "|---:|---:|" + "---:|" * len(labels) + "---|---:|"]
    for c, view in views.items():
        by = {p["label"]: p for p in view["points"]}
        cells = []
        for label in labels:
            p = by.get(label) or {}
            cell = f"{p['speedup']:.3f}x" if p.get("status") == "ok" else p.get("status", "")
            cells.append(f"**{cell}**" if label == view["choice"]["label"] else cell)
        ch = view["choice"]
        ci = f" ({ch['interval'][0]:.2f}-{ch['interval'][1]:.2f})" if ch.get("interval") else ""
        what = f"{ch['label']}: {ch['speedup_vs_ar']:.3f}x{ci}" if ch["speculate"] else "do not speculate"
        fp = by.get(fixed) or {}
        fixed_cell = "1.000x" if fixed not in by else (f"{fp['speedup']:.3f}x" if fp.get("status") == "ok" else "")
        lines.append(f"| {c} | {_f((view.get('ar') or {}).get('tokens_per_second'), '.1f')} | "
                     + " | ".join(cells) + f" | {what} | {fixed_cell} |")
    lines += ["", schedule_line(rec), ""]
    if (rec.get("schedule") or {}).get("command"):
        lines += ["```bash", rec["schedule"]["command"], "```", ""]
    for c, view in views.items():
        lines += [f"### {c} request{'s' if c != '1' else ''} in flight", "", *_view_lines(view), ""]
    return lines


def choice_line(c: dict) -> str:
    """The choice in one markdown line, with the confirmation's interval (or why it fell back to AR)."""
    conf = c.get("confirmation") or {}
    if c.get("interval"):
        lo, hi = c["interval"]
        got = (f"{c['speedup_vs_ar']:.3f}x AR, {conf.get('confidence', 0.95):.0%} interval {lo:.3f}-{hi:.3f}x from "
               f"the confirmation's {len(conf.get('ratios') or [])} fresh paired passes; the sweep had measured "
               f"{c['sweep_speedup']:.3f}x")
    elif conf.get("interval"):
        lo, hi = conf["interval"]
        got = f"{c['unconfirmed']} re-timed at {conf['speedup']:.3f}x AR, interval {lo:.3f}-{hi:.3f}x"
    else:
        got = "1.000x AR by definition"
    runner = (f"; runner-up in the sweep {c['runner_up']} at {c['runner_up_speedup']:.3f}x") if c.get("runner_up") \
        else ""
    return f"**Choice: {c['label']}** ({got}{runner}): {c['reason']}."


def plot(engines: dict[str, dict], path: Path) -> None:
    """Speed vs knob per engine, AR as the horizontal line, the choice marked, failed settings as x at 0."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state (as eval/harness/report.py)

    shown = {n: r for n, r in engines.items() if r.get("points")}
    fig = Figure(figsize=(5.5 * max(1, len(shown)), 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, max(1, len(shown)), squeeze=False)[0]
    for ax, (name, rec) in zip(axes, shown.items(), strict=False):
        pts = rec["points"]
        xs = list(range(len(pts)))
        ok = [(i, p) for i, p in enumerate(pts) if p["status"] == "ok"]
        ax.plot([i for i, _ in ok], [p["tokens_per_second"] for _, p in ok], "o-", label="setting (median)")
        bad = [i for i, p in enumerate(pts) if p["status"] != "ok"]
        if bad:
            ax.plot(bad, [0] * len(bad), "x", color="C3", label="failed / skipped")
        bugs = [(i, p) for i, p in ok if p.get("bug")]
        if bugs:
            ax.plot([i for i, _ in bugs], [p["tokens_per_second"] for _, p in bugs], "s", color="C3", fillstyle="none",
                    markersize=12, label="BUG: tokens differ from AR's")
        ar = (rec.get("ar") or {}).get("tokens_per_second")
        if ar:
            ax.axhline(ar, color="k", linestyle=":", label=f"AR {ar:.1f} tok/s")
        choice = rec.get("choice") or {}
        chosen = choice.get("label")
        for i, p in ok:
            if p["label"] == chosen:
                ax.plot([i], [p["tokens_per_second"]], "*", color="C2", markersize=16, label=f"chosen: {chosen}")
                if ar and choice.get("interval"):  # the confirmation's interval, in AR's tok/s
                    lo, hi = choice["interval"]
                    mid = ar * choice["speedup_vs_ar"]
                    ax.errorbar([i + 0.15], [mid], yerr=[[mid - ar * lo], [ar * hi - mid]], fmt="D", color="C2",
                                capsize=4, label=f"confirmed {choice['speedup_vs_ar']:.2f}x ({lo:.2f}-{hi:.2f})")
        ax.set_xticks(xs, [p["label"] for p in pts], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("new tokens / s")
        ax.set_title(f"{TITLES.get(name, name)} ({rec.get('dtype', '?')})", fontsize=9)
        ax.legend(fontsize=7)
    with atomic_open(path, binary=True) as f:
        fig.savefig(f, format="png")


def write_report(out_dir: Path, context: dict, engines: dict[str, dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "report.md", markdown(context, engines))
    plot(engines, out_dir / "tune.png")
    write_text_atomic(out_dir / "report.json",
                      json.dumps({**context, "engines": engines}, indent=2, allow_nan=False) + "\n")


def notes_section(engines: dict[str, dict]) -> str:
    lines = [NOTES_BEGIN, "## Tuned serving settings (`specdraft tune`)", "",
             "Measured on one machine: re-tune where you serve (see tuning.json for every point).", ""]
    for name, rec in engines.items():
        c = rec.get("choice")
        m = (rec.get("machine") or {}).get("cpu", "?")
        if not c:
            lines.append(f"- **{TITLES.get(name, name)}**: not tuned ({rec.get('status')}: {rec.get('error')})")
            continue
        what = c["label"] if c["speculate"] else "do not speculate"
        ci = f" ({c['interval'][0]:.2f}-{c['interval'][1]:.2f}x)" if c.get("interval") else ""
        field = ""
        if c.get("field_acceptance_length") is not None:  # eval/tune/field.py: simulated, not decoded
            lo, hi = c["field_interval"] or (None, None)
            field = (f"; field acceptance length {c['field_acceptance_length']:.2f} ({_f(lo)}-{_f(hi)}), simulated "
                     f"on {c['field_prompts']} stored answers"
                     + (f" (MARKED: {c['field_dtype_mark']})" if c.get("field_dtype_mark") else ""))
        # ratios taken above the core count: every one of this engine's lines says so
        loaded = f"; {describe(rec['load'])}: every ratio here measured loaded" if is_loaded(rec.get("load")) else ""
        lines.append(f"- **{TITLES.get(name, name)}** ({m}, {rec.get('dtype')}, threads {rec.get('threads')}{loaded}): "
                     f"{what}, {c['speedup_vs_ar']:.2f}x its AR{ci}; {c['reason']}{field}")
        if c.get("command"):
            lines += ["", "  ```bash", f"  {c['command']}", "  ```"]
        if rec.get("schedule"):
            lines.append(f"  Under concurrency{' (LOADED)' if loaded else ''}: {schedule_line(rec)}")
    shown = placeholder_lines(engines)
    if shown:
        lines += ["", *shown[:-1]]  # without the trailing blank line: the end marker follows
    return "\n".join([*lines, NOTES_END]) + "\n"


def write_notes(export_dir: Path, engines: dict[str, dict]) -> Path:
    """NOTES.md in the export: the tuned section replaced (or appended), anything else in the file kept."""
    path = Path(export_dir) / NOTES_FILE
    text = path.read_text() if path.is_file() else ""
    section = notes_section(engines)
    if NOTES_BEGIN in text and NOTES_END in text:
        head, rest = text.split(NOTES_BEGIN, 1)
        tail = rest.split(NOTES_END, 1)[1].lstrip("\n")
        text = head + section + tail
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    write_text_atomic(path, text)
    return path


def store_vllm_tokens(export_dir: Path, record: dict | None) -> None:
    """config.json's vLLM speculative-token count: the choice's (one request) when vLLM should speculate, else
    removed (the vLLM / speculators exporters then write the draft's trained depth); and tune --concurrency's
    per-batch-size schedule where the family's vLLM method drafts the scheduled count (vllm_schedule_methods), else
    removed."""
    path = Path(export_dir) / "config.json"
    config = json.loads(path.read_text())
    choice = (record or {}).get("choice") or {}
    if choice.get("speculate"):
        config[TUNED_TOKENS_KEY] = tuned_num_speculative_tokens(choice["knobs"])
    else:
        config.pop(TUNED_TOKENS_KEY, None)
    ranges = schedule_ranges(record)
    if ranges and vllm_method(config.get("family")) in vllm_schedule_methods():
        config[TUNED_SCHEDULE_KEY] = ranges
    else:
        config.pop(TUNED_SCHEDULE_KEY, None)
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")


def schedule_ranges(record: dict | None) -> list | None:
    """The record's vLLM num_speculative_tokens_per_batch_size, None without one (or when no concurrency
    speculates)."""
    return ((record or {}).get("schedule") or {}).get("num_speculative_tokens_per_batch_size")


def vllm_method(family: str | None) -> str | None:
    from models.registry import FAMILIES

    facts = FAMILIES.get(family or "")
    return facts.vllm_method if facts else None


def schedule_line(record: dict) -> str:
    """One line: the count chosen per concurrency and the schedule vLLM gets (or why it gets none; llama.cpp has
    none)."""
    sched, engine = record.get("schedule") or {}, record.get("engine") or "vllm"
    parts = []
    for c, view in (record.get("by_concurrency") or {}).items():
        ch = view.get("choice") or {}
        if ch.get("speculate"):
            ci = f", {ch['interval'][0]:.2f}-{ch['interval'][1]:.2f}x" if ch.get("interval") else ""
            parts.append(f"{c} in flight: {tuned_num_speculative_tokens(ch['knobs'])} ({ch['speedup_vs_ar']:.2f}x{ci})")
        else:
            parts.append(f"{c} in flight: do not speculate")
    ranges = sched.get("num_speculative_tokens_per_batch_size")
    if engine == "llamacpp":
        tail = ("llama.cpp drafts one --spec-draft-n-max in every slot (no per-batch-size schedule): serve with the "
                "count chosen at the load you expect (each concurrency's choice is kept in tuning.json)")
    elif not ranges:
        tail = "no concurrency speculates: no schedule"
    elif vllm_method(record.get("family")) not in vllm_schedule_methods():
        tail = (f"schedule {ranges} kept in tuning.json only: vLLM 0.32's {record.get('family')} proposer drafts a "
                "fixed count (it cannot follow a per-batch-size schedule)")
    else:
        tail = (f"vLLM schedule num_speculative_tokens_per_batch_size {ranges} with num_speculative_tokens "
                f"{sched.get('num_speculative_tokens')} (k = 0: no drafts at that batch size)")
    return "; ".join(parts) + f"; {tail}"


def write_export(export_dir: Path, context: dict, engines: dict[str, dict]) -> Path:
    """Everything tune leaves in the export; returns tuning.json's path. The notes cover every engine tuned so
    far (tuning.json merges this run into earlier ones)."""
    for rec in engines.values():  # each engine keeps how it was tuned: the file's top level is the last tune's
        rec["tune"] = {k: context.get(k) for k in TUNE_CONTEXT}
    path = write_tuning(export_dir, context, engines)
    merged = json.loads(path.read_text())["engines"]
    if "vllm" in engines:
        store_vllm_tokens(export_dir, engines["vllm"])
    write_notes(export_dir, merged)
    return path
