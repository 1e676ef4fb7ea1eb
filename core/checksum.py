"""Checksums of files we write and read back (exports, hidden-state cache shards)."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 4 MiB blocks (~1 GB/s on one core)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
