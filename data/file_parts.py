"""Split a file into parts under a size limit, and join them back with a checksum. Why: the device tool
(docs/howto/gpu_kit.md) moves at most 64 MiB per call to the GPU machine and 16 MiB per returned file, so the
SmolLM2 GGUF (98 MB) goes there in two calls and a trained export comes back in parts.
CLI: launch/split_files.py. Each part directory gets a copy of `<name>.split.json` (name, size, sha256,
part names), so any one of them describes the whole; `join` refuses a missing or corrupted part.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from core.atomic import atomic_path

_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, out_dirs: list[Path], *, max_bytes: int | None = None, parts: int | None = None) -> dict:
    """Cut `path` into `parts` equal parts (or parts of at most `max_bytes`); part i goes to
    out_dirs[i % len(out_dirs)]. Returns the index written beside the parts."""
    size = path.stat().st_size
    if parts is None:
        if not max_bytes or max_bytes < 1:
            raise ValueError("split: give --parts N or --max-mib M")
        parts = max(1, math.ceil(size / max_bytes))
    per = math.ceil(size / parts) if size else 0
    names = [f"{path.name}.part{i:03d}" for i in range(parts)]
    index = {"name": path.name, "size": size, "sha256": _sha256(path), "parts": names, "part_bytes": per}
    with open(path, "rb") as src:
        for i, name in enumerate(names):
            d = out_dirs[i % len(out_dirs)]
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(src.read(per))
    for d in set(out_dirs):
        (d / f"{path.name}.split.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def join(dirs: list[Path], out: Path) -> Path:
    """Reassemble the file described by the `*.split.json` in `dirs` into `out`; verify size and sha256."""
    indexes = sorted({p for d in dirs for p in d.glob("*.split.json")})
    if not indexes:
        raise FileNotFoundError(f"join: no *.split.json in {[str(d) for d in dirs]}; carry the part directories "
                                "written by `split_files.py split`")
    index = json.loads(indexes[0].read_text())
    found = {name: d / name for d in dirs for name in index["parts"] if (d / name).is_file()}
    missing = [n for n in index["parts"] if n not in found]
    if missing:
        raise FileNotFoundError(f"join: parts {missing} of {index['name']} are missing from {[str(d) for d in dirs]};"
                                " carry every part directory (on the device tool: one call each while the machine "
                                "is warm)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:  # checked before it takes the final name; removed if it fails the check
        with open(tmp, "wb") as dst:
            for name in index["parts"]:
                with open(found[name], "rb") as src:
                    for block in iter(lambda: src.read(_CHUNK), b""):  # noqa: B023 (src is read in this iteration)
                        dst.write(block)
        if tmp.stat().st_size != index["size"] or _sha256(tmp) != index["sha256"]:
            raise ValueError(f"join: {index['name']} reassembled to a different size or sha256 than it was split "
                             "from; a part is corrupted or from another split: split the file again")
    return out
