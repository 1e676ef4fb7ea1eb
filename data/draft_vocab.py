"""Build the draft vocabulary of a run (docs/concepts.md#draft-vocabulary; the map itself: models/vocab_map.py).

The map keeps the N most frequent *target* tokens of the training rows: every token a draft is ever
trained to predict is an assistant token after the chat template (loss_mask == 1), so those are counted
(one count per supervised token; the targets of the different depths are the same tokens shifted, so
the depth does not change the ranking). Ties break by the smaller base id, so the map is a pure
function of (rows, N): rebuilding it on any machine gives the same tensor.

CTC drafter: its labels are the base's own greedy tokens, not the data tokens. Counting those needs a
full [T, V] LM-head pass over every training row (the cost of one hidden-state cache build) before
training starts, so the map is counted on the data targets for every family; the coverage logged at
train start is the coverage of those targets. On an instruct base trained on similar chat data the two
token sets largely coincide (the base's greedy tokens are mostly the data tokens, docs/lab/benchmarks.md).

The map is cached as a small safetensors file under <cache>/draft_vocab/<key>.safetensors, key = the
base fingerprint + the exact train rows + N (like the data and hidden-state caches).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from core.atomic import atomic_path

log = logging.getLogger(__name__)

VOCAB_CACHE_VERSION = 1


def count_targets(rows, vocab_size: int) -> torch.Tensor:
    """counts [V] int64: how often each base id is a supervised (loss_mask != 0) token of `rows`.

    rows: an iterable of dicts with `input_ids` and `loss_mask` (the tokenized dataset's rows)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"]) != 0
        targets = ids[mask]
        if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
            raise ValueError(f"token ids in [{targets.min()}, {targets.max()}] do not fit a {vocab_size}-token base; "
                             "the data was tokenized for another base (delete the data cache or load that base)")
        counts += np.bincount(targets, minlength=vocab_size)
    return torch.from_numpy(counts)


def top_n_map(counts: torch.Tensor, n: int) -> torch.Tensor:
    """d2t [N] int64: the N most frequent ids, most frequent first, ties by the smaller id (deterministic)."""
    v = counts.numel()
    if not 1 <= n <= v:
        raise ValueError(f"draft.vocab_size={n}: use 0 (the full vocabulary) or 1..{v} (this base has {v} tokens)")
    # Stable sort on -counts keeps ids in ascending order inside each tie: exactly "ties by smaller id".
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return order[:n].clone()


def coverage(rows, d2t: torch.Tensor, vocab_size: int) -> float:
    """Fraction of the supervised tokens of `rows` inside the map (1.0 for no rows)."""
    counts = count_targets(rows, vocab_size)
    total = int(counts.sum())
    return float(counts[d2t].sum()) / total if total else 1.0


def vocab_cache_key(base_fingerprint: str, rows, n: int) -> str:
    """Hash of what the map depends on: the base (its tokenizer's ids), the exact train rows, N."""
    digest = hashlib.sha256()
    digest.update(json.dumps([VOCAB_CACHE_VERSION, base_fingerprint, int(n), len(rows)]).encode())
    for row in rows:
        digest.update(np.asarray(row["input_ids"], dtype=np.int32).tobytes())
        digest.update(np.asarray(row["loss_mask"], dtype=np.int8).tobytes())
    return digest.hexdigest()[:16]


def build_draft_vocab(rows, n: int, vocab_size: int, *, base_fingerprint: str,
                      cache_dir: str | Path | None = None) -> tuple[torch.Tensor, bool]:
    """(d2t [N] int64, cache_hit) for the train `rows`; read from / written to `cache_dir` when given."""
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{vocab_cache_key(base_fingerprint, rows, n)}.safetensors"
        if path.is_file():
            d2t = load_file(str(path))["d2t"].to(torch.int64)
            if d2t.numel() == n and int(d2t.max()) < vocab_size:
                return d2t, True
            log.warning("draft vocabulary cache %s does not match N=%d / V=%d; rebuilding it", path, n, vocab_size)
    d2t = top_n_map(count_targets(rows, vocab_size), n)
    if path is not None:
        with atomic_path(path) as tmp:  # a concurrent reader never sees half a file
            save_file({"d2t": d2t.contiguous()}, str(tmp))
    return d2t, False


def vocab_report(d2t: torch.Tensor | None, train_rows, val_rows, vocab_size: int) -> dict:
    """The keys logged at train start and written to metrics / the export: size and coverage."""
    if d2t is None:
        return {"draft_vocab_size": 0, "draft_vocab_coverage_train": 1.0, "draft_vocab_coverage_heldout": 1.0}
    return {"draft_vocab_size": int(d2t.numel()),
            "draft_vocab_coverage_train": round(coverage(train_rows, d2t, vocab_size), 5),
            "draft_vocab_coverage_heldout": round(coverage(val_rows, d2t, vocab_size), 5)}
