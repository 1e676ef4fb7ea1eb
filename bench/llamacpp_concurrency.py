"""llama.cpp's acceptance and speed with several requests in flight: one `llama-server` with `-np C` slots per
setting (the largest C), the same prompts sent one at a time and C at once, through the sessions `specdraft tune
--engine llamacpp --concurrency` measures with (eval/tune/serving.py). Per setting and concurrency: drafted and
accepted tokens (the server's own counters), the acceptance rate, tokens/s, and whether every answer equals the
plain server's at the same concurrency.

    python bench/llamacpp_concurrency.py --draft drafts/smollm2-eagle3-store/export --n-max 3 --concurrency 1,4 \
        --num-prompts 8 --max-new-tokens 64 --out runs/bench-llamacpp-concurrency/results.json

A question the table answers: does the draft accept as much with 4 requests in flight as with one? (Same greedy
answers, so any difference is the server's drafting, not the text.) Load average beside every row: a ratio taken
at a load above the core count is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="a specdraft export llama.cpp serves (EAGLE-3, DFlash)")
    ap.add_argument("--n-max", default="3", help="--spec-draft-n-max values, comma-separated (default 3)")
    ap.add_argument("--concurrency", default="1,4", help="requests in flight, from 1 (default 1,4)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/bench-llamacpp-concurrency/results.json")
    a = ap.parse_args(argv)

    from bench.harness import Results
    from eval.harness.prompts import config_prompts
    from eval.harness.runner import resolve_heldout_skip
    from eval.serving.serve_check import base_hf_dir
    from eval.tune.command import tune_eval_config
    from eval.tune.concurrency import parse_concurrency
    from eval.tune.serving import LlamaCppEngine
    from eval.tune.sweep import AR, Setting
    from models.export.load import load_export
    from models.export.specdraft import read_export_config

    cs = parse_concurrency(a.concurrency)
    targs = argparse.Namespace(config=None, overrides=["warmup_tokens=4"], num_prompts=a.num_prompts,
                               max_new_tokens=a.max_new_tokens, name="llamacpp-concurrency", threads=a.threads,
                               prompts=None)
    draft_dir = Path(a.draft)
    cfg = resolve_heldout_skip(tune_eval_config(targs), read_export_config(draft_dir))
    loaded = load_export(draft_dir, base_path=cfg.base_path, dtype="fp32", chat_template=cfg.chat_template)
    out = Path(a.out)
    work = out.parent / "work"
    prompts = config_prompts(cfg, loaded.base.tokenizer)
    engine = LlamaCppEngine(loaded, cfg, prompts, base_hf_dir(loaded.base, work), work, 900.0, a.threads,
                            p_mins=(0.0,), concurrencies=cs)
    settings = [AR] + [Setting(f"n-max {k}", {"num_speculative_tokens": int(k), "p_min": 0.0}, float(k))
                       for k in a.n_max.split(",")]
    # On disk after every row (atomic), so a server that dies mid-sweep keeps the rows it finished.
    rows, ar_out = [], {}
    results = Results(out, {"draft": a.draft, "prompts": [p.id for p in prompts], "slots": max(cs),
                            "max_new_tokens": a.max_new_tokens, "threads": a.threads, "rows": rows})
    for setting in settings:
        session = engine.open(setting)
        try:
            for c in cs:
                m = session.run(concurrency=c)
                if not setting.speculative:
                    ar_out[c] = m.outputs
                rows.append({"setting": setting.label, "concurrency": c, "drafted": m.drafted,
                             "accepted": m.accepted, "accept_rate": (m.accepted / m.drafted) if m.drafted else None,
                             "tokens_per_second": m.tokens_per_second,
                             "identical_to_ar": m.outputs == ar_out.get(c), "load": os.getloadavg()[0]})
                results.save()
                print(json.dumps(rows[-1]), flush=True)
        finally:
            session.close()
    print("\n| setting | in flight | drafted | accepted | rate | tok/s | answers = AR | load |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        rate = f"{r['accept_rate']:.1%}" if r["accept_rate"] is not None else "-"
        print(f"| {r['setting']} | {r['concurrency']} | {r['drafted']} | {r['accepted']} | {rate} | "
              f"{r['tokens_per_second']:.1f} | {r['identical_to_ar']} | {r['load']:.1f} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
