"""Regeneration throughput: the same ShareGPT prompts regenerated with vLLM's engine and with transformers
`generate` (the self-distill path), side by side in one run: generated tokens/s of each, and how many records
come out identical (greedy).

    python bench/regenerate.py --num-prompts 64 --max-new-tokens 128 --hf-batch 16 --vllm-batch 64

Each engine writes its own file under --out (resumable, reused on a second run: pass a fresh --out to time again).
The speed figure is the build's generated tokens over the build's wall time; vLLM's engine start (on its first
batch, once per regeneration) is excluded and printed apart as vllm_start_seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from data.self_distill import build_self_distilled, end_of_turn_ids
from eval.serving.vllm_generate import VllmGenerator
from models.base import load_base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="smollm2")
    p.add_argument("--dtype", default="bf16", help="the base dtype for both engines (vLLM's CPU build runs bf16)")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=1)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--vllm-batch", type=int, default=256)
    p.add_argument("--out", default="runs/bench-regenerate")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_base(args.base, dtype=args.dtype)
    settings = dict(max_records=args.num_prompts, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns)
    rows = {}

    with VllmGenerator(base, out / "vllm-work", max_new_tokens=args.max_new_tokens, temperature=0.0,
                       stop_token_ids=end_of_turn_ids(base), max_model_len=1024 + args.max_new_tokens) as engine:
        started_before, t1 = engine.start_seconds, time.perf_counter()  # nonzero: it started to read its version
        path = build_self_distilled(base, "sharegpt", **settings, batch_size=args.vllm_batch, out=out / "vllm.jsonl",
                                    engine=engine)
        # The engine starts on the first batch (once per regeneration of hours): timed apart, not as generation.
        start = engine.start_seconds
        rows["vllm"] = (path, time.perf_counter() - t1 - (start - started_before), engine.version)
    t1 = time.perf_counter()
    path = build_self_distilled(base, "sharegpt", **settings, batch_size=args.hf_batch, out=out / "hf.jsonl")
    rows["hf"] = (path, time.perf_counter() - t1, "transformers generate")

    records = {}
    result = {"base": base.name, "dtype": args.dtype, **vars(args), "vllm_start_seconds": round(start, 1)}
    for name, (path, seconds, version) in rows.items():
        meta = json.loads(path.with_name(path.name + ".meta.json").read_text())
        records[name] = [json.loads(line) for line in path.read_text().splitlines()]
        result[name] = {"engine": version, "seconds": round(seconds, 1), "generated_tokens": meta["generated_tokens"],
                        "tokens_per_second": round(meta["generated_tokens"] / seconds, 1),
                        "records": meta["records"], "cut_answers": meta["cut_answers"]}
    same = sum(a == b for a, b in zip(records["vllm"], records["hf"]))
    result["identical_records"] = f"{same}/{len(records['hf'])}"
    result["vllm_vs_hf_tokens_per_second"] = round(result["vllm"]["tokens_per_second"]
                                                   / result["hf"]["tokens_per_second"], 2)
    (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
