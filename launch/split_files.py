"""Split a file into parts under a size limit, and join them back with a checksum (the device tool moves
at most 64 MiB per call there and 16 MiB per returned file; docs/howto/gpu_kit.md).

    python launch/split_files.py split FILE --max-mib 16 --out DIR        # DIR/<name>.part000 ... + <name>.split.json
    python launch/split_files.py split FILE --parts 2 --out DIR0 DIR1     # one part per directory (one per call)
    python launch/split_files.py join DIR [DIR ...] --out FILE             # checks size and sha256, atomic

Each part directory gets a copy of `<name>.split.json` (name, size, sha256, part names), so any one of
them describes the whole; `join` refuses a missing, extra or corrupted part.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.file_parts import join, split


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("file", type=Path)
    s.add_argument("--out", type=Path, nargs="+", required=True)
    s.add_argument("--max-mib", type=float)
    s.add_argument("--parts", type=int)
    j = sub.add_parser("join")
    j.add_argument("dirs", type=Path, nargs="+")
    j.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "split":
        max_bytes = int(args.max_mib * 2**20) if args.max_mib else None
        index = split(args.file, args.out, max_bytes=max_bytes, parts=args.parts)
        print(f"split {args.file} ({index['size'] / 2**20:.1f} MiB) into {len(index['parts'])} part(s) of <= "
              f"{index['part_bytes'] / 2**20:.1f} MiB under {', '.join(map(str, args.out))}")
    else:
        out = join(args.dirs, args.out)
        print(f"joined {out} ({out.stat().st_size / 2**20:.1f} MiB, sha256 checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
