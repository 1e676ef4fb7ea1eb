"""Micro benchmark: K-head Medusa loss, materialized reference vs chunked fused Linear→CE.

Each variant runs in its own fresh subprocess so one variant's allocations cannot hide in the other's
peak. Peak memory is the honest high-water mark of the step, measured after the inputs exist:
  - CPU:  Linux peak RSS (VmHWM) reset through /proc/self/clear_refs after setup, minus RSS at that
          point. torch's CPU allocator does not cache, so freed tensors leave RSS and the high-water
          mark is the real peak of live tensors (+ allocator slack).
  - CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() after setup.
Both include the parameter gradients each step produces (``.grad`` is reset to None every step).

    python bench/fused_ce.py                       # SmolLM2 shapes: N=1024 d=576 V=49152, 4 heads
    python bench/fused_ce.py --frozen-head         # heads share the frozen base lm_head
    python bench/fused_ce.py --soft-weight 0.5     # + teacher soft CE (Hydra++)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("reference", "fused")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024, help="rows (tokens) per head")
    p.add_argument("--d", type=int, default=576, help="hidden size")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size V")
    p.add_argument("--heads", type=int, default=4, help="number of draft heads K")
    p.add_argument("--chunk", type=int, default=1024, help="fused chunk size (rows)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--frozen-head", action="store_true", help="one shared frozen lm_head (no weight grad)")
    p.add_argument("--soft-weight", type=float, default=0.0, help="α for the teacher soft-CE term")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2, help="timed steps per worker")
    p.add_argument(
        "--rounds", type=int, default=2, help="alternate reference/fused workers this many times (load noise)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: worker mode
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Worker (one variant, fresh process)
# ---------------------------------------------------------------------------------------------------


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status; CPU peak memory needs Linux")


def run_worker(args: argparse.Namespace) -> dict:
    import torch

    from losses import (
        fused_linear_cross_entropy,
        head_weights,
        linear_cross_entropy_reference,
        weighted_head_means,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    loss_fn = fused_linear_cross_entropy if args.variant == "fused" else linear_cross_entropy_reference
    torch.manual_seed(0)

    # Inputs: per-head hidden [N, d] (the ResBlock outputs), per-head or shared lm_head [V, d], labels [N].
    def make(*shape, scale=1.0, grad=False):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_(grad)

    hiddens = [make(args.n, args.d, grad=True) for _ in range(args.heads)]
    if args.frozen_head:
        weights = [make(args.vocab, args.d, scale=args.d**-0.5)] * args.heads  # the same frozen tensor
    else:
        weights = [make(args.vocab, args.d, scale=args.d**-0.5, grad=True) for _ in range(args.heads)]
    labels = []
    for _ in range(args.heads):
        lab = torch.randint(0, args.vocab, (args.n,), device=device)
        lab[: args.n // 4] = -100  # a prompt-like stretch of ignored positions
        labels.append(lab)
    teacher_kw = {}
    if args.soft_weight > 0:
        teacher_kw = dict(
            teacher_hidden=make(args.n, args.d),
            teacher_weight=make(args.vocab, args.d, scale=args.d**-0.5),
            soft_weight=args.soft_weight,
        )
    lambdas = head_weights(args.heads)

    def step() -> None:
        sums, counts = [], []
        for h, w, y in zip(hiddens, weights, labels):
            loss_sum, stats = loss_fn(h, w, y, chunk_size=args.chunk, **teacher_kw)
            sums.append(loss_sum)
            counts.append(stats.count)
        total, _ = weighted_head_means(sums, counts, lambdas)
        total.backward()

    def reset_grads() -> None:
        for t in hiddens + weights:
            t.grad = None

    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        step()
        reset_grads()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = _rss_bytes("VmRSS")

    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        reset_grads()
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM")
    return dict(
        variant=args.variant,
        time_min_s=min(times),
        time_median_s=statistics.median(times),
        peak_delta_bytes=peak - base,
        threads=torch.get_num_threads(),
    )


# ---------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_worker(args)))
        return

    argv = list(sys.argv[1:] if argv is None else argv)
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # alternate so a burst of load on a shared machine hits both variants
        for variant in VARIANTS:
            proc = subprocess.run(
                [sys.executable, __file__, *argv, "--variant", variant], capture_output=True, text=True
            )
            if proc.returncode != 0:
                sys.exit(f"{variant} worker failed (exit {proc.returncode}):\n{proc.stderr}")
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    results = {
        v: dict(
            time_min_s=min(r["time_min_s"] for r in rs),
            time_median_s=statistics.median(r["time_median_s"] for r in rs),
            peak_delta_bytes=max(r["peak_delta_bytes"] for r in rs),
            threads=rs[0]["threads"],
        )
        for v, rs in runs.items()
    }

    ref, fused = results["reference"], results["fused"]
    mib = 2**20
    head = "shared frozen" if args.frozen_head else "per-head trainable"
    print(
        f"N={args.n} d={args.d} V={args.vocab} heads={args.heads} chunk={args.chunk} dtype={args.dtype} "
        f"device={args.device} lm_head={head} soft_weight={args.soft_weight} "
        f"rounds={args.rounds}x{args.iters} steps "
        f"threads={ref['threads']}"
    )
    print(f"{'':22}{'reference':>12}{'fused':>12}{'fused/ref':>12}")
    for key, label, scale, unit in (
        ("time_min_s", "fwd+bwd min", 1e3, "ms"),
        ("time_median_s", "fwd+bwd median*", 1e3, "ms"),
        ("peak_delta_bytes", "peak memory", 1 / mib, "MiB"),
    ):
        r, f = ref[key] * scale, fused[key] * scale
        print(f"{label + ' (' + unit + ')':22}{r:12.1f}{f:12.1f}{f / r:12.2f}")
    print("* median over rounds of each worker's median step; peak = max over rounds")
    if not args.frozen_head:
        grad_mib = args.heads * args.vocab * args.d * (4 if args.dtype == "fp32" else 2) / mib
        print(f"both peaks include {grad_mib:.0f} MiB of lm_head weight grads that any method must produce")
    speed = ref["time_min_s"] / fused["time_min_s"]
    mem = fused["peak_delta_bytes"] / ref["peak_delta_bytes"]
    verdict = "meets" if (mem <= 0.5 and speed >= 0.9) else "misses"
    print(
        f"fused speed vs ref: {speed:.2f}x (min times); fused memory vs ref: {mem:.2f}x -> {verdict} "
        "target (memory <= 0.5x at speed >= 0.9x)"
    )


if __name__ == "__main__":
    main()
