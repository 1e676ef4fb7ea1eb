"""What every benchmark script of bench/ shares: timing, side-by-side ratios, peak memory, and a results file
written after each arm.

    from bench.harness import Results, Stopwatch, clock_sync, peak_memory, ratio, time_fn, time_once, time_paired

    results = Results("runs/bench-x/bench.json", {"device": "cpu", "rows": {}})
    for name, fn in arms.items():                       # each arm's row is on disk before the next arm starts,
        with results.arm("rows", name) as row:          # so a stage killed by its timeout keeps what it finished
            t = time_fn(fn, warmup=1, repeats=5, sync=clock_sync(device))
            row.update(t.summary())                     # median_s, min_s, max_s, spread, repeats
    ref, arm = time_paired(ref_fn, arm_fn, repeats=6)   # interleaved A B / B A: load drift hits both alike
    speedup = ref.median / arm.median                   # a ratio is only ever taken between one run's numbers

Timing. `time_fn` runs `warmup` untimed calls, then `repeats` timed ones; `sync` (clock_sync(device): CUDA's
synchronize on a CUDA device, nothing elsewhere) runs before each clock read, so a GPU's queued kernels are
inside the interval they belong to. `Timing.median` is the figure to report; `spread` = (max - min) / median, the
relative range, says how noisy the machine was. A clock is injectable (tests script it; `time.process_time` is
the CPU-time clock a loaded shared CPU wants).

Memory. `peak_memory(device)` measures the peak of a block: CUDA's max_memory_allocated (reset at entry), else
the process's peak RSS (VmHWM, reset at entry where the kernel allows it through /proc/self/clear_refs; otherwise
the lifetime peak, flagged `reset: false`); `delta_bytes` is the peak above what was live at entry. On a CPU, RSS
follows live tensors only if freed blocks go back to the kernel (bench/fused_ce.py runs its memory workers with
MALLOC_MMAP_THRESHOLD_=64KiB for that).

Phases. `Stopwatch(sync)` is for a call that times its own parts (prefill inside a decode): wall() and cpu()
(process CPU time) since it started, each read after a sync.

Results. `Results` holds the script's own JSON (keys unchanged from before the harness) and writes it atomically
(core/atomic.py) on every `save`, `put` and at the end of every `arm` block, finished or failed: a failed arm
leaves {"error": "..."} in its row and the exception goes on up, or, with `arm(..., keep_going=True)`, stops
there so the next arm still runs (bench/regenerate.py times each engine so). With path None nothing is written
(a script run without --out).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench scripts run from a checkout without install

from core.atomic import write_text_atomic  # noqa: E402


@dataclass
class Timing:
    """Seconds of each timed call, in the order they ran."""

    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.05 = the slowest repeat took 5 % of the median longer than the fastest."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    def summary(self, digits: int = 6) -> dict:
        return {"median_s": round(self.median, digits), "min_s": round(self.min, digits),
                "max_s": round(self.max, digits), "spread": round(self.spread, 4), "repeats": len(self.times)}


def clock_sync(device) -> Callable[[], None]:
    """What to run before each clock read on `device`: torch.cuda.synchronize on a CUDA device (the kernels a
    call queued finish inside its interval), nothing elsewhere."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_fn(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5, sync: Callable[[], None] | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """`warmup` untimed calls of fn(), then `repeats` timed ones."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_fn: repeats={repeats} (>= 1), warmup={warmup} (>= 0)")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = Timing()
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        out.times.append(clock() - t0)
    return out


