"""What this machine computes fast: the device a run uses and the dtype `auto` / `fast` resolve to."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def cpuinfo_text() -> str:
    """/proc/cpuinfo, or "" where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str) -> str:
    """The CPU's model name (lscpu's "Model name") in a /proc/cpuinfo text; "" when it has none."""
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                 if line.lower().startswith("model name")), "")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU has bf16 matrix instructions (avx512_bf16 or AMX). Without them torch emulates bf16
    GEMMs: on an AVX2-only AMD EPYC a [512, 576] x [576, 1536] bf16 matmul took 47 ms against 5 ms in fp32,
    while with AVX512-BF16 bf16 runs SmolLM2 ~2.5-3x faster than fp32 (docs/lab/benchmarks.md, "Which dtype")."""
    if cpuinfo is None:
        cpuinfo = cpuinfo_text()  # "" where there is none (not Linux): no way to tell, stay exact
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def fast_dtype(device: torch.device) -> torch.dtype:
    """The faster of bf16 and fp32 for matmuls on `device`: bf16 on CUDA (when supported) and on CPUs with
    bf16 matrix instructions, fp32 elsewhere."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = bf16 on CUDA (half the memory, tensor cores), fp32 elsewhere: exact, and what the
    parity and losslessness checks are tuned for. 'fast' = bf16 where the hardware runs it faster than fp32
    (CUDA, CPUs with avx512_bf16/AMX), else fp32 (fast_dtype): what the CPU recipes and the demo ask for."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fast":
        return fast_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"unknown base dtype {dtype!r}; use 'auto', 'fast', 'fp32', 'bf16' or 'fp16'")
    return DTYPES[dtype]



def resolve_device(name: str) -> torch.device:
    """'auto' = CUDA when available, else CPU; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
