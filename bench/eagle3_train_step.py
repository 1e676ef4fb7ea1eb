"""EAGLE-3 training throughput on a CPU: tokens/s of one optimizer step from the hidden cache's inputs, and the
fraction of the CPU's measured matmul peak it reaches, by threads, dtype and torch.compile.

    python bench/eagle3_train_step.py --out runs/bench-eagle3-train/bench.json
    python bench/eagle3_train_step.py --threads 1 --arms fp32,bf16 --steps 6
    python bench/eagle3_train_step.py --threads 1 --arms fp32,bf16 --steps 6 --untuned   # before the CPU tuning

A step = the draft's loss forward (fc over the three aux layers, TTT x3 through its one decoder layer, the chunked
LM head over the 16k draft vocabulary with soft targets from the base's LM head rows) + backward + AdamW, on a
micro-batch of BATCH x SEQ tokens, what `specdraft train` runs per micro-batch from the hidden-state cache (no base
forward). The inputs are random with the cache's shapes: the cost does not depend on their values.

Arms (each at every --threads count; interleaved per thread count, so load drift hits them alike):
  fp32            fp32 parameters and inputs (train.precision=fp32)
  bf16            bf16 parameters and inputs, fp32 AdamW master copy (what DeepSpeed's bf16 mode runs,
                  train.precision=bf16 / fast on a bf16 CPU)
  fp32-autocast   fp32 parameters under torch.autocast(cpu, bf16): matmuls in bf16, the rest fp32
  <arm>+compile   the loss forward through torch.compile (backward through AOTAutograd); compile time reported
  bf16+compile-dyn  the same with dynamic=True: the kernels training would get, whose batches change shape every
                  step (sequence length, the rows whose target is in the draft vocabulary); dynamic=False
                  recompiles per shape up to dynamo's limit of 8, then runs eager
--profile ARM prints torch.profiler's operator table for three steps of one arm (where the time goes).
--variant NAME=OVERRIDES (repeatable) times draft variants against the plain draft side by side instead:

    python bench/eagle3_train_step.py --threads 1 --steps 5 --variant ttt5=draft.eagle3.ttt_steps=5 \
      --variant layers2=draft.eagle3.num_layers=2 \
      --variant peagle=draft.eagle3.parallel_drafting=true,draft.eagle3.ttt_steps=4
    python bench/eagle3_train_step.py --threads 1 --steps 3 \
      --variant dflash8=config=configs/dflash.yaml,draft.dflash.block_size=8,draft.num_heads=7
A variant's config=<yaml> times another family's draft (DFlash, DSpark, Domino, ...) on the same inputs (every
position supervised, so a block drafter gets min(num_anchors, seq) anchors).
FLOPs per step come from torch.utils.flop_counter (matmuls, attention); the peak from a large square GEMM per dtype
at the same thread count. Fraction = achieved FLOP/s / that peak (fp32 arm: fp32 peak; others: bf16 peak).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, time_fn  # noqa: E402

FUSED_ADAMW = True  # what training steps with (train/optimizer.py); --untuned: the for-each kernels
ARMS = ("fp32", "bf16", "fp32-autocast", "fp32+compile", "bf16+compile", "bf16+compile-dyn")


def gemm_peak(dtype, n: int = 2048) -> float:
    """GFLOP/s of an n x n x n matmul (the best of 3 after a warm-up)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = time_fn(lambda: a @ b, warmup=1, repeats=3)
    return 2 * n ** 3 / t.min / 1e9


