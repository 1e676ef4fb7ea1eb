"""Pre-tokenized training rows in a compact file set: what a machine without `datasets`, the ShareGPT
package or a tokenizer run trains from (the GPU machine, docs/howto/gpu_kit.md; written by launch/pack_data.py).

Layout of a pack directory (train with `data.source=<dir>`):
    manifest.json              format, rows, tokens, the tokenizer's fingerprint, how the rows were made
    shard-00000.npz ...        rows packed without padding, each file <= ~16 MiB (np.savez_compressed):
        ids     [sum_T] uint16       token ids (vocabularies up to 65,536; SmolLM2 has 49,152)
        mask    [ceil(sum_T/8)] uint8 the assistant-only loss mask, np.packbits (8 tokens a byte)
        offsets [S+1] int64          row r's tokens are [offsets[r], offsets[r+1]) of this shard

That is 2 bytes + 1 bit a token before zlib (~1.3x smaller after it): all 17.5k ShareGPT conversations,
cut at 1024 tokens, fit the device tool's 64 MiB carry limit, which their JSON (125 MB) does not.

Read side: `load_packed` returns (train, val) row sets that behave like the `datasets` rows of
data.dataset.build_datasets (`len`, `ds[i]` -> {"input_ids": list[int], "loss_mask": list[int]}, iteration),
so the training loop, the hidden-state cache and the held-out table take them unchanged. The train/val split
is seeded here (data.seed, data.val_fraction), over the rows as packed. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np

from core.atomic import atomic_path, write_json_atomic

logger = logging.getLogger(__name__)

PACK_FORMAT = "specdraft-packed-v1"
SHARD_TOKENS = 6_000_000  # 12 MB of uint16 ids + 0.75 MB of mask bits per shard before compression
_MAX_VOCAB = 1 << 16  # uint16 ids


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex) of what decides the token ids and masks: vocabulary and chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    material = [len(tokenizer), hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),
                hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()]
    return hashlib.sha256(json.dumps(material).encode()).hexdigest()[:16]


def is_packed(source: str) -> bool:
    """True if `source` (a data.source value) is a pack directory written by `write_packed`."""
    manifest = Path(str(source)).expanduser() / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == PACK_FORMAT
    except (OSError, ValueError):
        return False


def write_packed(rows, out_dir: str | os.PathLike, *, vocab_size: int, info: dict | None = None,
                 shard_tokens: int = SHARD_TOKENS) -> dict:
    """Write `rows` (iterable of {"input_ids": ints, "loss_mask": 0/1 ints}) as a pack under `out_dir`;
    return the manifest. `info` goes into the manifest (tokenizer fingerprint, source, max_length, ...).
    The manifest is written last, so a half-written pack is never taken for a finished one."""
    if vocab_size > _MAX_VOCAB:
        raise ValueError(f"write_packed: vocab_size={vocab_size} does not fit uint16 ids (max {_MAX_VOCAB}); "
                         "train from the raw source (data.source=sharegpt) for this tokenizer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("shard-*.npz"):  # a rerun must not leave shards of an earlier, longer pack behind
        old.unlink()
    (out / "manifest.json").unlink(missing_ok=True)
    ids_buf: list[np.ndarray] = []
    mask_buf: list[np.ndarray] = []
    shards, n_rows, n_tokens, n_supervised = [], 0, 0, 0

    def flush():
        if not ids_buf:
            return
        lengths = np.array([len(x) for x in ids_buf], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        path = out / f"shard-{len(shards):05d}.npz"
        with atomic_path(path) as tmp:
            np.savez_compressed(tmp, ids=np.concatenate(ids_buf), mask=np.packbits(np.concatenate(mask_buf)),
                                offsets=offsets)
        shards.append({"file": path.name, "rows": len(ids_buf), "tokens": int(offsets[-1]),
                       "bytes": path.stat().st_size})
        ids_buf.clear()
        mask_buf.clear()

    buffered = 0
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=np.int64)
        if ids.ndim != 1 or ids.shape != mask.shape or ids.size == 0:
            raise ValueError(f"write_packed: row {n_rows} has input_ids {ids.shape} and loss_mask {mask.shape}; "
                             "need two 1-D sequences of the same non-zero length")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"write_packed: row {n_rows} has token ids outside [0, {vocab_size})")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError(f"write_packed: row {n_rows} has a loss_mask value other than 0/1")
        ids_buf.append(ids.astype(np.uint16))
        mask_buf.append(mask.astype(np.uint8))
        n_rows += 1
        n_tokens += ids.size
        n_supervised += int(mask.sum())
        buffered += ids.size
        if buffered >= shard_tokens:
            flush()
            buffered = 0
    flush()
    if n_rows == 0:
        raise ValueError("write_packed: no rows to pack")
    manifest = {"format": PACK_FORMAT, "rows": n_rows, "tokens": n_tokens, "supervised_tokens": n_supervised,
                "vocab_size": vocab_size, "shards": shards, **(info or {})}
    write_json_atomic(out / "manifest.json", manifest)
    return manifest


class PackedRows:
    """Rows of a pack (all, or a subset by index): `len`, `rows[i]`, iteration, like `datasets` rows.

    ids [sum_T] int32 and mask [sum_T] uint8 live in memory, unpacked once (~5 bytes a token: 45 MB for
    all of ShareGPT); `index` picks rows, `max_length` cuts each one when it is read.
    """

    def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, index: np.ndarray,
                 max_length: int | None = None):
        self._ids, self._mask, self._offsets = ids, mask, offsets
        self._index = np.asarray(index, dtype=np.int64)
        self._max_length = max_length

    def __len__(self) -> int:
        return int(self._index.size)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} packed rows")
        r = int(self._index[i])
        lo, hi = int(self._offsets[r]), int(self._offsets[r + 1])
        if self._max_length is not None:
            hi = min(hi, lo + self._max_length)
        return {"input_ids": self._ids[lo:hi].tolist(), "loss_mask": self._mask[lo:hi].tolist()}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> np.ndarray:
        """Tokens of each selected row after the max_length cut, [len(self)] int64."""
        n = self._offsets[self._index + 1] - self._offsets[self._index]
        return n if self._max_length is None else np.minimum(n, self._max_length)


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory).expanduser() / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent} is not a finished pack (no manifest.json); write it with "
                                "launch/pack_data.py")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != PACK_FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {PACK_FORMAT!r}; rewrite the pack "
                         "with this version's launch/pack_data.py")
    return manifest


def _read_all(directory: Path, manifest: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [N] int32, mask [N] uint8, offsets [rows+1] int64) of the whole pack, shards concatenated."""
    ids_parts, mask_parts, offsets, base = [], [], [np.zeros(1, dtype=np.int64)], 0
    for shard in manifest["shards"]:
        with np.load(directory / shard["file"], allow_pickle=False) as z:
            ids, bits, off = z["ids"], z["mask"], z["offsets"]
        n = int(off[-1])
        if ids.size != n or off.size != shard["rows"] + 1:
            raise ValueError(f"{directory / shard['file']}: {ids.size} ids / {off.size - 1} rows, manifest says "
                             f"{n} / {shard['rows']}; the pack is damaged, rewrite it with launch/pack_data.py")
        ids_parts.append(ids.astype(np.int32))
        mask_parts.append(np.unpackbits(bits, count=n))
        offsets.append(off[1:] + base)
        base += n
    return np.concatenate(ids_parts), np.concatenate(mask_parts), np.concatenate(offsets)


