"""One JSON file per key under the user cache ($SPECDRAFT_CACHE, else ~/.cache/specdraft): where a measurement that
should run once per machine keeps its result (the decode-dtype probe, core/dtype_probe_cache.py; the untuned-shape
probe, eval/tune/untuned_probe.py).

<subdir>/<16 hex chars of sha256 over the key's JSON>.json holds {"key": key, field: record, "provenance": ...}.
The key is what the measurement depends on, so a change in any part of it names another file. A file that does not
parse, holds another key or a record the caller's `check` refuses is reported in a warning naming it and measured
again, never trusted.

Where, when and by what a record was measured (`provenance`): the host name, the CPU (model, the flags that decide
which kernels run: AVX2, AVX-512, AVX512-BF16, AMX, ...; and a digest over every flag), the code version (a digest
of the measuring modules' source: `code_version`, which changes with the code that measured, unlike the package
version), the load average at the start and the end of the measurement, and the date. A caller that passes `code`
to `read_keyed` gets a record back only where it was measured on this host and CPU, by this code, on a quiet
machine (1-minute load at most the core count at both ends); otherwise one line says why and the caller measures
again (`stale`). A shared cache directory (one home on several machines) thus never hands one machine's timing to
another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from core.atomic import write_json_atomic
from core.hardware import cpu_model, cpuinfo_text
from core.load import LoadWatch
from core.paths import default_cache_dir

# The CPU flags that decide which matmul kernels torch, oneDNN and llama.cpp run: a record lists those it saw.
KERNEL_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags(cpuinfo: str) -> list[str]:
    """Every flag of /proc/cpuinfo's "flags" lines, sorted ([] where there is none)."""
    return sorted({f for line in cpuinfo.splitlines() if line.lower().startswith("flags")
                   for f in line.split(":", 1)[1].split()})


def host_identity(cpuinfo: str | None = None) -> dict:
    """{"host": the host name, "cpu": the model name, "cpu_flags": the KERNEL_FLAGS it has, "cpu_digest": 16 hex
    chars of sha256 over the model and every flag} (the CPU fields empty where there is no /proc/cpuinfo)."""
    if cpuinfo is None:
        cpuinfo = cpuinfo_text()
    model, flags = cpu_model(cpuinfo), cpu_flags(cpuinfo)
    digest = hashlib.sha256(" ".join([model, *flags]).encode()).hexdigest()[:16] if (model or flags) else ""
    return {"host": socket.gethostname(), "cpu": model, "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
            "cpu_digest": digest}


def code_version(files: Iterable[str | Path]) -> str:
    """16 hex chars of sha256 over the source of the modules that measure (their file names and bytes): another
    version of any of them measures again. A file that is missing counts as its name alone."""
    h = hashlib.sha256()
    for f in sorted(Path(x) for x in files):
        h.update(f.name.encode())
        try:
            h.update(f.read_bytes())
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()[:16]


def provenance(code: str, load: dict | None = None, cpuinfo: str | None = None) -> dict:
    """Where, when and by what a record was measured: host_identity, `code` (code_version of the measuring modules),
    `load` (core/load.py: LoadWatch.record() around the measurement; else the load now) and the UTC date."""
    return {**host_identity(cpuinfo), "code": code, "load": load if load is not None else LoadWatch().record(),
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def stale(prov: object, code: str, cpuinfo: str | None = None) -> str | None:
    """Why a record measured under `prov` must be measured again here, by code `code`; None when it holds: same
    host, same CPU (model and flags), same code, and not taken loaded."""
    if not isinstance(prov, dict):
        return "it records no host, code version or load (written by an older specdraft)"
    here = host_identity(cpuinfo)
    if prov.get("host") != here["host"]:
        return f"it was measured on host {prov.get('host')!r}, this is {here['host']!r}"
    if prov.get("cpu_digest") != here["cpu_digest"]:
        return (f"it was measured on another CPU ({prov.get('cpu') or '?'}, {' '.join(prov.get('cpu_flags') or [])}"
                f"), this is {here['cpu'] or '?'} ({' '.join(here['cpu_flags'])})")
    if prov.get("code") != code:
        return f"it was measured by other code (version {prov.get('code')}, this is {code})"
    load = prov.get("load") or {}
    if load.get("loaded"):
        peak = max((x[0] for x in (load.get("start"), load.get("end")) if x), default="?")
        return f"it was measured loaded (1-minute load {peak} on {load.get('cores')} cores)"
    return None


def keyed_path(subdir: str, key: dict, cache_dir: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / subdir / f"{digest}.json"


def read_keyed(subdir: str, key: dict, field: str, check: Callable[[object], str | None], what: str,
               log: logging.Logger, cache_dir: Path | None = None, *, code: str | None = None,
               cpuinfo: str | None = None) -> dict | None:
    """The record kept for `key` under `field` (with "cache_file": where it was read, and "provenance"), or None:
    none yet (silently), a bad file (a warning that names `what`, the file and why), or, where `code` is given, a
    record that `stale` refuses (one line says why); the caller measures again and overwrites it. check(record) ->
    None when usable, else what is wrong with it. cpuinfo: /proc/cpuinfo's text (tests pass another CPU's)."""
    path = keyed_path(subdir, key, cache_dir)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s %s is unreadable (%s); probing again", what, path, exc)
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        log.warning("%s %s was written for another key; probing again", what, path)
        return None
    bad = check(data.get(field))
    if bad:
        log.warning("%s %s holds an unusable record (%s); probing again", what, path, bad)
        return None
    if code is not None:
        why = stale(data.get("provenance"), code, cpuinfo)
        if why:
            log.info("%s %s not reused: %s; measuring again", what, path, why)
            return None
    return {**data[field], "cache_file": str(path), "provenance": data.get("provenance")}


def write_keyed(subdir: str, key: dict, field: str, record: dict, cache_dir: Path | None = None, *,
                prov: dict | None = None, **extra) -> Path:
    """Keep `record` (less its "cache_file" and "provenance") for `key` under `field`, with `prov` (`provenance`:
    where, when and by what it was measured) and `extra` top-level entries, atomically (a reader never sees half a
    file)."""
    path = keyed_path(subdir, key, cache_dir)
    kept = {k: v for k, v in record.items() if k not in ("cache_file", "provenance")}
    write_json_atomic(path, {"key": key, field: kept, **({"provenance": prov} if prov is not None else {}), **extra})
    return path
