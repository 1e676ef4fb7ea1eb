"""Microseconds per matmul for SmolLM2's decode shapes, by rows N (tokens per forward) and dtype.

    python bench/matmul_shapes.py

Why it matters: tree verification runs the base on N = tree size tokens at once; it only pays off where an
N-row matmul costs about what a 1-row one does (memory-bound). fp32 uses MKL with the transposed-weight
layout the `fast` backend uses for fp32; bf16 uses oneDNN through F.linear, the layout it uses for bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import time_fn  # noqa: E402

SHAPES = {"lm_head 576->49152": (576, 49152), "gate+up 576->3072": (576, 3072), "down 1536->576": (1536, 576)}
ROWS = (1, 2, 5, 8, 16, 64)


def _time_us(fn, iters: int = 20) -> float:
    """Mean microseconds of `iters` calls after 3 warm-up calls."""
    return time_fn(fn, warmup=3, repeats=iters).mean * 1e6


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'shape':<20} {'dtype':<5} " + " ".join(f"{'N=' + str(n):>8}" for n in ROWS))
    for name, (d_in, d_out) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(d_out, d_in, dtype=dtype)
            w_t = w.T.contiguous()
            cells = []
            for n in ROWS:
                x = torch.randn(n, d_in, dtype=dtype)
                if dtype == torch.float32:
                    fn = lambda x=x, w_t=w_t: torch.mm(x, w_t)  # noqa: E731
                else:
                    fn = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
                cells.append(f"{_time_us(fn):>8.0f}")
            print(f"{name:<20} {str(dtype).removeprefix('torch.'):<5} " + " ".join(cells))
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 576, dtype=dtype), torch.randn(49152, 576, dtype=dtype)
        us = _time_us(lambda a=a, b=b: a @ b.T, iters=3)
        gflops = 2 * 1024 * 576 * 49152 / us / 1e3
        print(f"large GEMM 1024x576x49152 {str(dtype).removeprefix('torch.')}: {gflops:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