def make_step(arm: str, base, batch: int, seq: int, ttt: int, extra: tuple[str, ...] = ()):
    """(step(), flops of one step) for one arm: a fresh draft, optimizer and random cache-shaped inputs."""
    import contextlib

    import torch

    from models.draft import BaseView, DraftBatch
    from models.registry import DRAFT_MODELS
    from train.config import load_train_config
    from train.optimizer import fusable

    compute = torch.bfloat16 if arm.startswith("bf16") else torch.float32
    # A variant may name another family's recipe (config=configs/dflash.yaml): its step then runs that draft.
    configs = [e.partition("=")[2] for e in extra if e.startswith("config=")] or ["configs/eagle3.yaml"]
    cfg = load_train_config(configs, ["draft.share_lm_head=false", "draft.vocab_size=16384",
                                      f"draft.eagle3.ttt_steps={ttt}",
                                      *[e for e in extra if not e.startswith("config=")]])
    view = BaseView.from_model(base.model)
    torch.manual_seed(0)
    view.draft_vocab = torch.randperm(view.vocab_size)[:cfg.draft.vocab_size]  # frequency order does not matter
    draft = DRAFT_MODELS[cfg.draft.family].from_config(cfg.draft, view)
    draft.train()
    master = [p for p in draft.parameters() if p.requires_grad]
    if compute == torch.bfloat16:  # DeepSpeed bf16: bf16 module, fp32 master weights stepped by the optimizer
        fp32_master = [p.detach().float().clone().requires_grad_() for p in master]
        draft.to(torch.bfloat16)
        opt = torch.optim.AdamW(fp32_master, lr=1e-4, fused=FUSED_ADAMW and fusable(fp32_master))
    else:
        opt = torch.optim.AdamW(master, lr=1e-4, fused=FUSED_ADAMW and fusable(master))
    d = view.hidden_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, view.vocab_size, (batch, seq), generator=g)
    hidden = torch.randn(batch, seq, d, generator=g).to(compute)
    aux = torch.randn(batch, seq, 3 * d, generator=g).to(compute)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    loss_cfg = cfg.loss
    db = DraftBatch(input_ids=ids, hidden=hidden, loss_mask=mask, aux_hidden=aux)

    def loss_fn(b):
        return draft.loss(b, view, loss_cfg).loss

    if "+compile" in arm:
        loss_fn = torch.compile(loss_fn, dynamic=arm.endswith("-dyn"))

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if arm == "fp32-autocast" else contextlib.nullcontext()

    def step():
        with autocast():
            loss = loss_fn(db)
        loss.backward()
        if compute == torch.bfloat16:
            for p, m in zip([p for p in draft.parameters() if p.requires_grad], fp32_master):
                m.grad = p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute == torch.bfloat16:
            with torch.no_grad():
                for p, m in zip([p for p in draft.parameters() if p.requires_grad], fp32_master):
                    p.copy_(m)

    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, autocast():
        draft.loss(db, view, loss_cfg).loss.backward()
    draft.zero_grad(set_to_none=True)
    return step, counter.get_total_flops()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--batch", type=int, default=4, help="conversations per micro-batch (the recipe's 4)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per conversation (the recipe's 256-token cut)")
    ap.add_argument("--ttt", type=int, default=3, help="TTT steps (the recipe's 3)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per arm")
    ap.add_argument("--out", default=None, help="results JSON (written after every arm)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                    help="a draft variant (config overrides) whose step cost to compare with the plain draft's, side "
                    "by side (bf16, the first --threads count); repeatable")
    ap.add_argument("--profile", default=None, metavar="ARM", help="print the operator table of 3 steps of ARM "
                    "at the first --threads count, then exit")
    ap.add_argument("--untuned", action="store_true", help="step as training did before its CPU tuning: for-each "
                    "AdamW and glibc's default malloc (run it beside a plain run for the side-by-side ratio)")
    args = ap.parse_args()
    import torch

    from core.load import LoadWatch
    from core.malloc import keep_freed_memory

    global FUSED_ADAMW
    FUSED_ADAMW = not args.untuned
    if not args.untuned:
        keep_freed_memory()  # as training does on a CPU (train/loop.py: threads_and_precision)
    from models.base import load_base

    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        sys.exit(f"--arms: unknown {', '.join(bad)}; use {', '.join(ARMS)}")
    base = load_base("smollm2", dtype=torch.float32)
    results = Results(args.out, {"torch": torch.__version__, "cpu": _cpu_name(), "batch": args.batch,
                                 "seq": args.seq, "ttt": args.ttt, "untuned": args.untuned, "rows": {}})
    tokens = args.batch * args.seq
    if args.variant:
        return compare_variants(args.variant, base, args, int(args.threads.split(",")[0]), results)
    if args.profile:
        if args.profile not in ARMS:
            sys.exit(f"--profile: unknown arm {args.profile}; use {', '.join(ARMS)}")
        return profile(args.profile, base, args, int(args.threads.split(",")[0]))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        peaks = {"fp32": gemm_peak(torch.float32), "bf16": gemm_peak(torch.bfloat16)}
        results.put("peak_gflops", str(threads), peaks)
        print(f"{threads} thread(s): GEMM peak fp32 {peaks['fp32']:.0f}, bf16 {peaks['bf16']:.0f} GFLOP/s")
        for arm in arms:
            with results.arm("rows", f"{arm}@{threads}", keep_going=True) as row:
                watch = LoadWatch()
                step, flops = make_step(arm, base, args.batch, args.seq, args.ttt)
                t0 = time.perf_counter()
                step()  # warm-up (and the compile, for +compile arms)
                row["first_step_s"] = round(time.perf_counter() - t0, 2)
                t = time_fn(step, warmup=0, repeats=args.steps)
                peak = peaks["fp32" if arm.startswith("fp32") and arm != "fp32-autocast" else "bf16"]
                row.update(t.summary(4))
                row.update({"threads": threads, "tokens_per_s": round(tokens / t.median, 1),
                            "gflop_per_step": round(flops / 1e9, 2),
                            "gflops": round(flops / t.median / 1e9, 1),
                            "fraction_of_peak": round(flops / t.median / 1e9 / peak, 3), "load": watch.record()})
                print(f"  {arm:<15} {row['tokens_per_s']:>8.0f} tok/s  {row['gflops']:>6.1f} GFLOP/s "
                      f"({100 * row['fraction_of_peak']:.0f}% of peak)  first step {row['first_step_s']} s  "
                      f"load {row['load']}")
    return None


