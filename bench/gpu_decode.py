"""Decode speed of a base on the GPU, all in one process: own AR decoding (the `fast` engine: static KV cache,
torch.compile + CUDA graphs on CUDA) vs transformers `generate` (greedy), and what verifying a tree of N
nodes costs against one AR step (the price side of speculative decoding). Writes one JSON.

    python bench/gpu_decode.py --base smollm2-random --meta .gpudata/meta --out OUT/decode_smollm2_random.json
    python bench/gpu_decode.py --base llama8b-random --meta .gpudata/meta --out OUT/decode_llama8b.json
    python bench/gpu_decode.py --base smollm2 ...       # the real SmolLM2 (its GGUF joined on the machine)
    python bench/gpu_decode.py --base tiny --device cpu --prompts 2 --new-tokens 8   # CPU dry run

Bases: smollm2 (real), smollm2-random (SmolLM2's exact config, random weights), llama8b-random (LLaMA-3-8B
shape, random weights, SmolLM2's tokenizer: ids < 49152 are valid ids of the 128k vocabulary), tiny.
Speculative decoding with trained drafts is measured by `specdraft eval` (same engine, same run as its two
baselines); tokens/s here exclude prefill, as there. Random-weight bases stop on EOS rarely (~1/V per token).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from bench.harness import Results, Stopwatch, clock_sync, ratio  # noqa: E402


def load(args, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, description) of the requested base."""
    from transformers import AutoTokenizer

    from models.random_base import LLAMA_8B, random_llama

    if args.base == "tiny":
        from models.tiny import diverse_tiny_llama, tiny_tokenizer

        return diverse_tiny_llama(0).to(device, dtype), tiny_tokenizer(), "tiny random LLaMA"
    if args.base == "smollm2":
        from models.base import load_base

        b = load_base("smollm2", dtype=dtype, device=device)
        return b.model, b.tokenizer, f"SmolLM2-135M-Instruct ({b.fingerprint})"
    meta = Path(args.meta)
    tok = AutoTokenizer.from_pretrained(meta, local_files_only=True)
    overrides = json.loads(args.overrides) if args.overrides else None
    if args.base == "smollm2-random":
        cfg = json.loads((meta / "config.json").read_text())
        return random_llama(cfg, overrides=overrides, dtype=dtype, device=device), tok, "SmolLM2 config, random"
    if args.base == "llama8b-random":
        return random_llama(LLAMA_8B, overrides=overrides, dtype=dtype, device=device), tok, "LLaMA-3-8B shape, random"
    raise ValueError(f"--base {args.base!r}: use smollm2, smollm2-random, llama8b-random or tiny")


