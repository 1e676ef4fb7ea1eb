"""Micro benchmark: K-head Medusa loss, materialized reference vs chunked fused Linear→CE.

One step = for each head k: ``loss_fn(hidden_k [N, d], lm_head_k [V, d], labels_k [N])``, combine with
``Σ_k λ_k · mean_k``, one ``backward()``. Reported as fused/reference ratios from one invocation.

Memory: each variant runs in its own fresh subprocess (one variant's allocations cannot hide in the
other's peak); peak = the high-water mark of a step minus what was live after setup and warm-up:
  - CPU:  Linux peak RSS (VmHWM), reset through /proc/self/clear_refs, minus RSS at that point.
          torch's CPU allocator does not cache, and the workers run with MALLOC_MMAP_THRESHOLD_=64KiB
          so glibc unmaps freed blocks: RSS follows live tensors, and the high-water mark is the real
          peak of live tensors (+ allocator slack of a few MiB; tiny shapes are not meaningful).
  - CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() after setup.
Both peaks include the parameter gradients each step produces (``.grad`` is reset to None per step).

Time: one more subprocess runs the two variants *alternately*, step by step, so load from other
processes on a shared machine hits both alike. Wall time (min, median) and, on CPU, process CPU time
(all threads; nearly immune to other processes' load, unlike wall time) are reported; the verdict
uses median CPU time on CPU and median wall time on CUDA.

    python bench/fused_ce.py                       # SmolLM2 shapes: N=1024 d=576 V=49152, 4 heads
    python bench/fused_ce.py --frozen-head         # heads share the frozen base lm_head
    python bench/fused_ce.py --soft-weight 0.5     # + teacher soft CE (Hydra++)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Stopwatch, Timing, clock_sync, peak_memory, ratio  # noqa: E402

VARIANTS = ("reference", "fused")
MODES = ("memory-reference", "memory-fused", "time")


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
    p.add_argument("--iters", type=int, default=3, help="timed steps per variant (after 1 warm-up each)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: worker mode
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Workers (fresh processes)
# ---------------------------------------------------------------------------------------------------


def build_steps(args: argparse.Namespace):
    """Inputs for ``args.heads`` heads and a ``step(variant)`` closure running one fwd+bwd."""
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
    loss_fns = {"reference": linear_cross_entropy_reference, "fused": fused_linear_cross_entropy}
    torch.manual_seed(0)

    def make(*shape, scale=1.0, grad=False):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_(grad)

    # Per head: hidden [N, d] (the ResBlock output), lm_head [V, d] (own trainable or shared frozen).
    hiddens = [make(args.n, args.d, grad=True) for _ in range(args.heads)]
    if args.frozen_head:
        shared = make(args.vocab, args.d, scale=args.d**-0.5)
        weights = [shared for _ in range(args.heads)]  # one frozen tensor read by every head
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
    cuda = device.type == "cuda"
    sync = clock_sync(device)

    def step(variant: str) -> tuple[float, float]:
        watch = Stopwatch(sync)
        sums, counts = [], []
        for h, w, y in zip(hiddens, weights, labels):
            loss_sum, stats = loss_fns[variant](h, w, y, chunk_size=args.chunk, **teacher_kw)
            sums.append(loss_sum)
            counts.append(stats.count)
        total, _ = weighted_head_means(sums, counts, lambdas)
        total.backward()
        elapsed = (watch.wall(), watch.cpu())  # (wall, CPU) seconds
        for t in hiddens + weights:
            t.grad = None
        return elapsed

    return step, cuda


def run_memory(args: argparse.Namespace, variant: str) -> dict:
    step, _ = build_steps(args)
    step(variant)  # warm-up: lazy library buffers are not part of the loss's footprint
    with peak_memory(args.device) as peak:
        step(variant)
    if not peak.reset:
        raise RuntimeError("VmHWM could not be reset (/proc/self/clear_refs); CPU peak memory needs Linux (or use "
                           "--device cuda)")
    return dict(peak_delta_bytes=peak.delta_bytes)


def run_time(args: argparse.Namespace) -> dict:
    import torch

    step, _ = build_steps(args)
    for variant in VARIANTS:
        step(variant)  # warm-up
    wall, cpu = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    for _ in range(args.iters):
        for variant in VARIANTS:
            w, c = step(variant)
            wall[variant].append(w)
            cpu[variant].append(c)
    return dict(wall=wall, cpu=cpu, threads=torch.get_num_threads())


# ---------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------


def _subprocess(argv: list[str], mode: str) -> dict:
    env = dict(os.environ)
    if mode.startswith("memory"):
        # Fixed mmap threshold: every block >= 64 KiB is mmapped and unmapped on free, so RSS tracks live
        # tensors (glibc's default dynamic threshold keeps blocks up to 32 MiB in the heap after free).
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    proc = subprocess.run([sys.executable, __file__, *argv, "--mode", mode], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"benchmark worker '{mode}' failed (exit {proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "time":
        print(json.dumps(run_time(args)))
        return
    if args.mode:
        print(json.dumps(run_memory(args, args.mode.removeprefix("memory-"))))
        return

    argv = list(sys.argv[1:] if argv is None else argv)
    mem = {v: _subprocess(argv, f"memory-{v}")["peak_delta_bytes"] for v in VARIANTS}
    timing = _subprocess(argv, "time")
    wall, cpu = timing["wall"], timing["cpu"]
    on_cpu = args.device == "cpu"

    mib = 2**20
    head = "shared frozen" if args.frozen_head else "per-head trainable"
    print(
        f"N={args.n} d={args.d} V={args.vocab} heads={args.heads} chunk={args.chunk} dtype={args.dtype} "
        f"device={args.device} lm_head={head} soft_weight={args.soft_weight} "
        f"timed steps={args.iters}/variant threads={timing['threads']}"
    )
    ms = 1e3

    def med(times: list[float]) -> float:
        return Timing(times).median

    rows = [
        ("fwd+bwd wall min (ms)", min(wall["reference"]) * ms, min(wall["fused"]) * ms),
        ("fwd+bwd wall med (ms)", med(wall["reference"]) * ms, med(wall["fused"]) * ms),
    ]
    if on_cpu:
        rows.append(("fwd+bwd CPU med (ms)", med(cpu["reference"]) * ms, med(cpu["fused"]) * ms))
    rows.append(("peak memory (MiB)", mem["reference"] / mib, mem["fused"] / mib))
    print(f"{'':24}{'reference':>12}{'fused':>12}{'fused/ref':>12}")
    for label, r, f in rows:
        print(f"{label:24}{r:12.1f}{f:12.1f}{f / r:12.2f}")
    if not args.frozen_head:
        grad_mib = args.heads * args.vocab * args.d * (4 if args.dtype == "fp32" else 2) / mib
        print(f"both peaks include {grad_mib:.0f} MiB of lm_head weight grads that any method must produce")
    print("wall step times (s): " + "; ".join(f"{v} " + " ".join(f"{t:.2f}" for t in wall[v]) for v in VARIANTS))
    basis = cpu if on_cpu else wall
    speed = ratio(med(basis["reference"]), med(basis["fused"]), digits=6)  # one run: the workers interleave
    mem_ratio = mem["fused"] / mem["reference"]
    verdict = "meets" if (mem_ratio <= 0.5 and speed >= 0.9) else "misses"
    print(
        f"fused speed vs ref: {speed:.2f}x (median {'CPU' if on_cpu else 'wall'} time); fused memory vs ref: "
        f"{mem_ratio:.2f}x -> {verdict} target (memory <= 0.5x at speed >= 0.9x)"
    )


if __name__ == "__main__":
    main()
