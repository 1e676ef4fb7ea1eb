"""Training throughput per draft family with DeepSpeed on one GPU (bf16; ZeRO 0 and 2): one short
`specdraft train` run per (family, stage) in its own process, tokens/s read from its metrics.jsonl (the mean
of the log windows after the first, which holds start-up and the first CUDA kernels). Writes one JSON.

    python bench/gpu_train.py --base /tmp/smollm2-random --data .gpudata/sharegpt --out OUT/train.json
    python bench/gpu_train.py --base tiny --data tests/fixtures/sharegpt_tiny.json --steps 4 --log-every 2 \\
        --set train.precision=fp32 --out /tmp/train.json                  # CPU dry run

The base runs online (data.hidden_cache=""): the numbers include the frozen base's forward, as a first epoch
does. Extra `--set key=value` overrides go to every run (e.g. train.micro_batch_size=8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from bench.harness import Results, time_once  # noqa: E402
from train.config import family_recipes  # noqa: E402

RECIPES = family_recipes()  # every configs/*.yaml that names a draft family


def run_one(family: str, zero: int, args, run_dir: Path) -> dict:
    overrides = [f"run_dir={run_dir}", f"base.path={args.base}", f"data.source={args.data}", "data.hidden_cache=",
                 f"deepspeed.zero_stage={zero}", f"train.max_steps={args.steps}", f"train.log_every={args.log_every}",
                 "train.val_batches=0", "train.save_every=0", "wandb.enabled=false", "train.precision=bf16",
                 *args.set]
    cmd = [sys.executable, "-m", "cli.main", "train", "--config", RECIPES[family], *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc, wall = time_once(lambda: subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                                                  capture_output=True, text=True, timeout=args.timeout))
    (run_dir.parent / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
    row = {"family": family, "zero_stage": zero, "returncode": proc.returncode, "wall_s": round(wall, 1)}
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        row["error"] = (proc.stdout + proc.stderr)[-1500:]
        return row
    windows = [json.loads(ln) for ln in metrics.read_text().splitlines() if '"tokens_per_s"' in ln]
    timed = windows[1:] or windows
    row.update(tokens_per_s=sum(w["tokens_per_s"] for w in timed) / len(timed), windows=len(windows),
               last_loss=windows[-1]["loss"], top1_head1=windows[-1].get("top1/head1"))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="base.path: smollm2, an HF dir (models/random_base.py), tiny")
    p.add_argument("--data", required=True, help="data.source: a pack (launch/pack_data.py) or ShareGPT json")
    p.add_argument("--families", default=",".join(RECIPES))
    p.add_argument("--zero", default="0,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--runs", default="/tmp/specdraft-gpu-train", help="where the runs go")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    out = {"base": args.base, "data": args.data, "steps": args.steps, "overrides": args.set, "runs": rows}
    try:
        import torch

        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 (a report field only)
        pass
    results = Results(args.out, out)
    for family in args.families.split(","):
        for zero in (int(z) for z in args.zero.split(",")):
            row = run_one(family, zero, args, Path(args.runs) / f"{family}-zero{zero}")
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "error"}) +
                  (f"\n  FAILED: {row['error'][-600:]}" if "error" in row else ""), flush=True)
            # Written after every run: a caller's deadline that cuts the bench keeps the rows measured so far.
            results.save()
    print(f"{'family':>10} {'ZeRO':>4} {'tokens/s':>10} {'wall s':>7}")
    for r in rows:
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "FAILED"
        print(f"{r['family']:>10} {r['zero_stage']:>4} {tps:>10} {r['wall_s']:>7}")
    sys.exit(1 if any(r["returncode"] for r in rows) else 0)


if __name__ == "__main__":
    main()
