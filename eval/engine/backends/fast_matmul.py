"""The fast backend's two fp32 matmul layouts, and which one this machine gets (eval/engine/backends/fast.py).

"xw": x [N, in] @ W_t, W_t a contiguous [in, out] copy (what MKL on Intel runs fastest for 1-row decode steps).
"wx": (W [out, in] @ x^T)^T with W in its own layout (what MKL on an AVX2-only AMD EPYC runs fastest for the
2-16 rows of tree verification; docs/lab/benchmarks.md, "Which dtype").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def matmul_xw(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ w_t [in, out] (+ bias [out]) (+ residual [N, out]), in as few kernels as possible."""
    if residual is None:
        return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)
    out = torch.addmm(residual, x, w_t)  # residual add fused into the GEMM
    return out if bias is None else out.add_(bias)


def matmul_wx(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """The same product computed transposed, (W [out, in] @ x^T [in, N])^T, for w_t a transposed view of a
    contiguous [out, in] weight (fp32 "wx" layout, see fp32_layout). Returns a contiguous [N, out].
    1 and 3 rows get one padding row (a copy of the last): MKL's kernels on the AMD EPYC run those widths slowly,
    a SmolLM2 step of 1 token took 41 ms against 33 ms as 2 rows (as fast as "xw"'s 1-row path), 3 tokens 42 ms
    against 38 ms as 4; padding 5 to 6 rows made it slower (bench/demo_costs.py, docs/lab/benchmarks.md "Which
    dtype")."""
    n = x.shape[0]
    if n in (1, 3):
        res = None if residual is None else torch.cat([residual, residual[-1:]])
        return matmul_wx(torch.cat([x, x[-1:]]), w_t, bias, res)[:n]
    w, xt = w_t.t(), x.t()
    if residual is None:
        out = torch.mm(w, xt) if bias is None else torch.addmm(bias.unsqueeze(1), w, xt)
    else:
        out = torch.addmm(residual.t(), w, xt)  # residual add fused into the GEMM, [out, N]
        if bias is not None:
            out.add_(bias.unsqueeze(1))
    return out.t().contiguous()


FP32_LAYOUT_ENV = "SPECDRAFT_FP32_MATMUL"


def fp32_layout(device: torch.device) -> str:
    """How fp32 matmuls run on this CPU: "xw" (x @ W_t, W_t a contiguous [in, out] copy) or "wx" ((W @ x^T)^T
    with W in its [out, in] layout). MKL on an AVX2-only AMD EPYC (docs/lab/benchmarks.md, "Which dtype") runs the
    2-16 row products of tree verification 1.4-4x faster as "wx" (lm_head at N=5: 6.4 vs 26 ms), and the body's
    1-row products no slower; the Intel CPU with AVX512-BF16 these defaults were first tuned on ran "xw" 1.3-2x
    faster for N=1. Default: "wx" on AMD, "xw" elsewhere; $SPECDRAFT_FP32_MATMUL=xw|wx overrides."""
    forced = os.environ.get(FP32_LAYOUT_ENV)
    if forced:
        if forced not in ("xw", "wx"):
            raise ValueError(f"{FP32_LAYOUT_ENV}={forced!r}: use xw (x @ W_t) or wx ((W @ x^T)^T)")
        return forced
    if device.type != "cpu":
        return "xw"
    try:
        amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amd = False
    return "wx" if amd else "xw"
