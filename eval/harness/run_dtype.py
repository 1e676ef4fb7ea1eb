"""The dtype a decoding run (`specdraft eval`, `tune`'s own-decoder runs, the demo's decode) loads its base in.

`dtype=fast` is resolved per phase before anything is loaded (core/dtype_phases.py; on a CPU with bf16 matrix
instructions the decode probe of eval/engine/dtype_probe.py picks bf16 or fp32 for decoding), and the run's config
gets the concrete decode dtype. Everything the run decodes then runs in that one dtype: own AR and speculative
decoding share one backend, and its prefill, so plain and speculative decoding always compare like with like (the
losslessness verdict), and a tuning.json choice is matched against the dtype the run really decodes in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from core.dtype_phases import PhaseDtypes


def decode_dtypes(cfg, base_name: str, fingerprint: str | None = None) -> tuple[object, PhaseDtypes]:
    """(cfg with `dtype` the concrete decode dtype, the run's PhaseDtypes) for an eval config `cfg` (its dtype,
    device and backend) decoding base `base_name` (fingerprint: the base's, when known without loading it)."""
    from core.hardware import resolve_device
    from eval.engine.dtype_probe import resolve_phase_dtypes
    from models.base import load_base

    device = resolve_device(cfg.device)

    def load_fp32():  # the probe's base: fp32 on the CPU (the probe builds its bf16 side from it)
        return load_base(base_name, dtype="fp32", device="cpu")

    phases = resolve_phase_dtypes(cfg.dtype, device, load_fp32=load_fp32, fingerprint=fingerprint,
                                  backend=cfg.backend)
    return dataclasses.replace(cfg, dtype=phases.decode), phases


def export_decode_dtypes(cfg, export_dir: Path) -> tuple[object, PhaseDtypes]:
    """decode_dtypes for the base an export runs on (cfg.base_path, else the export's own, whose fingerprint the
    export records)."""
    from models.export.specdraft import read_export_config

    export_cfg = read_export_config(Path(export_dir))
    if cfg.base_path:
        return decode_dtypes(cfg, cfg.base_path)
    return decode_dtypes(cfg, export_cfg["base_model"], export_cfg.get("base_fingerprint"))


def format_dtypes(dtypes: dict | None) -> str:
    """One line for a summary from a report's extra["dtypes"] (PhaseDtypes.to_dict): which dtype each phase used
    and why (the probe's numbers where `fast` measured)."""
    return f"dtypes: {dtypes['why']}" if dtypes else "dtypes: not recorded"
