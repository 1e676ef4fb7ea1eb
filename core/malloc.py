"""Keep freed memory in the process for reuse, for CPU training (glibc only; elsewhere a no-op).

Why: glibc serves every allocation above its mmap threshold (which grows to at most 32 MiB on 64-bit) with a
fresh mmap and unmaps it on free, so each LM-head-sized temporary of a training step ([16384, 576] fp32 = 37.7 MB:
the gradient accumulator, the fp32 copies of the head and of its gradient) comes back as ~9k new pages that the
kernel faults in and zeroes, every step, on every such tensor. Measured on EAGLE-3's step (docs/lab/train_step_cpu.md):
zeros_like of the head 13 ms instead of ~2, and the bf16 step 5-10 % faster with the setting. The cost: memory freed
inside the process is kept for its next allocation rather than returned to the system, so the resident size stays
near the step's peak (which a training loop reaches again every step anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tell glibc to serve large allocations from the heap (no per-allocation mmap) and never trim the heap back.
    Returns whether the setting took (False off Linux/glibc). Affects the allocations made after the call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
