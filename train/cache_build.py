"""`specdraft cache`: build the hidden-state cache of a training config's train rows, on 1 or N ranks.

    specdraft cache --config configs/medusa.yaml --config configs/cpu_budget.yaml            # 1 process
    deepspeed --num_gpus 8 launch/build_cache.py --config ... [base.partition=zero3]          # N ranks

It is exactly the cache `specdraft train` with the same config would build or open (same rows, key and
directory: data.hidden_cache, "auto" when unset), so a later `specdraft train` on any world size reads
it without running the base. Each rank builds its own shards (data/hidden_cache.py RankGroup); a killed
build resumes where each rank stopped; with base.partition=zero3 the base is partitioned over the ranks.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from train.config import TrainConfig
from train.distributed import barrier, init_distributed


def build_cache(cfg: TrainConfig) -> Path:
    """Build (or find) the cache; returns its directory on every rank. Collective under a launcher."""
    from train.loop import _setup_logging
    from train.run_inputs import load_base_and_data, open_hidden_cache, threads_and_precision

    if not cfg.data.hidden_cache:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, hidden_cache="auto"))
    info = init_distributed()
    _setup_logging(info)
    _, base_dtype = threads_and_precision(cfg, info)
    base, train_ds, _, _, _, partitioned = load_base_and_data(cfg, info, base_dtype)
    t0 = time.perf_counter()
    cache = open_hidden_cache(cfg, base, train_ds, info, partitioned)
    seconds = time.perf_counter() - t0
    if info.is_main:
        print(f"hidden-state cache ready: {cache.directory} ({len(cache)} rows, {cache.manifest['tokens']:,} tokens; "
              f"{seconds:.1f} s on {info.world_size} rank(s))", flush=True)
    barrier()
    return cache.directory
