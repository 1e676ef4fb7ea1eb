"""Should the decoding backend prefill in the bulk dtype? The real SmolLM2 on the `fast` backend: the decode probe
(eval/engine/dtype_probe.py: a decode step at 1 and 4 tokens, bf16 and fp32 interleaved), then per prompt length
(--lengths), in interleaved rounds (A B / B A): an fp32 prefill followed by --steps fp32 AR steps, and a bf16
prefill; and the cast of a bf16 KV cache of that length to fp32 (what a bf16 prefill would hand an fp32 decoder).
From them, the share of the wall time of a prefill + --new-tokens fp32 AR decode that a bf16 prefill would save
(the case where the probe picks fp32 for decoding; a bf16 decode prefills in bf16 already).

    python bench/decode_dtype.py --threads 1 --out runs/bench-decode-dtype/bench.json

Prints one table and the load average (the box is shared); results in --out (written after every arm).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, Timing, ratio, time_fn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths to prefill")
    p.add_argument("--repeats", type=int, default=4, help="interleaved rounds per length")
    p.add_argument("--steps", type=int, default=8, help="fp32 AR steps timed after each fp32 prefill")
    p.add_argument("--new-tokens", type=int, default=256, help="the decode the prefill share is taken of")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: process CPU time (time.process_time), the clock a loaded shared CPU wants; with "
                        "--threads 1 only (several threads' CPU time adds up)")
    p.add_argument("--out", default=None, help="results JSON (written after every arm)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        p.error("--clock cpu needs --threads 1: the CPU time of several threads adds up")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    from core.load import LoadWatch, describe
    from eval.engine.backends.fast import FastBackend
    from eval.engine.dtype_probe import PROBE_PREFIX, PROBE_WIDTH, probe_backends, time_decode_steps
    from models.base import load_base

    lengths = [int(n) for n in args.lengths.split(",")]
    watch = LoadWatch()
    base = load_base("smollm2", dtype="fp32")
    results = Results(args.out, {"threads": torch.get_num_threads(), "clock": args.clock,
                                 "new_tokens": args.new_tokens, "prefill": {}})
    with results.arm("probe") as row:  # the decode probe's measurement, on this script's clock
        probe = probe_backends(base.model, "fast", PROBE_PREFIX + PROBE_WIDTH)
        row.update(width=PROBE_WIDTH, ms=time_decode_steps(probe, vocab_size=int(base.model.config.vocab_size),
                                                           clock=clock))
        del probe
    step_ms = results.data["probe"]["ms"]
    backends = {name: FastBackend(base.model, max_len=max(lengths), dtype=d)
                for name, d in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(base.model.config.vocab_size), (max(lengths),), generator=gen)

    def prefill(name: str, n: int):
        def run():
            backends[name].reset(n)
            backends[name].prefill(ids[:n])
        return run

    one = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    keep = torch.zeros(1, dtype=torch.long)

    def fp32_round(n: int, p32: Timing, step32: Timing) -> None:
        """fp32 prefill of n tokens, then --steps AR steps after it (the decode that prefill feeds)."""
        b = backends["fp32"]
        b.reset(n + args.steps)
        t0 = clock()
        b.prefill(ids[:n])
        t1 = clock()
        for _ in range(args.steps):
            b.forward_tree(*one)
            b.commit(keep)
        p32.times.append(t1 - t0)
        step32.times.append((clock() - t1) / args.steps)

    def bf16_round(n: int, p16: Timing) -> None:
        b = backends["bf16"]
        b.reset(n)
        t0 = clock()
        b.prefill(ids[:n])
        p16.times.append(clock() - t0)

    core = backends["bf16"]._core  # [layers, kv_heads, T, head_dim] K and V: what an fp32 decoder would need cast
    for n in lengths:
        with results.arm("prefill", str(n)) as row:
            p32, step32, p16 = Timing(), Timing(), Timing()
            fp32_round(n, Timing(), Timing())  # warm-up
            bf16_round(n, Timing())
            for r in range(args.repeats):  # interleaved A B / B A: a change in the load hits both alike
                if r % 2 == 0:
                    fp32_round(n, p32, step32)
                    bf16_round(n, p16)
                else:
                    bf16_round(n, p16)
                    fp32_round(n, p32, step32)
            k = core.k_cache[:, :, :n]
            cast = time_fn(lambda k=k: (k.float(), k.float()), repeats=5, clock=clock)  # K and V alike
            decode_s = args.new_tokens * step32.median  # an fp32 decode of new_tokens AR steps after this prompt
            saved = p32.median - p16.median - cast.median
            row.update(fp32_s=round(p32.median, 4), bf16_s=round(p16.median, 4), kv_cast_s=round(cast.median, 5),
                       bf16_speedup=ratio(p32.median, p16.median), fp32_step_ms=round(step32.median * 1e3, 2),
                       fp32_decode_s=round(decode_s, 3), saved_share=round(saved / (p32.median + decode_s), 4))
    results.put("load", watch.record())
    print(f"threads {results.data['threads']}, {args.clock} clock; {describe(results.data['load'])}")
    w = str(results.data["probe"]["width"])
    print(f"decode step ms: 1 token bf16 {step_ms['bf16']['1']} fp32 {step_ms['fp32']['1']}; {w} tokens bf16 "
          f"{step_ms['bf16'][w]} fp32 {step_ms['fp32'][w]}")
    print("| prompt tokens | prefill fp32 s | prefill bf16 s | bf16 x | KV cast s | fp32 AR step ms | fp32 decode of "
          f"{args.new_tokens} s | wall saved by a bf16 prefill |")
    print("|---|---|---|---|---|---|---|---|")
    for n, r in results.data["prefill"].items():
        print(f"| {n} | {r['fp32_s']} | {r['bf16_s']} | {r['bf16_speedup']} | {r['kv_cast_s']} | {r['fp32_step_ms']} "
              f"| {r['fp32_decode_s']} | {r['saved_share']:.1%} |")


if __name__ == "__main__":
    main()