def time_once(fn: Callable[[], object], *, sync: Callable[[], None] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> tuple[object, float]:
    """(fn()'s value, its seconds): one timed call, for arms too long to repeat (a build, a load)."""
    sync = sync or (lambda: None)
    sync()
    t0 = clock()
    value = fn()
    sync()
    return value, clock() - t0


def time_paired(ref: Callable[[], object], arm: Callable[[], object], *, warmup: int = 1, repeats: int = 6,
                sync: Callable[[], None] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> tuple[Timing, Timing]:
    """ref and arm timed in one run, interleaved A B, B A, A B, ... so a change of machine load (another job
    starting, a clock boost ending) lands on both alike; ratios of the two medians are fair. Each is warmed up
    first (`warmup` calls)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_paired: repeats={repeats} (>= 1), warmup={warmup} (>= 0)")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        ref()
        arm()
    sync()
    a, b = Timing(), Timing()
    for k in range(repeats):
        order = ((ref, a), (arm, b)) if k % 2 == 0 else ((arm, b), (ref, a))
        for fn, into in order:
            t0 = clock()
            fn()
            sync()
            into.times.append(clock() - t0)
    return a, b


class Stopwatch:
    """For a call that times its own phases (prefill, then the whole decode): started at creation, after a sync;
    wall() / cpu() are the seconds since then, read after a sync. cpu() is the process's CPU time (all threads),
    which other processes' load barely moves, unlike wall time."""

    def __init__(self, sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time):
        self.sync, self.clock, self.cpu_clock = sync or (lambda: None), clock, cpu_clock
        self.sync()
        self.t0, self.c0 = clock(), cpu_clock()

    def wall(self) -> float:
        self.sync()
        return self.clock() - self.t0

    def cpu(self) -> float:
        self.sync()
        return self.cpu_clock() - self.c0


def ratio(numerator: float, denominator: float, digits: int = 2) -> float | None:
    """numerator / denominator rounded, None when the denominator is 0 (an arm that measured nothing)."""
    return round(numerator / denominator, digits) if denominator else None


def rss_kib(field_name: str) -> int | None:
    """A memory field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: its peak), None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: 5 into /proc/self/clear_refs); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass
class Peak:
    """Filled when the `peak_memory` block ends."""

    kind: str = ""  # "cuda_max_allocated" or "cpu_peak_rss"
    bytes: int = 0  # the peak: CUDA's max_memory_allocated; CPU: the process's peak resident set size (VmHWM)
    start_bytes: int = 0  # the same measure at entry (CUDA: memory_allocated; CPU: VmRSS)
    reset: bool = True  # CPU: False when the peak could not be reset at entry (the process's lifetime peak)

    @property
    def delta_bytes(self) -> int:
        """What the block added at its peak over what was live at entry."""
        return self.bytes - self.start_bytes

    def summary(self) -> dict:
        return {"peak_kind": self.kind, "peak_bytes": self.bytes, "peak_delta_bytes": self.delta_bytes,
                "peak_mib": round(self.bytes / 2**20, 1), **({} if self.reset else {"peak_reset": False})}


@contextmanager
def peak_memory(device="cpu") -> Iterator[Peak]:
    """The peak memory of the block (see the module docstring)."""
    import torch

    device = torch.device(device)
    peak = Peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        peak.start_bytes = torch.cuda.memory_allocated(device)
        try:
            yield peak
        finally:
            torch.cuda.synchronize(device)
            peak.kind, peak.bytes = "cuda_max_allocated", torch.cuda.max_memory_allocated(device)
        return
    peak.reset = reset_peak_rss()
    peak.start_bytes = 1024 * (rss_kib("VmRSS") or 0)
    try:
        yield peak
    finally:
        hwm = rss_kib("VmHWM")
        if hwm is None:  # no /proc: getrusage's lifetime peak (KiB on Linux)
            hwm, peak.reset = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, False
        peak.kind, peak.bytes = "cpu_peak_rss", hwm * 1024


class Results:
    """A script's results dict, on disk after every change (atomic: a reader never sees half a file)."""

    def __init__(self, path: str | Path | None, data: dict | None = None):
        self.path = None if path is None else Path(path)
        self.data = {} if data is None else data

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(self.data, indent=1, default=str) + "\n")

    def put(self, *keys_and_value) -> None:
        """put("a", "b", v): data["a"]["b"] = v (missing levels made), then save."""
        *keys, value = keys_and_value
        self._node(keys[:-1])[keys[-1]] = value
        self.save()

    def _node(self, keys) -> dict:
        node = self.data
        for k in keys:
            node = node.setdefault(k, {})
        return node

    @contextmanager
    def arm(self, *keys: str, keep_going: bool = False) -> Iterator[dict]:
        """A row at data[keys...] (a fresh dict) that the block fills; saved when the block ends. A block that
        raises leaves {"error": "<type>: <message>"} beside what it had filled, saved, and the exception goes
        on (KeyboardInterrupt and SystemExit too). keep_going=True: an Exception stops there instead (its
        traceback printed to stderr, the row saved with its error) and the code after the block runs, so one
        failing arm costs only itself; KeyboardInterrupt and SystemExit still go on."""
        row: dict = {}
        self._node(keys[:-1])[keys[-1]] = row
        try:
            yield row
        except Exception as exc:
            row["error"] = _error_text(exc)
            if not keep_going:
                raise
            traceback.print_exc(file=sys.stderr)
        except BaseException as exc:
            row["error"] = _error_text(exc)
            raise
        finally:
            self.save()


def _error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
