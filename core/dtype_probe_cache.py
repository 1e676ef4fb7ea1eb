"""The decode-dtype probe's results, kept per machine under the user cache ($SPECDRAFT_CACHE, else
~/.cache/specdraft): dtype_probe/<key hash>.json, one file per key.

The key is what the bf16-vs-fp32 decode timing depends on: the CPU (model name and a hash of its flags), the torch
version (its oneDNN / MKL kernels), torch's intra-op thread count, the base (its fingerprint: shapes and weights),
the decode backend asked for and anything else the caller adds (the fast backend's fp32 matmul layout). A change
in any of them names another file, so the probe runs again. The file holds the key it was written for, the probe
record (core/dtype_phases.py: check_probe) and its provenance (core/keyed_cache.py: the host, the CPU's model and
kernel flags, the probe code's version, the load average around the timing, the date); a file that does not parse,
holds another key or an unusable record is reported in a warning and measured again, never trusted, and a record
measured on another host or CPU, by other code or on a loaded machine is measured again, with one line saying why.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from core.dtype_phases import PROBE_FORMAT, check_probe
from core.hardware import cpu_model, cpuinfo_text
from core.keyed_cache import keyed_path, provenance, read_keyed, write_keyed

log = logging.getLogger("specdraft.dtype_probe")
PROBE_DIR = "dtype_probe"


def cpu_signature(cpuinfo: str | None = None) -> dict:
    """{"cpu": model name, "cpu_flags": 16 hex chars of sha256 over the sorted flags} from /proc/cpuinfo (empty
    strings where there is none: not Linux)."""
    if cpuinfo is None:
        cpuinfo = cpuinfo_text()
    model = cpu_model(cpuinfo)
    flags = sorted({f for line in cpuinfo.splitlines() if line.lower().startswith("flags")
                    for f in line.split(":", 1)[1].split()})
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16] if flags else ""
    return {"cpu": model, "cpu_flags": digest}


def probe_key(*, fingerprint: str, backend: str, threads: int, extra: dict | None = None,
              cpuinfo: str | None = None) -> dict:
    """What a probe result holds for (see the module docstring)."""
    import torch

    return {"format": PROBE_FORMAT, **cpu_signature(cpuinfo), "torch": torch.__version__, "threads": int(threads),
            "base": fingerprint, "backend": backend, **(extra or {})}


def cache_path(key: dict, cache_dir: Path | None = None) -> Path:
    return keyed_path(PROBE_DIR, key, cache_dir)


def read_cached(key: dict, cache_dir: Path | None = None, *, code: str | None = None,
                cpuinfo: str | None = None) -> dict | None:
    """The probe record cached for `key` (with "cache_file": where it was read), or None: none yet (silently), a bad
    file (with a warning naming it and why), or, with `code` (the probe code's version), a record measured elsewhere,
    by other code or loaded (one line says why); the caller measures again and overwrites it."""
    return read_keyed(PROBE_DIR, key, "probe", check_probe, "decode dtype probe cache", log, cache_dir, code=code,
                      cpuinfo=cpuinfo)


def write_cached(key: dict, probe: dict, cache_dir: Path | None = None, *, code: str | None = None,
                 cpuinfo: str | None = None) -> Path:
    """Keep `probe` for `key` with its provenance (`code`: the probe code's version; the load: the probe record's
    own, taken around its timing), atomically (a reader never sees half a file)."""
    prov = provenance(code, probe.get("load"), cpuinfo) if code is not None else None
    return write_keyed(PROBE_DIR, key, "probe", probe, cache_dir, prov=prov)