def _cudagraph_skips() -> int:
    """How often inductor ran a compiled step without its CUDA graph (0 = every step was a graph replay)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def tree_costs(backend, sizes: list[int], prompt_len: int, reps: int, device, max_len: int, vocab: int) -> dict:
    """ms per forward_tree of N nodes (a chain: the mask shape does not change the work) after a prompt of
    `prompt_len` tokens, each followed by commit of the root only; first call per size untimed (compile)."""
    out = {}
    for n in sizes:
        backend.reset(max_len)  # the size the backend was built for: a larger one would reallocate (recompile)
        hi = min(1000, vocab)  # any ids the base knows (the tiny base has 320)
        backend.prefill(torch.randint(3, hi, (prompt_len,)))
        toks, depths = torch.randint(3, hi, (n,)), torch.arange(n)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        keep = torch.zeros(1, dtype=torch.long)
        backend.forward_tree(toks, depths, mask)  # warm-up / compile of this bucket
        backend.commit(keep)
        watch = Stopwatch(clock_sync(device))  # one sync per loop, not per step: steps overlap as in decoding
        for _ in range(reps):
            backend.forward_tree(toks, depths, mask)
            backend.commit(keep)
        out[n] = 1000 * watch.wall() / reps
    return {"ms_per_verify": out, "cost_vs_ar_step": {n: out[n] / out[sizes[0]] for n in sizes}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="smollm2-random")
    p.add_argument("--meta", default=str(ROOT / ".gpudata" / "meta"))
    p.add_argument("--overrides", default="", help="JSON config overrides (dry runs: tiny widths)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--trees", default="1,4,16,64", help="tree sizes N for the verify-cost curve (first = AR step)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-compile", action="store_true", help="fast backend eager even on CUDA")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from eval.engine.backends.fast import FastBackend
    from eval.engine.decoder import autoregressive_generate, eos_ids
    from eval.harness.hf_baseline import hf_generate_timed
    from eval.harness.prompts import load_eval_prompts

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    watch = Stopwatch(clock_sync(device))
    model, tok, desc = load(args, device, dtype)
    load_s = watch.wall()
    questions = Path(args.meta) / "mtbench_question.jsonl"
    dataset = str(questions if questions.is_file() else ROOT / "tests" / "fixtures" / "eval_prompts.jsonl")
    prompts = load_eval_prompts(dataset, tok, num_prompts=args.prompts, max_prompt_tokens=512)
    eos = eos_ids(model, tok)
    cost_prompt = 128
    longest = max(max(len(q.input_ids) for q in prompts) + args.new_tokens + 80, cost_prompt + args.reps + 80)
    watch = Stopwatch(clock_sync(device))
    backend = FastBackend(model, max_len=longest, compile=False if args.no_compile else None)
    backend.reset(longest)

    def ar(ids, n):
        return autoregressive_generate(backend, ids, max_new_tokens=n, eos_ids=eos)

    ar(prompts[0].input_ids, 16)  # compile + CUDA-graph capture of the 1-node bucket, untimed
    warm_s = watch.wall()
    hf_generate_timed(model, prompts[0].input_ids, 16, eos)
    ar_tok = ar_time = hf_tok = hf_time = 0.0
    same = []
    for q in prompts:
        a = ar(q.input_ids, args.new_tokens)
        h = hf_generate_timed(model, q.input_ids, args.new_tokens, eos)
        ar_tok += len(a.tokens) - 1
        ar_time += a.decode_time
        hf_tok += len(h.tokens) - 1
        hf_time += h.seconds
        same.append(list(h.tokens) == list(a.tokens))
    # Written after each part (the decode comparison, then the verify-cost curve): a stage killed by its timeout
    # keeps the first.
    results = Results(args.out, {
        "base": args.base, "description": desc, "dtype": args.dtype,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__, "compile": backend.compile, "static": backend.static,
        "prompts": len(prompts), "dataset": dataset, "max_new_tokens": args.new_tokens,
        "own_ar_tokens_per_s": ar_tok / ar_time if ar_time else None,
        "hf_generate_tokens_per_s": hf_tok / hf_time if hf_time else None,
        # the two arms ran prompt by prompt, alternately, in this process
        "own_ar_vs_generate": ratio(ar_tok / ar_time, hf_tok / hf_time, digits=12) if ar_time and hf_time else None,
        "outputs_equal_fraction": sum(same) / len(same), "load_s": load_s, "compile_warmup_s": warm_s,
        "cudagraph_skips": _cudagraph_skips(),
    })
    results.save()
    sizes = [int(s) for s in args.trees.split(",") if s]
    costs = tree_costs(backend, sizes, cost_prompt, args.reps, device, longest, model.config.vocab_size)
    results.data.update(cudagraph_skips=_cudagraph_skips(), **costs)
    results.save()
    result = results.data
    print(json.dumps(result, indent=1))
    print(f"{desc} ({args.dtype}, {result['device']}): own AR {result['own_ar_tokens_per_s']:.1f} tok/s, "
          f"generate {result['hf_generate_tokens_per_s']:.1f} tok/s = {result['own_ar_vs_generate']:.2f}x "
          f"(target >= 1.5); verify cost vs AR step: "
          + ", ".join(f"N={n}: {c:.2f}x" for n, c in result["cost_vs_ar_step"].items()))


if __name__ == "__main__":
    main()
