"""Hidden-state cache built by 1 rank vs 2 ranks (whole base) vs 2 ranks (ZeRO-3-partitioned base):

    python bench/multirank_cache.py [--records 64] [--max-length 256] [--shard-rows 8] [--out /tmp/mrc]

Runs `specdraft cache` (1 rank, 1 thread: one device's share) and `deepspeed --num_gpus 2
launch/build_cache.py` (2 CPU ranks, 1 thread each) on the same config (real SmolLM2 in fp32, fp32 cache,
so files can be compared byte for byte), then prints the wall time of each build (from its own report
line: base forward + writes, without start-up) and whether every file equals the 1-rank build's.
On a shared 2-core CPU the 2-rank time is only indicative: the ranks compete with each other and with
anything else running. <out>/report.json (bench/harness.py: Results) holds each build's row as it finishes: the
build's own seconds and the command's wall time (time_once: start-up included).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, time_once  # noqa: E402


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def seconds(log: str) -> float:
    m = re.search(r"hidden-state cache ready: .*?; ([0-9.]+) s on", log)
    return float(m.group(1)) if m else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--shard-rows", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--out", default="/tmp/specdraft-multirank-cache")
    p.add_argument("--port", type=int, default=29681)
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    common = ["--config", "configs/medusa.yaml", "base.path=smollm2", "train.precision=fp32", "base.dtype=fp32",
              f"data.max_records={args.records}", f"data.max_length={args.max_length}",
              "data.hidden_cache_dtype=fp32", f"data.hidden_cache_shard_rows={args.shard_rows}",
              f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={2 * args.micro_batch}",
              "wandb.enabled=false"]
    bin_dir = Path(sys.executable).parent
    builds = {"1 rank (1 thread)": ("one", None), "2 ranks, whole base": ("two", []),
              "2 ranks, ZeRO-3 base": ("two-zero3", ["base.partition=zero3"])}
    results = Results(out / "report.json", {"builds": {}})
    for i, (label, (name, extra)) in enumerate(builds.items()):
        if extra is None:
            cmd = [str(bin_dir / "specdraft"), "cache", *common, f"data.hidden_cache={out / name}",
                   "train.num_threads=1"]
        else:
            cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(args.port + i - 1),
                   "launch/build_cache.py", *common, f"data.hidden_cache={out / name}", "train.num_threads=1", *extra]
        with results.arm("builds", label) as row:
            log, wall = time_once(lambda cmd=cmd: run(cmd))
            row.update(seconds=seconds(log), wall_seconds=round(wall, 1))
    ref = {f.name: f.read_bytes() for f in sorted((out / "one").iterdir())}
    manifest = json.loads((out / "one" / "manifest.json").read_text())
    for label, (name, _) in builds.items():
        files = {f.name: f.read_bytes() for f in sorted((out / name).iterdir())}
        row = results.data["builds"][label]
        row["byte_identical_to_1_rank"] = files == ref
        print(f"{label:<24} {row['seconds']:7.1f} s   files identical to the 1-rank build: {files == ref}")
    print(f"{manifest['rows']} rows, {manifest['tokens']:,} tokens, {manifest['shards']} shards")
    for key in ("rows", "tokens", "shards"):
        results.put(key, manifest[key])
    return 0


if __name__ == "__main__":
    sys.exit(main())