def compare_variants(specs: list[str], base, args, threads: int, results) -> None:
    """Seconds per bf16 step of the plain draft and of each variant, interleaved over --steps rounds, and each
    variant's cost relative to the plain draft's: what recipes/eagle3_levers_field.sh divides an arm's steps by to
    give it the plain arm's compute."""
    import statistics

    import torch

    from core.load import LoadWatch, describe

    torch.set_num_threads(threads)
    watch = LoadWatch()
    variants = {"plain": ()}
    for spec in specs:
        name, sep, overrides = spec.partition("=")
        if not sep or not overrides:
            sys.exit(f"--variant {spec!r}: use NAME=KEY=VALUE[,KEY=VALUE], e.g. layers2=draft.eagle3.num_layers=2")
        variants[name] = tuple(overrides.split(","))
    steps = {}
    for name, extra in variants.items():  # a variant's overrides come last, so its own ttt_steps wins
        steps[name] = make_step("bf16", base, args.batch, args.seq, args.ttt, extra)[0]
        steps[name]()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"])
    load = watch.record()
    results.put("variants_load", load)
    print(f"bf16, {threads} thread(s), {_cpu_name()}, {describe(load)}")
    for name, ts in times.items():
        cost = statistics.median(ts)
        results.put("variants", name, {"overrides": list(variants[name]), "seconds": round(cost, 4),
                                       "relative_cost": round(cost / plain, 3)})
        print(f"  {name:<10} {cost:.3f} s a step  {cost / plain:.2f}x the plain draft's")


def profile(arm: str, base, args, threads: int) -> None:
    """torch.profiler's operator table (self CPU time) for 3 steps of one arm, after 2 warm-up steps."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from core.load import load_average

    torch.set_num_threads(threads)
    step, _ = make_step(arm, base, args.batch, args.seq, args.ttt)
    step()
    step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    print(f"{arm} at {threads} thread(s), {_cpu_name()}, load average {load_average()}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                flags = open("/proc/cpuinfo").read()
                kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2"
                return f"{line.split(':', 1)[1].strip()} ({kind}, {os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
