"""The numbers behind cli/demo_plan.py's cost model, per dtype: the base's hidden-state forward speed by row length
(what the demo's probe and cache build run) and the demo head's training speed against it.

    python bench/demo_plan_costs.py            # one thread, CPU time: meaningful on a shared, loaded box
    python bench/demo_plan_costs.py --threads 2 --wall
    python bench/demo_plan_costs.py --lengths 256 --teacher-weight 0     # hard labels, against the soft loss

CPU seconds of one thread (`time.thread_time`, best of --repeats) are what a one-thread process would take alone,
whatever else runs; with --wall, wall seconds (an idle box only). Training = the demo's one Hydra head (configs/
hydra.yaml + configs/demo.yaml, 16k draft vocabulary): loss, backward and AdamW on [4, 256] rows of cached h,
without DeepSpeed. Prints `uptime` since the box is shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import time_fn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wall", action="store_true", help="wall time instead of the thread's CPU time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", default="128,256,384,512")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--teacher-weight", type=float, default=None,
                   help="the head's loss.teacher_weight (default: configs/demo.yaml's); 0 = hard labels only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not args.wall and args.threads != 1:
        p.error("CPU time counts the calling thread only: use --threads 1, or --wall on an idle box")
    clock = time.perf_counter if args.wall else time.thread_time

    from cli import CONFIGS
    from cli.demo import RECIPE
    from train.config import load_train_config

    extra = [] if args.teacher_weight is None else [f"loss.teacher_weight={args.teacher_weight}"]
    cfg = load_train_config([str(CONFIGS / RECIPE), str(CONFIGS / "demo.yaml")], extra)
    print(f"head trained with loss.teacher_weight={cfg.loss.teacher_weight}")
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"{'dtype':6} " + " ".join(f"fw{n:>5}" for n in lengths) + "   train  train/fw256")
    for dtype in args.dtypes.split(","):
        speeds, train = measure(dtype, lengths, cfg, clock, args.repeats)
        print(f"{dtype:6} " + " ".join(f"{v:7.0f}" for v in speeds.values())
              + f" {train:7.0f} {train / speeds.get(256, float('nan')):8.2f}", flush=True)
    print("uptime:", os.getloadavg())


def measure(dtype: str, lengths: list[int], cfg, clock, repeats: int) -> tuple[dict[int, float], float]:
    """({row length: forward tokens/s}, head training tokens/s) in `dtype`, best of `repeats` by `clock`."""
    from models.base import HiddenStates, load_base
    from models.draft import BaseView, DraftBatch
    from models.registry import DRAFT_MODELS

    def best(fn) -> float:  # warm-ups are the callers' own (a short row, a first step)
        return time_fn(fn, warmup=0, repeats=repeats, clock=clock).min

    base = load_base("smollm2", dtype=dtype)
    forward = HiddenStates(base.model)
    gen = torch.Generator().manual_seed(0)
    speeds = {}
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, base.vocab_size, (4, n), generator=gen)
            forward(ids[:, :16], torch.ones_like(ids[:, :16]))  # warm-up: kernel choice
            speeds[n] = 4 * n / best(lambda ids=ids: forward(ids, torch.ones_like(ids)))
    view = BaseView.from_model(base.model)
    view.draft_vocab = torch.arange(cfg.draft.vocab_size)  # the cost of a 16k-row head, not which rows
    torch.manual_seed(0)
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    draft = DRAFT_MODELS[cfg.draft.family].from_config(cfg.draft, view).to(compute)
    opt = torch.optim.AdamW([q for q in draft.parameters() if q.requires_grad], lr=1e-3)
    ids = torch.randint(0, base.vocab_size, (4, 256), generator=gen)
    with torch.no_grad():
        h = forward(ids, torch.ones_like(ids))[0].to(compute)

    def step():
        out = draft.loss(DraftBatch(h, ids, torch.ones_like(ids)), view, cfg.loss)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    return speeds, 4 * 256 / best(step)


if __name__ == "__main__":
    main()
