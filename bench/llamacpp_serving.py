"""llama.cpp on the real base, side by side in one run (same MT-bench prompts as `specdraft eval`, as token ids,
batch 1, greedy, one untimed warm-up per server): AR on several base GGUF types, an EAGLE-3 draft at several
--spec-draft-n-max, the learning-free ngram-simple, and the per-step costs behind the break-even.

    python bench/llamacpp_serving.py --draft runs/<eagle3-run>/export [--types q4_1,f32,bf16] [--n-max 1,2,3,4]

Every server runs with -nr (serve-check's default serve_llamacpp_no_repack): AMX tiles die with SIGILL on a
sandboxed Xeon.

Per-step costs (ms, from llama-server's own timings):
  AR step       predicted_ms / (predicted_n - 1) of the AR run
  verify(w)     prompt_ms of a request whose prompt extends the previous one by w tokens (cache_prompt on:
                only the w new tokens are evaluated, against the cached context: what a verify step of width w
                does, one draft chain + the root)
  step(n)       with --spec-synth-rates 0,...,0 (llama.cpp's synthetic acceptance: nothing accepted) every step
                drafts n tokens, verifies n+1 and emits one: predicted_ms / (predicted_n - 1); draft(n) = step(n) -
                verify(n+1)
  break-even    acceptance length (tokens per step) at which a step of n drafts pays: step(n) / AR step
The figures are llama-server's own timings (its compute, without the HTTP round trip), not a clock of this
process. Writes JSON to --out (default runs/bench-llamacpp/results.json) through bench/harness.py (Results: every
server's row on disk as it finishes, with the error of one that fails) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, ratio  # noqa: E402


def _prompts(n: int, base):
    from eval.harness.config import load_eval_config
    from eval.harness.prompts import config_prompts

    cfg = load_eval_config(["configs/eval/mtbench.yaml"], [f"num_prompts={n}"])
    return config_prompts(cfg, base.tokenizer)


def _serve(args: list[str], prompts, new_tokens: int, threads: int, log: Path, warmup: int = 16) -> dict:
    from eval.serving.llamacpp_server import LlamaServer, runtime_args

    full = runtime_args(args, threads, 4096)
    rows = []
    with LlamaServer(full, log, timeout=900) as srv:
        srv.complete(prompts[0].input_ids, warmup)
        for p in prompts:
            out = srv.complete(p.input_ids, new_tokens)
            rows.append({"id": p.id, "tokens": out.get("tokens") or [], "timings": out["timings"]})
    gen = sum(r["timings"]["predicted_n"] for r in rows)
    steps_tokens = sum(r["timings"]["predicted_n"] - 1 for r in rows)
    ms = sum(r["timings"]["predicted_ms"] for r in rows)
    drafted = sum(r["timings"].get("draft_n", 0) for r in rows)
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in rows)
    return {"args": args, "tokens_per_second": 1000 * steps_tokens / ms, "ms_per_token": ms / steps_tokens,
            "mean_accept_rate": ratio(accepted, drafted, 6),
            "acceptance_length": gen / (gen - accepted) if gen > accepted else 1.0,
            "drafted": drafted, "accepted": accepted, "outputs": {r["id"]: r["tokens"] for r in rows}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", help="an EAGLE-3 export (runs/<run>/export); without it: AR, n-gram and costs only")
    p.add_argument("--types", default="q4_1,f32,bf16", help="base GGUF types for the AR anchor")
    p.add_argument("--draft-base", default="f32", help="base GGUF type the draft runs on")
    p.add_argument("--draft-type", default="f32")
    p.add_argument("--n-max", default="1,2,3,4")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench-llamacpp/results.json")
    args = p.parse_args()

    from eval.serving.llamacpp_gguf import base_gguf, draft_gguf, serve_args
    from eval.serving.serve_check import base_hf_dir
    from models.base import load_base

    out = Path(args.out)
    logs = out.parent / "logs"
    base = load_base("smollm2", dtype="fp32")
    prompts = _prompts(args.prompts, base)
    tmp = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    base_dir = base_hf_dir(base, tmp)
    results = Results(out, {"prompts": len(prompts), "new_tokens": args.new_tokens, "threads": args.threads,
                            "ar": {}, "draft_base": args.draft_base, "draft": {}, "ngram": {}, "synthetic0": {}})
    res = results.data
    outputs: dict = {}  # generated ids per server, kept out of the JSON

    def serve(section: str, key, run_args: list[str], log: str, some_prompts=None) -> dict:
        """One server's row in `section`, on disk when it finishes; identical_to_ar against the draft base's AR."""
        with results.arm(section, key) as row:
            r = _serve(run_args, some_prompts or prompts, args.new_tokens, args.threads, logs / log)
            outputs[section, key] = r.pop("outputs")
            if section in ("draft", "ngram"):
                r["identical_to_ar"] = outputs[section, key] == outputs["ar", args.draft_base]
            row.update(r)
        return row

    files = {t: str(base_gguf(base, base_dir, t)) for t in args.types.split(",")}
    files.setdefault(args.draft_base, str(base_gguf(base, base_dir, args.draft_base)))
    for t in args.types.split(","):
        print(f"AR {t}", flush=True)
        serve("ar", t, ["-m", files[t]], f"ar-{t}.log")
    bf = files[args.draft_base]
    if ("ar", args.draft_base) not in outputs:  # the reference AR, on the type the draft runs on
        serve("ar_ref", args.draft_base, ["-m", bf], "ar-ref.log")
        outputs["ar", args.draft_base] = outputs["ar_ref", args.draft_base]
    n_maxes = [int(x) for x in args.n_max.split(",")]
    for n in n_maxes:
        print(f"ngram-simple n-max {n}", flush=True)
        serve("ngram", n, ["-m", bf, "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                           "--spec-ngram-simple-size-m", str(n), "--spec-draft-n-max", str(n)], f"ngram-{n}.log")
    if args.draft:
        from models.export.load import load_export

        loaded = load_export(Path(args.draft), dtype="fp32")
        dfile = str(draft_gguf(loaded.draft, loaded.config, base_dir, tmp / "draft.gguf", args.draft_type))
        for n in n_maxes:
            spec = serve_args(bf, dfile, loaded.config["family"], n)
            print(f"EAGLE-3 n-max {n}", flush=True)
            serve("draft", n, spec, f"eagle3-{n}.log")
            print(f"EAGLE-3 n-max {n}, synthetic acceptance 0 (step cost)", flush=True)
            serve("synthetic0", n, spec + ["--spec-synth-rates", ",".join(["0"] * n)], f"synth0-{n}.log",
                  prompts[:4])
    print("verify costs", flush=True)
    from eval.serving.llamacpp_server import runtime_args, verify_costs

    results.put("verify_ms", verify_costs(runtime_args(["-m", bf], args.threads, 4096),
                                          [p.input_ids for p in prompts[:4]], [1, *[n + 1 for n in n_maxes]],
                                          logs / "verify.log", reps=5))
    print(tables(res))


def tables(res: dict) -> str:
    lines = ["| llama.cpp AR, base type | tok/s |", "|---|---|"]
    lines += [f"| {t} | {r['tokens_per_second']:.1f} |" for t, r in res["ar"].items()]
    ref = res["ar"].get(res.get("draft_base")) or next(iter(res["ar"].values()))
    ar_ms = 1000 / ref["tokens_per_second"]  # the AR step on the base type the draft runs on
    lines += ["", "| run | n-max | tok/s | accepted / drafted | acceptance length | identical to AR |",
              "|---|---|---|---|---|---|"]
    for name, sec in (("EAGLE-3", "draft"), ("ngram-simple", "ngram")):
        for n, r in res[sec].items():
            rate = "-" if r["mean_accept_rate"] is None else f"{r['mean_accept_rate']:.3f}"
            lines.append(f"| {name} | {n} | {r['tokens_per_second']:.1f} | {rate} | {r['acceptance_length']:.2f} | "
                         f"{r['identical_to_ar']} |")
    v = res.get("verify_ms", {})
    if res["synthetic0"]:
        lines += ["", "| n-max | step (draft n + verify n+1), ms | verify(n+1), ms | draft(n), ms | AR step, ms | "
                  "break-even acceptance length |", "|---|---|---|---|---|---|"]
        for n, r in res["synthetic0"].items():
            step = r["ms_per_token"]  # nothing accepted: one token per step
            ver = v.get(int(n) + 1) or v.get(str(int(n) + 1))
            lines.append(f"| {n} | {step:.1f} | {ver:.1f} | {step - ver:.1f} | {ar_ms:.1f} | {step / ar_ms:.2f} |"
                         if ver else f"| {n} | {step:.1f} | - | - | {ar_ms:.1f} | {step / ar_ms:.2f} |")
    if v:
        lines += ["", "verify(w) ms: " + ", ".join(f"w={w}: {ms:.1f}" for w, ms in v.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
