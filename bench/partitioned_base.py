"""ZeRO-3-partitioned frozen base vs the whole base, per rank (docs/howto/large_bases.md):

    deepspeed --num_gpus 2 bench/partitioned_base.py --base smollm2 [--dtype fp32] [--rows 4] [--json out.json]
    deepspeed --num_gpus 2 bench/partitioned_base.py --base smollm2 --mode partitioned   # clean RSS, one kind
    deepspeed --num_gpus 2 bench/partitioned_base.py --base smollm2 --mode whole

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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, Stopwatch, clock_sync  # noqa: E402


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


def rss_parts() -> dict[str, float]:
    """MiB of the RSS by kind: anonymous (heap: parameters, buffers), file-backed (mmapped checkpoint pages),
    shared memory (the CPU accelerator's shm collectives buffers: a CPU-rank cost, not a GPU one)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    return out


def sample_rows(vocab: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """n rows of random token ids of different lengths (h parity needs no real text)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, 24 + 17 * i), generator=gen) for i in range(n)]


def whole_vocab(path: str) -> int:
    """The base's vocabulary size from its config (no weights loaded)."""
    from models.smollm2_gguf import SMOLLM2_EXPECTED
    from models.tiny import TINY_VOCAB_SIZE

    if path in ("tiny", "smollm2"):
        return TINY_VOCAB_SIZE if path == "tiny" else int(SMOLLM2_EXPECTED["vocab_size"])
    return _hf_vocab(path)


def _hf_vocab(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path, local_files_only=True).vocab_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="smollm2")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--json", default="", help="rank 0 writes the numbers here")
    p.add_argument("--mode", default="both", choices=["both", "partitioned", "whole"],
                   help="both: parity check; partitioned / whole alone: clean per-process RSS of one kind of base")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args(argv)

    from core.hardware import resolve_dtype
    from models.base import last_hidden_and_logits, load_base
    from train.distributed import all_reduce_sum, barrier, finish_distributed, init_distributed
    from train.partitioned_base import load_partitioned_base

    info = init_distributed()
    torch.set_num_threads(1)  # same kernels on every rank and in the whole-base reference
    dtype = resolve_dtype(args.dtype, info.device)
    if info.is_main:  # the smollm2 conversion (first use only) happens once, before the timed loads
        load_base(args.base, dtype=dtype)
    barrier()
    rss0 = rss_bytes()
    rss0_parts = rss_parts()
    rows = sample_rows(whole_vocab(args.base), args.rows)
    row = {"rank": info.rank, "world_size": info.world_size, "base": args.base, "dtype": args.dtype,
           "mode": args.mode, "rss_before_MiB": rss0 / 2**20,
           "rss_parts_before_MiB": rss0_parts}
    # rank 0's numbers, on disk after each kind of base (partitioned, then whole): a killed run keeps the first
    results = Results(args.json if info.is_main and args.json else None, row)
    sync = clock_sync(info.device)
    hs_part, max_diff = [], None
    if args.mode in ("both", "partitioned"):
        watch = Stopwatch(sync)
        pb = load_partitioned_base(args.base, dtype=dtype, device=info.device)
        row["load_s"] = watch.wall()
        mem = pb.memory_report()
        watch = Stopwatch(sync)
        for ids in rows:
            hs_part.append(last_hidden_and_logits(pb.base.model, ids.to(info.device))[0].float().cpu())
        row["partitioned_forward_s"] = watch.wall()
        row["gathered_after_forwards_MiB"] = pb.memory_report()["gathered_bytes"] / 2**20
        rss_part = rss_bytes()  # after the forwards: includes what the layer-by-layer gathers leave resident
        row["rss_parts_partitioned_MiB"] = rss_parts()
        row.update(partition_MiB=mem["partition_bytes"] / 2**20, full_base_MiB=mem["full_base_bytes"] / 2**20,
                   partition_fraction=mem["partition_bytes"] / mem["full_base_bytes"],
                   full_copy_MiB=mem["full_copy_bytes"] / 2**20, rss_delta_partitioned_MiB=(rss_part - rss0) / 2**20)
        print("rank {rank}/{world_size}: holds {partition_MiB:.1f} of {full_base_MiB:.1f} MiB of base parameters "
              "({partition_fraction:.3f}) + full lm_head/embedding copy {full_copy_MiB:.1f} MiB | RSS +{rss_delta_"
              "partitioned_MiB:.0f} MiB after load + {n} forwards ({partitioned_forward_s:.2f} s); RSS by kind before "
              "{rss_parts_before_MiB} after {rss_parts_partitioned_MiB}; still gathered after the forwards: "
              "{gathered_after_forwards_MiB:.1f} MiB".format(n=len(rows), **row), flush=True)
        results.save()
    if args.mode in ("both", "whole"):
        rss1 = rss_bytes()
        whole = load_base(args.base, dtype=dtype, device=info.device)
        watch = Stopwatch(sync)
        hs_whole = [last_hidden_and_logits(whole.model, ids.to(info.device))[0].float().cpu() for ids in rows]
        row["whole_forward_s"] = watch.wall()
        row["rss_delta_whole_MiB"] = (rss_bytes() - rss1) / 2**20
        row["rss_parts_whole_MiB"] = rss_parts()
        print("rank {rank}/{world_size}: whole base RSS +{rss_delta_whole_MiB:.0f} MiB after load + {n} forwards "
              "({whole_forward_s:.2f} s)".format(n=len(rows), **row), flush=True)
        if hs_part:
            max_diff = max(float((hp - hw).abs().max()) for hp, hw in zip(hs_part, hs_whole))
            row["max_abs_h_diff"] = max_diff
            row["lm_head_copy_equal"] = torch.equal(pb.lm_head_weight, whole.model.get_output_embeddings().weight)
            print(f"rank {info.rank}: max |h_partitioned - h_whole| = {max_diff:.3g}; lm_head copy equal: "
                  f"{row['lm_head_copy_equal']}", flush=True)
        results.save()
    worst = all_reduce_sum(torch.tensor([max_diff or 0.0], dtype=torch.float64))  # sum of per-rank max >= any
    results.put("sum_over_ranks_max_abs_h_diff", float(worst))
    finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
