"""Tokenized train/val datasets (HF `datasets`) with assistant-only loss masks, cached on disk.

Pipeline: read_sharegpt -> `Dataset.map(render_with_assistant_mask)` written to an explicit
`cache_dir/render-<key>.arrow` -> drop conversations with too few supervised tokens (or that could not
be rendered exactly) -> seeded train/val split. `<key>` hashes everything the rendered rows depend on:
the source file (path, size, mtime), max_records, max_length, the tokenizer (name, vocab, chat template)
and _CACHE_VERSION. A later run with the same key loads the Arrow files directly and neither reads
ShareGPT nor renders again (a manifest written after the map finishes marks the cache complete).

Rows: `input_ids` (int32 list) and `loss_mask` (int8 list), same length <= max_length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.atomic import write_json_atomic
from data.sharegpt import read_sharegpt, source_path
from data.template import ChatTemplateError, render_with_assistant_mask

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1  # bump when reading/validation/rendering changes what a row contains


def _render_features():
    # `datasets` is imported where it is used, not at module level: `collate` (training, the hidden-state
    # cache) must import without it, e.g. on the GPU machine training from a pack (data/packed.py).
    from datasets import Features, List, Value

    return Features({
        "input_ids": List(Value("int32")),
        "loss_mask": List(Value("int8")),
        "render_error": Value("string"),  # "" or ChatTemplateError.reason; dropped after filtering
    })


def build_datasets(tokenizer, source: str, *, max_records: int | None, max_length: int, val_fraction: float,
                   seed: int, cache_dir: str | os.PathLike, min_assistant_tokens: int = 1, num_proc: int = 1
                   ) -> tuple[Dataset, Dataset]:
    """Return (train, val) datasets with columns `input_ids` and `loss_mask`.

    source: "sharegpt" (packaged) or a ShareGPT .json/.jsonl path (see data.sharegpt.read_sharegpt).
    Rows with fewer than `min_assistant_tokens` supervised tokens after truncation are dropped, as are
    conversations the chat template cannot render with an exact mask (counted per reason in the log).
    val gets ceil(val_fraction * n) rows (at least 1), train the rest; the split is fixed by `seed`.
    With several ranks, call it on rank 0 first and barrier, so the others only load the cache.
    """
    _check_args(tokenizer, max_length, val_fraction, min_assistant_tokens, num_proc)
    kept, filter_key = _usable_rows(tokenizer, source, max_records=max_records, max_length=max_length,
                                    cache_dir=cache_dir, min_assistant_tokens=min_assistant_tokens, num_proc=num_proc)
    cache_dir = Path(cache_dir).expanduser()
    n_val = min(len(kept) - 1, max(1, math.ceil(val_fraction * len(kept))))
    split_key = _hash([filter_key, seed, n_val])
    split = kept.train_test_split(
        test_size=n_val, seed=seed,
        train_indices_cache_file_name=str(cache_dir / f"split-{split_key}-train.arrow"),
        test_indices_cache_file_name=str(cache_dir / f"split-{split_key}-val.arrow"),
        train_new_fingerprint=f"{split_key}t", test_new_fingerprint=f"{split_key}v",
    )
    logger.info("data split (seed %d): %d train, %d val", seed, len(split["train"]), len(split["test"]))
    return split["train"], split["test"]


def build_eval_rows(tokenizer, source: str, *, max_length: int, cache_dir: str | os.PathLike,
                    min_assistant_tokens: int = 1):
    """Every usable row of `source` (columns `input_ids`, `loss_mask`), no split: a held-out set in its own file
    (the on-policy held-out slice, train/onpolicy.py). Rendering and filtering are cached as for build_datasets."""
    _check_args(tokenizer, max_length, 0.5, min_assistant_tokens, 1)
    return _usable_rows(tokenizer, source, max_records=None, max_length=max_length, cache_dir=cache_dir,
                        min_assistant_tokens=min_assistant_tokens, num_proc=1)[0]


def _usable_rows(tokenizer, source: str, *, max_records: int | None, max_length: int, cache_dir,
                 min_assistant_tokens: int, num_proc: int):
    """(rendered rows with enough assistant tokens, the filter's cache key); at least 2 rows or ValueError."""
    if not str(cache_dir):
        raise ValueError("build_datasets: cache_dir is empty; resolve data.cache_dir first (e.g. "
                         "$SPECDRAFT_CACHE/data) so the rendered dataset is not written to the working directory")
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(tokenizer, source, max_records=max_records, max_length=max_length)

    rendered = _load_rendered(cache_dir, key)
    if rendered is None:
        rendered = _render_and_cache(tokenizer, source, max_records, max_length, cache_dir, key, num_proc)
    else:
        logger.info("data cache hit: %s (%d conversations rendered earlier)",
                    cache_dir / f"render-{key}.json", len(rendered))

    errors = Counter(e for e in rendered["render_error"] if e)
    filter_key = _hash([key, min_assistant_tokens])
    kept = rendered.filter(
        _keep_row, fn_kwargs={"min_tokens": min_assistant_tokens},
        input_columns=["loss_mask", "render_error"], batched=True,
        cache_file_name=str(cache_dir / f"filter-{filter_key}.arrow"), new_fingerprint=filter_key,
        desc="drop rows without enough assistant tokens",
    ).remove_columns("render_error")
    too_short = len(rendered) - len(kept) - sum(errors.values())
    logger.info("data: %d conversations rendered, %d kept; dropped %d with < %d assistant tokens, "
                "%d the chat template could not mask exactly %s", len(rendered), len(kept), too_short,
                min_assistant_tokens, sum(errors.values()), dict(errors) if errors else "")
    if len(kept) < 2:
        raise ValueError(
            f"build_datasets: only {len(kept)} usable conversation(s) from {source!r} "
            f"(rendered {len(rendered)}, {too_short} with < {min_assistant_tokens} assistant tokens within "
            f"max_length={max_length}, "
            f"template errors {dict(errors)}); need at least 2 for train + val. Raise max_records or "
            "max_length, or lower min_assistant_tokens")
    return kept, filter_key


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of rows to the longest one.

    Returns input_ids [B, T] long (pad_id on padding), attention_mask [B, T] long (1 on real tokens),
    loss_mask [B, T] long (0 on padding).
    """
    if not rows:
        raise ValueError("collate: empty batch; the DataLoader produced no rows")
    if pad_id is None:
        raise ValueError("collate: pad_id is None; pass tokenizer.pad_token_id (or eos_token_id when the "
                         "tokenizer has no pad token)")
    lengths = [len(r["input_ids"]) for r in rows]
    batch, width = len(rows), max(lengths)
    input_ids = torch.full((batch, width), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.long)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        if len(row["loss_mask"]) != n:
            raise ValueError(f"collate: row {b} has {n} input_ids but {len(row['loss_mask'])} loss_mask "
                             "entries; rebuild the dataset cache (delete the data cache dir)")
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def cache_key(tokenizer, source: str, *, max_records: int | None, max_length: int) -> str:
    """Hash of everything a rendered row depends on (16 hex chars)."""
    path = source_path(source).resolve()
    st = path.stat()
    vocab = sorted(tokenizer.get_vocab().items())
    material = {
        "version": _CACHE_VERSION,
        "source": [str(path), st.st_size, st.st_mtime_ns],
        "max_records": max_records,
        "max_length": max_length,
        "tokenizer": [
            tokenizer.name_or_path,
            len(tokenizer),
            hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
            hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),  # same name, different vocab = new key
        ],
    }
    return _hash(material)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _check_args(tokenizer, max_length, val_fraction, min_assistant_tokens, num_proc) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"build_datasets: tokenizer {tokenizer.name_or_path!r} has no chat_template; use "
                         "the base's instruct tokenizer or set tokenizer.chat_template")
    if max_length < 2:
        raise ValueError(f"build_datasets: max_length={max_length}; use at least 2 tokens (1024 is typical)")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"build_datasets: val_fraction={val_fraction}; use a fraction in (0, 1), e.g. 0.05")
    if min_assistant_tokens < 1:
        raise ValueError(f"build_datasets: min_assistant_tokens={min_assistant_tokens}; use at least 1 "
                         "(a row without supervised tokens trains nothing)")
    if num_proc < 1:
        raise ValueError(f"build_datasets: num_proc={num_proc}; use 1 or more processes")


def _render_and_cache(tokenizer, source, max_records, max_length, cache_dir: Path, key: str, num_proc: int):
    from datasets import Dataset

    conversations, stats = read_sharegpt(source, max_records=max_records)
    raw = Dataset.from_dict({"messages": conversations})
    rendered = raw.map(
        _render_batch, batched=True, batch_size=256, remove_columns=["messages"], features=_render_features(),
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        cache_file_name=str(cache_dir / f"render-{key}.arrow"), new_fingerprint=key,
        num_proc=num_proc if num_proc > 1 else None, desc="render chat template + assistant mask",
    )
    # With num_proc > 1 datasets writes one file per shard: record them, then mark the cache complete.
    files = [Path(f["filename"]).name for f in rendered.cache_files]
    manifest = {"files": files, "rows": len(rendered), "read": stats.summary()}
    write_json_atomic(cache_dir / f"render-{key}.json", manifest)
    return rendered


def _load_rendered(cache_dir: Path, key: str):
    from datasets import Dataset, concatenate_datasets

    manifest_path = cache_dir / f"render-{key}.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        parts = [Dataset.from_file(str(cache_dir / name)) for name in manifest["files"]]
    except (OSError, ValueError, KeyError) as err:
        logger.warning("data cache %s is unreadable (%s); rebuilding it", manifest_path, err)
        return None
    rendered = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    if len(rendered) != manifest["rows"]:
        logger.warning("data cache %s has %d rows, manifest says %d; rebuilding it",
                       manifest_path, len(rendered), manifest["rows"])
        return None
    return rendered


def _render_batch(batch: dict, tokenizer, max_length: int) -> dict:
    out = {"input_ids": [], "loss_mask": [], "render_error": []}
    for messages in batch["messages"]:
        try:
            ids, mask = render_with_assistant_mask(tokenizer, messages, max_length=max_length)
            error = ""
        except ChatTemplateError as err:  # skipped with a count, never fatal (docs/howto/train.md)
            ids, mask, error = [], [], err.reason
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["render_error"].append(error)
    return out


def _keep_row(loss_masks: list, errors: list, min_tokens: int) -> list[bool]:
    return [not e and sum(m) >= min_tokens for m, e in zip(loss_masks, errors)]
