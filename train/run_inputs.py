"""What a training run reads before its first step, on every rank: the threads and precision, the base and the
train / validation rows, the data source (the on-policy store checked against the base, or the self-distilled file),
the draft vocabulary and the hidden-state cache. train/loop.py runs the steps; train/cache_build.py builds the cache
alone (`specdraft cache`) through the same functions."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from core.malloc import keep_freed_memory
from core.paths import default_cache_dir
from data.dataset import build_datasets
from data.draft_vocab import build_draft_vocab
from data.hidden_cache import (
    HiddenCache,
    RankGroup,
    build_hidden_cache,
    cache_key,
    find_superset_cache,
    resolve_cache_dir,
)
from data.onpolicy_store import check_base, is_store, read_card
from data.packed import is_packed, load_packed
from data.self_distill import build_self_distilled
from models.base import HiddenStates, load_base
from models.registry import DRAFT_MODELS
from train.distributed import DistInfo, all_reduce_sum, barrier
from train.ds_config import resolve_precision

log = logging.getLogger("specdraft.train")


def epoch_tokens_of(train_ds) -> int:
    """Tokens of the train rows: a pack knows its row lengths; a `datasets` table has its list lengths counted by
    Arrow, batch by batch (all of ShareGPT as Python lists would take GBs)."""
    if hasattr(train_ds, "lengths"):
        return int(train_ds.lengths().sum())
    import pyarrow.compute as pc

    return sum(int(pc.sum(pc.list_value_length(batch["input_ids"])).as_py() or 0)
               for batch in train_ds.with_format("arrow").iter(batch_size=8192))


def threads_and_precision(cfg, info: DistInfo) -> tuple[str, str]:
    """Set this rank's torch threads and return (training precision, base dtype); shared by training and the
    cache build (train/cache_build.py)."""
    if info.device.type == "cpu":
        keep_freed_memory()  # LM-head-sized temporaries reuse their pages every step (core/malloc.py)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    elif info.device.type == "cpu" and info.world_size > 1:
        # N CPU ranks on one box: split the cores instead of oversubscribing them.
        torch.set_num_threads(max(1, (torch.get_num_threads() or 1) // info.world_size))
    precision = resolve_precision(cfg.train.precision, info.device)
    return precision, precision if cfg.base.dtype == "auto" else cfg.base.dtype


def load_base_and_data(cfg, info: DistInfo, base_dtype) -> tuple:
    """(base, train_ds, val_ds, source, max_records, partitioned) on every rank.

    Whole base (base.partition=none): rank 0 goes first, since it may have to convert the GGUF or tokenize
    the data into the shared cache, then the others load the ready files. Partitioned (zero3): the load is
    collective (every rank builds its partitions together), then rank 0 tokenizes first. `partitioned` is
    the train.partitioned_base.PartitionedBase, or None.
    """
    partitioned = None
    if cfg.base.partition == "zero3":
        from train.partitioned_base import load_partitioned_base

        partitioned = load_partitioned_base(cfg.base.path, dtype=base_dtype, device=info.device,
                                            chat_template=cfg.data.chat_template or None)
    for turn in (0, 1):
        if (turn == 0) == info.is_main:
            base = partitioned.base if partitioned else load_base(cfg.base.path, dtype=base_dtype, device=info.device,
                                                                  chat_template=cfg.data.chat_template or None)
            d = cfg.data
            source, max_records = training_source(cfg, base)
            if is_packed(source):  # pre-tokenized rows (launch/pack_data.py): no `datasets`, no rendering
                train_ds, val_ds = load_packed(source, base.tokenizer, max_length=d.max_length,
                                               val_fraction=d.val_fraction, seed=d.seed,
                                               min_assistant_tokens=d.min_assistant_tokens)
            else:
                train_ds, val_ds = build_datasets(
                    base.tokenizer, source, max_records=max_records, max_length=d.max_length,
                    val_fraction=d.val_fraction, seed=d.seed, cache_dir=d.cache_dir or default_cache_dir() / "data",
                    min_assistant_tokens=d.min_assistant_tokens, num_proc=d.num_proc)
        barrier()
    return base, train_ds, val_ds, source, max_records, partitioned


def training_source(cfg, base) -> tuple[str, int | None]:
    """(source, max_records) build_datasets reads: with data.self_distill, the cached file of the base's own
    answers to the first data.max_records conversations (built once, resumable; docs/concepts.md#on-policy-data)."""
    d = cfg.data
    if is_store(d.source):  # a lasting on-policy dataset (data/onpolicy_store.py): the answers of THIS base only
        check_base(read_card(d.source), base.fingerprint, f"data.source={d.source}")
    if not d.self_distill:
        return d.source, d.max_records
    path = build_self_distilled(base, d.source, max_records=d.max_records, max_new_tokens=d.self_distill_max_new_tokens,
                                temperature=d.self_distill_temperature, seed=d.seed, cache_dir=d.cache_dir or None)
    return str(path), None


def draft_vocab(cfg, base, train_ds, vocab: int) -> torch.Tensor | None:
    """d2t [N] of draft.vocab_size > 0 (None = the full vocabulary), built from the train rows' assistant
    targets and cached under <cache>/draft_vocab/ (data/draft_vocab.py). vocab = the base's V (from the
    BaseView: a ZeRO-3 partitioned lm_head has no rows locally)."""
    n = cfg.draft.vocab_size
    if n == 0:
        return None
    if n > vocab:
        raise ValueError(f"draft.vocab_size={n} exceeds this base's vocabulary of {vocab} tokens; use 0 (the full "
                         f"vocabulary) or 1..{vocab}")
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    d2t, hit = build_draft_vocab(train_ds, n, vocab, base_fingerprint=base.fingerprint, cache_dir=root / "draft_vocab")
    log.info("draft vocabulary of %d tokens %s", n, "read from the cache" if hit else "built from the train targets")
    return d2t


def open_hidden_cache(cfg, base, train_ds, info, partitioned=None) -> HiddenCache:
    """Build (every rank its shards; resumable) or open the hidden-state cache of this run's train rows
    (docs/concepts.md#hidden-state-cache, docs/howto/large_bases.md). Collective: every rank calls it."""
    aux_layers = resolve_aux_layers(cfg, base.model)
    key = cache_key(base.fingerprint, base.model.dtype, train_ds, cfg.data.hidden_cache_dtype, aux_layers)
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    directory = resolve_cache_dir(cfg.data.hidden_cache, root, key)
    if not aux_layers and cfg.data.hidden_cache == "auto" and not (directory / "manifest.json").is_file():
        superset = find_superset_cache(root, train_ds, base_fingerprint=base.fingerprint,
                                       base_dtype=base.model.dtype, cache_dtype=cfg.data.hidden_cache_dtype)
        if superset is not None:  # an EAGLE-3 cache of these rows: its h is this cache, the aux is skipped
            log.info("training from the hidden-state cache %s (built with aux layers for EAGLE-3; same rows, "
                     "base and dtype; only h is read)", superset)
            return HiddenCache(superset, read_aux=False, verify=cfg.data.hidden_cache_verify)
    pad_id = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else 0
    ranks = RankGroup(info.rank, info.world_size, barrier, all_reduce_sum, collective_forward=partitioned is not None)
    build_hidden_cache(HiddenStates(base.model), train_ds, directory, pad_id=pad_id, device=info.device,
                       micro_batch_size=cfg.train.micro_batch_size, cache_dtype=cfg.data.hidden_cache_dtype,
                       shard_rows=cfg.data.hidden_cache_shard_rows,
                       info={"key": key, "base": base.name, "base_fingerprint": base.fingerprint,
                             "base_dtype": str(base.model.dtype)}, aux_layers=aux_layers, ranks=ranks,
                       verify=cfg.data.hidden_cache_verify)
    cache = HiddenCache(directory)
    if cache.manifest.get("key") != key or len(cache) != len(train_ds):
        raise ValueError(f"hidden-state cache {directory} does not match this run's train set or base (key "
                         f"{cache.manifest.get('key')} vs {key}); delete it or use data.hidden_cache=auto")
    log.info("training from the hidden-state cache %s (%d rows, base forward skipped)", directory, len(cache))
    return cache


def resolve_aux_layers(cfg, model) -> list[int]:
    """Base layers the configured family reads besides h (EAGLE-3: draft.aux_layers or its default); [] else."""
    resolve = getattr(DRAFT_MODELS[cfg.draft.family], "resolve_aux_layers", None)
    return resolve(cfg.draft, model) if resolve is not None else []
