"""Which dtype each phase of a run computes in: bulk phases (training, the hidden-state cache, field-refs, long
prefills: hundreds of rows per matmul) and decoding phases (one-token AR steps, verify steps of a few tokens).

Why two answers to `fast`: a bulk forward is compute-bound, and on a CPU with bf16 matrix instructions (AVX512-BF16,
AMX) it runs 2.5-3x faster in bf16 (docs/lab/benchmarks.md). A decode step is a 1-4 row product that streams every
weight once, and which dtype wins there depends on the CPU's GEMV kernels, not on its flags: on an Intel AMX box a
one-token SmolLM2 step ran at 22.9 tok/s in bf16 against ~31 in fp32, while the AVX512-BF16 EPYC runs them about
level. So on such a CPU `fast` keeps bf16 for the bulk phases and takes the decode dtype from a measurement of the
real base (eval/engine/dtype_probe.py), cached per machine (core/dtype_probe_cache.py). CUDA: bf16 for both (fp16
where the GPU lacks bf16), no probe. A CPU without bf16 instructions emulates bf16 (~9x slower): fp32 for both.

An explicit dtype (`fp32`, `bf16`, `fp16`) means exactly that for every phase, and `auto` keeps its meaning
(core/hardware.py: resolve_dtype): neither is probed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from core.hardware import cpu_has_fast_bf16, fast_dtype, resolve_dtype

# bf16 decodes only where its probe cost is at least this much below fp32's: a closer call is within the probe's
# noise (interleaved medians of a few seconds), and fp32 decoding gives the exact losslessness verdict for free.
BF16_MARGIN = 0.05
# The probe record's layout (eval/engine/dtype_probe.py: probe_decode_speed); a cached record of another format is
# measured again.
PROBE_FORMAT = 1
PROBE_DTYPES = ("bf16", "fp32")

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16": the names configs use (core/hardware.py: DTYPES)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class PhaseDtypes:
    """What a run computes in. bulk: training, hidden-state caches, field-refs, the demo's plan probe; decode: own
    AR and speculative decoding, their prefill included (one weight copy and one KV cache per run: a prefill of a
    few hundred tokens is a few % of a 256-token decode, docs/lab/benchmarks.md "Decoding dtype"). why: one line
    that says where each came from, with the probe's numbers; probe: the probe record, or None."""

    bulk: str
    decode: str
    why: str
    probe: dict | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill": self.decode}


def needs_probe(requested: str, device: torch.device, cpuinfo: str | None = None) -> bool:
    """Whether `requested` on `device` asks for a measurement: `fast` on a CPU with bf16 matrix instructions."""
    return requested == "fast" and torch.device(device).type == "cpu" and cpu_has_fast_bf16(cpuinfo)


def check_probe(probe) -> str | None:
    """None when `probe` is a usable probe record, else what is wrong with it (for the cache's warning)."""
    if not isinstance(probe, dict):
        return f"a {type(probe).__name__}, not a JSON object"
    if probe.get("format") != PROBE_FORMAT:
        return f"probe format {probe.get('format')!r}, this version writes {PROBE_FORMAT}"
    width, ms = probe.get("width"), probe.get("ms")
    if not isinstance(width, int) or width < 2 or not isinstance(ms, dict):
        return "no verify width or no 'ms' timings"
    for name in PROBE_DTYPES:
        row = ms.get(name)
        for w in ("1", str(width)):
            value = row.get(w) if isinstance(row, dict) else None
            if not isinstance(value, (int, float)) or not value > 0:
                return f"ms.{name}.{w} is {value!r}, not a positive time"
    return None


def decode_costs(probe: dict) -> dict[str, float]:
    """Per dtype, one AR step + one verify step of the probe's width (ms): an eval decodes every prompt both ways
    (own AR at width 1, speculative steps at a few tokens), so each counts once."""
    w = str(probe["width"])
    return {name: probe["ms"][name]["1"] + probe["ms"][name][w] for name in PROBE_DTYPES}


def decode_from_probe(probe: dict) -> str:
    """The decode dtype a probe record picks: bf16 when its cost is BF16_MARGIN below fp32's, else fp32."""
    cost = decode_costs(probe)
    return "bf16" if cost["bf16"] <= (1 - BF16_MARGIN) * cost["fp32"] else "fp32"


def describe_probe(probe: dict) -> str:
    """The probe's numbers in one clause: "1 token bf16 31.2 / fp32 29.0 ms, 4 tokens bf16 34.1 / fp32 36.9 ms
    (quiet: load average up to 0.4 on 2 cores)"."""
    from core.load import describe

    ms, w = probe["ms"], str(probe["width"])
    return (f"1 token bf16 {ms['bf16']['1']:.1f} / fp32 {ms['fp32']['1']:.1f} ms, {w} tokens bf16 "
            f"{ms['bf16'][w]:.1f} / fp32 {ms['fp32'][w]:.1f} ms ({describe(probe.get('load'))})")


def phase_dtypes(requested: str | torch.dtype, device: torch.device, probe: dict | None = None,
                 cpuinfo: str | None = None) -> PhaseDtypes:
    """The dtypes of a run asked for `requested` (a config's dtype: fp32 | bf16 | fp16 | auto | fast) on `device`.
    `fast` on a CPU with bf16 instructions needs `probe` (needs_probe); every other case ignores it."""
    device = torch.device(device)
    if requested != "fast":
        name = dtype_name(resolve_dtype(requested, device))
        asked = requested if isinstance(requested, str) else name
        return PhaseDtypes(name, name, f"every phase {name}: dtype={asked} asked for (no probe)")
    if device.type != "cpu":
        name = dtype_name(fast_dtype(device))
        return PhaseDtypes(name, name, f"fast on {device.type}: every phase {name} (no probe)")
    if not cpu_has_fast_bf16(cpuinfo):
        return PhaseDtypes("fp32", "fp32", "fast on a CPU without bf16 matrix instructions (no avx512_bf16 / "
                           "amx_bf16: torch would emulate bf16): every phase fp32 (no probe)")
    if probe is None:
        raise ValueError("phase_dtypes('fast') on a CPU with bf16 instructions needs the decode probe's record; "
                         "resolve through eval/engine/dtype_probe.py: resolve_phase_dtypes")
    bad = check_probe(probe)
    if bad:
        raise ValueError(f"unusable decode probe record ({bad}); measure again (eval/engine/dtype_probe.py)")
    decode = decode_from_probe(probe)
    cost = decode_costs(probe)
    rule = (f"bf16 at least {BF16_MARGIN:.0%} cheaper" if decode == "bf16"
            else f"bf16 not {BF16_MARGIN:.0%} cheaper than fp32")
    return PhaseDtypes("bf16", decode, f"fast: decoding {decode} (own AR, speculative, their prefill), bulk phases "
                       f"bf16 (training, caches: bf16 matrix instructions); decode probe on this base: "
                       f"{describe_probe(probe)}; 1 + {probe['width']} token steps bf16 {cost['bf16']:.1f} vs fp32 "
                       f"{cost['fp32']:.1f} ms: {rule}", probe)
