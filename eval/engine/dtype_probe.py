"""The decode-dtype probe: the real base's decode steps timed in bf16 and fp32 side by side, on the backend that
will decode, so that `dtype=fast` decodes in whichever is faster on this machine (core/dtype_phases.py says why
this is measured rather than read from the CPU flags).

What is timed: both backends (one per dtype, built from one fp32 copy of the base) prefill the same PROBE_PREFIX
random tokens once; then, in PROBE_REPEATS interleaved rounds (bf16 then fp32, fp32 then bf16, ...: a change in
the machine's load hits both alike), each runs STEPS_PER_SAMPLE steps of one token (an AR step) and of
PROBE_WIDTH tokens in a chain (a speculative verify step), every step dropped again (commit of nothing), so the KV
prefix stays PROBE_PREFIX long. The median per dtype and width is kept, in ms per step. A few seconds for
SmolLM2-135M on 2 cores; the result is cached per machine (core/dtype_probe_cache.py), so it runs once, and again
where the cached record was measured on another host or CPU, by another version of this code (PROBE_CODE: this
module and the backends it times) or on a loaded machine.

Only `dtype=fast` on a CPU with bf16 matrix instructions probes (core/dtype_phases.py: needs_probe): CUDA decodes
in bf16 and a CPU without bf16 instructions in fp32 with no measurement, and an explicit dtype is kept as asked.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from core.dtype_phases import PROBE_FORMAT, PhaseDtypes, needs_probe, phase_dtypes
from core.dtype_probe_cache import probe_key, read_cached, write_cached
from core.keyed_cache import code_version
from core.load import LoadWatch
from eval.engine.backends.backend import Backend
from eval.engine.backends.choice import choose_backend

log = logging.getLogger("specdraft.dtype_probe")

PROBE_PREFIX = 128  # committed tokens before the timed steps: a short prompt's KV
PROBE_WIDTH = 4  # verify width: a 3-token chain or a 4-node tree (root included)
PROBE_REPEATS = 7  # interleaved rounds; the median of each (dtype, width) is kept
STEPS_PER_SAMPLE = 3  # steps per timed sample (one sample = their mean)
WARMUP_STEPS = 2  # untimed steps per (dtype, width): oneDNN / MKL pick their kernels on the first call
# The code whose timing a cached record holds: this module and the decode backends it times. Another version of any
# of them measures again (core/keyed_cache.py: code_version).
_BACKENDS = Path(__file__).resolve().parent / "backends"
PROBE_CODE = (Path(__file__).resolve(), *(_BACKENDS / f for f in ("backend.py", "choice.py", "fast.py", "fast_core.py",
                                                                   "fast_matmul.py", "fast_support.py", "hf.py")))


def probe_code_version() -> str:
    """The version of the code a probe record was measured by (PROBE_CODE's source digest)."""
    return code_version(PROBE_CODE)


def probe_backends(model: torch.nn.Module, kind: str, max_len: int) -> dict[str, Backend]:
    """{"bf16": backend, "fp32": backend} over `model` (an fp32 base) for decode backend `kind` ("fast" | "hf").
    The fast backend keeps its own weight copy in the dtype it is given; the hf backend runs the model itself, so
    its bf16 side runs on a bf16 copy (one extra copy of the weights, for the probe's few seconds)."""
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if kind == "fast":
        from eval.engine.backends.fast import FastBackend

        return {name: FastBackend(model, max_len=max_len, dtype=d) for name, d in dtypes.items()}
    from eval.engine.backends.hf import HFBackend

    return {"bf16": HFBackend(copy.deepcopy(model).to(torch.bfloat16)), "fp32": HFBackend(model)}


def time_decode_steps(backends: dict[str, Backend], *, vocab_size: int, prefix: int = PROBE_PREFIX,
                      width: int = PROBE_WIDTH, repeats: int = PROBE_REPEATS, steps: int = STEPS_PER_SAMPLE,
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """{dtype name: {"1": ms, str(width): ms}}: median ms per decode step of each backend at 1 token and at a
    `width`-token chain after a `prefix`-token KV cache (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)  # fixed ids: the same work on every run (matmul speed ignores them)
    ids = torch.randint(0, vocab_size, (prefix + width,), generator=gen)
    chains = {n: (ids[prefix:prefix + n], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril_())
              for n in (1, width)}  # tokens [n], depths [n], tree_mask [n, n]: a chain, each node sees its ancestors
    drop = torch.zeros(0, dtype=torch.long)  # commit nothing: the cache stays `prefix` long

    def step(backend: Backend, n: int) -> None:
        backend.forward_tree(*chains[n])
        backend.commit(drop)

    for backend in backends.values():
        backend.reset(prefix + width)
        backend.prefill(ids[:prefix])
        for n in chains:
            for _ in range(WARMUP_STEPS):
                step(backend, n)
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in chains} for name in backends}
    names = list(backends)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:  # A B / B A: drift in the load hits both dtypes alike
            for n in chains:
                t0 = clock()
                for _ in range(steps):
                    step(backends[name], n)
                samples[name][n].append((clock() - t0) / steps * 1e3)
    return {name: {str(n): round(statistics.median(v), 3) for n, v in by_n.items()} for name, by_n in samples.items()}


def probe_decode_speed(model: torch.nn.Module, kind: str) -> dict:
    """The probe record (core/dtype_phases.py: check_probe) of `model` (an fp32 base on the CPU) decoding with
    backend `kind`: ms per step in bf16 and fp32 at 1 and PROBE_WIDTH tokens, and the load beside the timing."""
    t0 = time.perf_counter()
    watch = LoadWatch()
    backends = probe_backends(model, kind, PROBE_PREFIX + PROBE_WIDTH)
    ms = time_decode_steps(backends, vocab_size=int(model.config.vocab_size))
    return {"format": PROBE_FORMAT, "backend": kind, "prefix": PROBE_PREFIX, "width": PROBE_WIDTH,
            "repeats": PROBE_REPEATS, "threads": torch.get_num_threads(), "ms": ms, "load": watch.record(),
            "seconds": round(time.perf_counter() - t0, 2), "measured": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime())}


def resolve_phase_dtypes(requested: str, device: torch.device | str, *, load_fp32: Callable[[], object],
                         fingerprint: str | None = None, backend: str = "auto", cache_dir=None,
                         probe: Callable[[torch.nn.Module, str], dict] | None = None,
                         cpuinfo: str | None = None) -> PhaseDtypes:
    """The dtypes a run asked for `requested` (fp32 | bf16 | fp16 | auto | fast) decodes and bulk-computes in.

    Only `fast` on a CPU with bf16 instructions measures: the cached probe for this machine (CPU, torch, threads,
    base `fingerprint`, `backend`) when there is one, else `probe(model, backend kind)` (default:
    probe_decode_speed) on the base that `load_fp32()` returns (a models.base.LoadedBase in fp32 on the CPU; loaded
    only when needed, or when `fingerprint` is None, to read it), whose record is then cached with its provenance. A
    cached record measured on another host or CPU, by another version of the probe code or on a loaded machine
    (core/keyed_cache.py: stale) is measured again, with one line saying why. cpuinfo: /proc/cpuinfo's text (tests
    pass another CPU's)."""
    device = torch.device(device)
    if not needs_probe(requested, device, cpuinfo):
        return phase_dtypes(requested, device, cpuinfo=cpuinfo)
    from eval.engine.backends.fast_matmul import fp32_layout

    base = None
    if fingerprint is None:
        base = load_fp32()
        fingerprint = base.fingerprint
    key = probe_key(fingerprint=fingerprint, backend=backend, threads=torch.get_num_threads(),
                    extra={"fp32_matmul": fp32_layout(device)}, cpuinfo=cpuinfo)
    code = probe_code_version()
    record = read_cached(key, cache_dir, code=code, cpuinfo=cpuinfo)
    if record is None:
        base = base if base is not None else load_fp32()
        kind, _ = choose_backend(backend, base.model)
        log.info("timing decode steps in bf16 and fp32 on this machine (once; cached per CPU, torch, threads, base)")
        record = (probe or probe_decode_speed)(base.model, kind)
        record = {**record, "cache_file": str(write_cached(key, record, cache_dir, code=code, cpuinfo=cpuinfo))}
    del base
    return phase_dtypes(requested, device, probe=record, cpuinfo=cpuinfo)
