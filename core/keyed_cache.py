"""One JSON file per key under the user cache ($SPECDRAFT_CACHE, else ~/.cache/specdraft): where a measurement that
should run once per machine keeps its result (the decode-dtype probe, core/dtype_probe_cache.py; the untuned-shape
probe, eval/tune/untuned_probe.py).

<subdir>/<16 hex chars of sha256 over the key's JSON>.json holds {"key": key, field: record, ...}. The key is what
the measurement depends on, so a change in any part of it names another file. A file that does not parse, holds
another key or a record the caller's `check` refuses is reported in a warning naming it and measured again, never
trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from core.atomic import write_json_atomic
from core.paths import default_cache_dir


def keyed_path(subdir: str, key: dict, cache_dir: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / subdir / f"{digest}.json"


def read_keyed(subdir: str, key: dict, field: str, check: Callable[[object], str | None], what: str,
               log: logging.Logger, cache_dir: Path | None = None) -> dict | None:
    """The record kept for `key` under `field` (with "cache_file": where it was read), or None: none yet (silently),
    or a bad file (a warning that names `what`, the file and why; the caller measures again and overwrites it).
    check(record) -> None when usable, else what is wrong with it."""
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
    return {**data[field], "cache_file": str(path)}


def write_keyed(subdir: str, key: dict, field: str, record: dict, cache_dir: Path | None = None,
                **extra) -> Path:
    """Keep `record` (less its "cache_file") for `key` under `field`, with `extra` top-level entries, atomically (a
    reader never sees half a file)."""
    path = keyed_path(subdir, key, cache_dir)
    write_json_atomic(path, {"key": key, field: {k: v for k, v in record.items() if k != "cache_file"}, **extra})
    return path