def load_packed(directory: str | os.PathLike, tokenizer=None, *, max_length: int, val_fraction: float, seed: int,
                min_assistant_tokens: int = 1) -> tuple[PackedRows, PackedRows]:
    """(train, val) rows of a pack. `tokenizer` (the base's), when given, must be the one the pack was made
    with. Rows are cut at `max_length` and those left with fewer than `min_assistant_tokens` supervised
    tokens are dropped; val gets ceil(val_fraction * n) rows (at least 1), chosen by `seed`."""
    directory = Path(directory).expanduser()
    manifest = read_manifest(directory)
    want = manifest.get("tokenizer_fingerprint")
    if tokenizer is not None and want is not None and tokenizer_fingerprint(tokenizer) != want:
        raise ValueError(f"pack {directory} was tokenized with another tokenizer ({manifest.get('tokenizer')!r}, "
                         f"fingerprint {want}) than this base's ({tokenizer_fingerprint(tokenizer)}); train with the "
                         "base it was made for, or rewrite the pack with launch/pack_data.py --base <this base>")
    packed_len = manifest.get("max_length")
    if packed_len is not None and max_length > packed_len:
        logger.warning("data.max_length=%d but the pack %s was cut at %d tokens: rows stay at most %d long",
                       max_length, directory, packed_len, packed_len)
    ids, mask, offsets = _read_all(directory, manifest)
    everything = PackedRows(ids, mask, offsets, np.arange(offsets.size - 1), max_length)
    lengths = everything.lengths()
    starts = offsets[:-1]
    # Supervised tokens within the first `length` tokens of each row: cumulative sums over the whole pack.
    csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    supervised = csum[starts + lengths] - csum[starts]
    keep = np.flatnonzero(supervised >= min_assistant_tokens)
    if keep.size < 2:
        raise ValueError(f"pack {directory}: only {keep.size} row(s) with >= {min_assistant_tokens} assistant tokens "
                         f"within max_length={max_length}; need at least 2 for train + val")
    n_val = min(keep.size - 1, max(1, math.ceil(val_fraction * keep.size)))
    order = np.random.default_rng(seed).permutation(keep.size)
    val_idx, train_idx = np.sort(keep[order[:n_val]]), np.sort(keep[order[n_val:]])
    logger.info("packed data %s: %d rows (%d dropped: < %d assistant tokens within %d), %d train / %d val",
                directory, keep.size, lengths.size - keep.size, min_assistant_tokens, max_length,
                train_idx.size, val_idx.size)
    return (PackedRows(ids, mask, offsets, train_idx, max_length), PackedRows(ids, mask, offsets, val_idx, max_length))


def packed_train_data(directory: str | os.PathLike) -> dict:
    """The export's `train_data` for a pack: the pack path plus the source slice it was made from
    (`derived_from`), so `specdraft eval dataset=sharegpt` holds out the same conversations as for the source."""
    manifest = read_manifest(directory)
    return {"source": str(directory), "max_records": None,
            "derived_from": {"source": manifest.get("source"), "max_records": manifest.get("max_records")}}
