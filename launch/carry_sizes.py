"""What each carried piece of the GPU kit weighs, recorded when it is built (docs/howto/gpu_kit.md).

The pieces a GPU call carries (`.whl/`, `.gpudata/meta`, `.gpudata/gguf0`, ...) are git-ignored and built here by
`make gpu-bundle` and `make gpu-data`; both write the bytes of what they built into launch/gpu_carry_sizes.json
(tracked). So a clone that never built them still knows each call's size: tests/test_gpu_carry.py adds the tree
as the device tool counts it to these records and fails a call over the limit less its margin, and
`make gpu-dry` (launch/gpu_rehearse.py) checks the pieces on disk and says when a record is stale.

    python launch/carry_sizes.py record .whl                     # launch/gpu_bundle.sh runs this
    python launch/carry_sizes.py record .gpudata/meta .gpudata/gguf0
    python launch/carry_sizes.py show
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = ROOT / "launch" / "gpu_carry_sizes.json"
ABOUT = ("Bytes of each git-ignored piece a GPU call carries, written by `make gpu-bundle` / `make gpu-data` "
         "(launch/carry_sizes.py) when they build it, so tests/test_gpu_carry.py can size every call of "
         "launch/gpu_calls.json on a clone that never built them. Commit it after rebuilding a piece.")


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (what the device tool carries)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def load(path: Path = SIZES) -> dict[str, int]:
    """{carried path: bytes} as recorded (empty when nothing was)."""
    path = Path(path)
    return {k: int(v) for k, v in json.loads(path.read_text())["bytes"].items()} if path.is_file() else {}


def record(rels: list[str], *, repo: Path = ROOT, path: Path = SIZES) -> dict[str, int]:
    """Measure each of `rels` (paths relative to `repo`, which must exist) and write their bytes into `path`,
    keeping the other records. Returns what it measured."""
    measured = {}
    for rel in rels:
        rel = rel.rstrip("/")
        if not (Path(repo) / rel).exists():
            raise FileNotFoundError(f"carry_sizes: {rel} is not in {repo}: build it first")
        measured[rel] = size_of(Path(repo) / rel)
    sizes = {**load(path), **measured}
    text = json.dumps({"about": ABOUT, "bytes": dict(sorted(sizes.items()))}, indent=1) + "\n"
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return measured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="measure these carried paths and record their bytes")
    rec.add_argument("paths", nargs="+")
    sub.add_parser("show", help="the recorded sizes")
    args = p.parse_args(argv)
    if args.cmd == "record":
        for rel, n in record(args.paths).items():
            print(f"carry_sizes: {rel}: {n / 2**20:.2f} MiB recorded in {SIZES.relative_to(ROOT)}")
    else:
        for rel, n in load().items():
            print(f"{n / 2**20:8.2f} MiB  {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
