"""ZeRO-3-partitioned frozen base vs the whole base, per rank (DESIGN.md §10):

    deepspeed --num_gpus 2 bench/partitioned_base.py --base smollm2 [--dtype fp32] [--rows 4] [--json out.json]

Every rank loads the base partitioned (train/partitioned_base.py) and prints
- the bytes of parameters it holds (its ZeRO-3 partitions) next to the whole base's bytes,
- its resident memory (VmRSS) before and after the partitioned load, and after the whole base is loaded too,
- the full lm_head / embedding copy it keeps for the losses,
then runs both on the same rows and prints max |h_partitioned - h_whole| (the acceptance tolerance: exactly 0
in fp32 on the same thread count is expected, since the gathered parameters are the same values).
On CPU ranks (DeepSpeed's CPU accelerator + gloo) the numbers hold for the memory split; time is not a GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import sys
import time

import torch


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc), after handing freed heap back to the OS (glibc
    malloc_trim), so it counts live memory rather than what a transient loading buffer left behind."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sample_rows(vocab: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """n rows of random token ids of different lengths (h parity needs no real text)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, 24 + 17 * i), generator=gen) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="smollm2")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--json", default="", help="rank 0 writes the numbers here")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args(argv)

    from models.base import last_hidden_and_logits, load_base, resolve_dtype
    from train.distributed import all_reduce_sum, barrier, init_distributed
    from train.partitioned_base import load_partitioned_base

    info = init_distributed()
    torch.set_num_threads(1)  # same kernels on every rank and in the whole-base reference
    dtype = resolve_dtype(args.dtype, info.device)
    if info.is_main:  # the smollm2 conversion (first use only) happens once, before the timed loads
        load_base(args.base, dtype=dtype)
    barrier()
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    pb = load_partitioned_base(args.base, dtype=dtype, device=info.device)
    load_s = time.perf_counter() - t0
    gc.collect()
    rss_part = rss_bytes()
    mem = pb.memory_report()

    rows = sample_rows(pb.base.vocab_size, args.rows)
    hs_part = []
    t0 = time.perf_counter()
    for ids in rows:
        hs_part.append(last_hidden_and_logits(pb.base.model, ids.to(info.device))[0].float().cpu())
    part_fwd_s = time.perf_counter() - t0

    whole = load_base(args.base, dtype=dtype, device=info.device)
    gc.collect()
    rss_whole = rss_bytes()
    t0 = time.perf_counter()
    max_diff = 0.0
    for ids, hp in zip(rows, hs_part):
        hw = last_hidden_and_logits(whole.model, ids.to(info.device))[0].float().cpu()
        max_diff = max(max_diff, float((hp - hw).abs().max()))
    whole_fwd_s = time.perf_counter() - t0
    head_equal = torch.equal(pb.lm_head_weight, whole.model.get_output_embeddings().weight)

    row = {"rank": info.rank, "world_size": info.world_size, "base": args.base, "dtype": args.dtype,
           "partition_MiB": mem["partition_bytes"] / 2**20, "full_base_MiB": mem["full_base_bytes"] / 2**20,
           "partition_fraction": mem["partition_bytes"] / mem["full_base_bytes"],
           "full_copy_MiB": mem["full_copy_bytes"] / 2**20,
           "rss_before_MiB": rss0 / 2**20, "rss_delta_partitioned_MiB": (rss_part - rss0) / 2**20,
           "rss_delta_whole_MiB": (rss_whole - rss_part) / 2**20,
           "max_abs_h_diff": max_diff, "lm_head_copy_equal": head_equal, "load_s": load_s,
           "partitioned_forward_s": part_fwd_s, "whole_forward_s": whole_fwd_s}
    print("rank {rank}/{world_size}: holds {partition_MiB:.1f} of {full_base_MiB:.1f} MiB of base parameters "
          "({partition_fraction:.3f}) + full lm_head/embedding copy {full_copy_MiB:.1f} MiB | RSS +{rss_delta_"
          "partitioned_MiB:.0f} MiB partitioned, +{rss_delta_whole_MiB:.0f} MiB for a whole copy | max |dh| "
          "{max_abs_h_diff:.3g} | lm_head copy equal: {lm_head_copy_equal} | forward {partitioned_forward_s:.2f} s "
          "partitioned vs {whole_forward_s:.2f} s whole".format(**row), flush=True)
    worst = all_reduce_sum(torch.tensor([max_diff], dtype=torch.float64))  # sum of per-rank max >= any one
    if info.is_main and args.json:
        with open(args.json, "w") as f:
            json.dump({**row, "sum_over_ranks_max_abs_h_diff": float(worst)}, f, indent=1)
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
