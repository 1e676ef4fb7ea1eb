"""Sequence parallelism's memory and speed: peak resident memory per rank and tokens/s of one EAGLE-3 training step
on one conversation of L tokens, on 1 rank (no sequence parallelism) and on N ranks (train.sequence_parallel = N;
CPU ranks over gloo, one thread each).

    python bench/sequence_parallel.py --lengths 256,1024,2048,4096 --ranks 1,3 --out runs/bench-sp/bench.json
    python bench/sequence_parallel.py --base tiny-even --lengths 256,1024 --ranks 1,2      # an even-head shape

A step = what `specdraft train` runs per micro-batch when training online (`data.hidden_cache=""`): the frozen
base's forward with EAGLE-3's aux layers (sharded: each rank its L/N tokens, Ulysses attention), the draft's loss
(fc, TTT x3 through its decoder layer with the sequence-wide attention all-to-all'd, the chunked LM head) and its
backward; no optimizer (its cost does not depend on L). `--cached` gives the draft its inputs as the hidden-state
cache would (whole rows, each rank keeping its slice): the draft's share alone.

Memory: each rank's peak resident set (VmHWM) during the timed steps, and its rise above what the rank held before
them (the base, the draft, the inputs): `peak_mib` / `step_mib`. What 1/N of a sequence saves shows in `step_mib`;
the resident base each rank keeps whole (no ZeRO-3 here) in `peak_mib`. Speed: the slowest rank's median step,
tokens/s = L / that. Ranks share this machine's cores: with N ranks on fewer cores than N the speed column is a
lower bound, and the memory columns are what the table is for there.

Bases: `smollm2` (the real SmolLM2-135M: 9 heads, 3 KV heads, so N = 3 or 9; 30 layers, aux layers [2, 15, 27]);
`tiny-even` (a random LLaMA of SmolLM2's width, 8 heads and 2 KV heads, 4 layers: N = 2 divides it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results  # noqa: E402


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _base(name: str, dtype):
    """(LoadedBase-like model, aux layers) of the named base."""
    from models.base import load_base
    from models.tiny import tiny_llama

    if name == "smollm2":
        return load_base("smollm2", dtype=dtype).model.eval(), [2, 15, 27]
    model = tiny_llama(0, hidden_size=576, num_heads=8, num_kv_heads=2, num_layers=4, vocab_size=49152,
                       max_positions=8192)
    return model.to(dtype).eval(), [0, 2, 3]


def worker(a) -> None:
    """One rank: build, warm up, time --steps steps, and (rank 0) append the row to --row-out."""
    import torch
    import torch.distributed as dist

    from models.base import draft_inputs
    from models.draft import BaseView, DraftBatch
    from models.registry import DRAFT_MODELS
    from train.config import load_train_config
    from train.distributed import init_distributed
    from train.sequence_parallel import SequenceParallel

    torch.set_num_threads(1)
    info = init_distributed()
    dtype = getattr(torch, a.dtype)
    base, aux_layers = _base(a.base, dtype)
    view = BaseView.from_model(base)
    layers = ",".join(str(x) for x in aux_layers)
    cfg = load_train_config(["configs/eagle3.yaml"], ["draft.share_lm_head=false", "draft.vocab_size=16384",
                                                      f"draft.aux_layers=[{layers}]"])
    torch.manual_seed(0)
    view.draft_vocab = torch.randperm(view.vocab_size)[:cfg.draft.vocab_size]
    draft = DRAFT_MODELS["eagle3"].from_config(cfg.draft, view).to(dtype).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, view.vocab_size, (1, a.length), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.ones_like(ids)
    mask[:, :8] = 0  # a short prompt
    sp = SequenceParallel(info.world_size, info.rank, info.world_size) if info.world_size > 1 else None
    halo = cfg.draft.eagle3.ttt_steps + 1
    whole = draft_inputs(base, ids, attn, aux_layers) if a.cached else None

    def step() -> None:
        if sp is None:
            hidden, aux = whole if whole is not None else draft_inputs(base, ids, attn, aux_layers)
            batch = DraftBatch(hidden.to(dtype), ids, mask, aux.to(dtype))
        else:
            if whole is not None:
                part = sp.split(ids, attn, mask, 0, halo, hidden=whole[0], aux=whole[1])
            else:
                part = sp.split(ids, attn, mask, 0, halo, base=base, aux_layers=aux_layers, dtype=dtype)
            batch = DraftBatch(part.hidden, part.input_ids, part.loss_mask, part.aux, part.shard)
        draft.loss(batch, view, cfg.loss).loss.backward()
        draft.zero_grad(set_to_none=True)

    step()  # warm-up: first-call allocations, DeepSpeed's all-to-all set-up
    before = _rss_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    times = []
    for _ in range(a.steps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    mine = {"rank": info.rank, "median_s": statistics.median(times), "peak_mib": round(_rss_mib("VmHWM"), 1),
            "step_mib": round(_rss_mib("VmHWM") - before, 1)}
    ranks = [None] * info.world_size
    dist.all_gather_object(ranks, mine)
    if info.is_main:
        slowest = max(r["median_s"] for r in ranks)
        row = {"ranks": info.world_size, "length": a.length, "tokens_per_s": round(a.length / slowest, 1),
               "slowest_median_s": round(slowest, 3), "peak_mib_max": max(r["peak_mib"] for r in ranks),
               "step_mib_max": max(r["step_mib"] for r in ranks), "per_rank": ranks}
        Path(a.row_out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def launch(a, ranks: int, length: int, row_out: Path) -> dict:
    """`ranks` worker processes in one gloo group; the row rank 0 wrote."""
    from core.net import free_port

    port = str(free_port())
    args = [sys.executable, __file__, "--worker", "--base", a.base, "--dtype", a.dtype, "--steps", str(a.steps),
            "--length", str(length), "--row-out", str(row_out)] + (["--cached"] if a.cached else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WORLD_SIZE=str(ranks),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(ranks)]
    logs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(log[-2000:] for log in logs))
    return json.loads(row_out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", choices=("smollm2", "tiny-even"), default="smollm2")
    ap.add_argument("--lengths", default="256,1024,2048,4096", help="comma-separated sequence lengths")
    ap.add_argument("--ranks", default="1,3", help="comma-separated rank counts (1 = no sequence parallelism)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up)")
    ap.add_argument("--cached", action="store_true", help="the draft's inputs as the hidden-state cache gives them")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds a row may take")
    ap.add_argument("--out", default=None, help="results JSON (written after every row)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    import tempfile

    from core.load import LoadWatch

    results = Results(a.out, {"base": a.base, "dtype": a.dtype, "cached": a.cached, "steps": a.steps, "rows": {}})
    with tempfile.TemporaryDirectory() as tmp:
        for length in [int(x) for x in a.lengths.split(",")]:
            for ranks in [int(x) for x in a.ranks.split(",")]:
                with results.arm("rows", f"{length}x{ranks}", keep_going=True) as row:
                    watch = LoadWatch()
                    row.update(launch(a, ranks, length, Path(tmp) / "row.json"))
                    row["load"] = watch.record()
                    print(f"L={length:>5} ranks={ranks}: {row['tokens_per_s']:>8.1f} tok/s  peak "
                          f"{row['peak_mib_max']:>7.0f} MiB/rank  step +{row['step_mib_max']:>6.0f} MiB/rank  "
                          f"load {row['load']}", flush=True)
    return None


if __name__ == "__main__":
    main()
