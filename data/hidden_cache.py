"""Hidden-state cache: run the frozen base once over the tokenized train set, train many epochs from disk.

Every draft family reads only h_t (the base's last hidden state after the final norm) plus the token ids
and the loss mask; the base's teacher distribution is lm_head(h), recomputed from the cached h by the
family's loss through the frozen lm_head. So caching h removes the base forward, usually the largest cost
of a training step on a CPU, from every epoch after the first.

Layout of a cache directory (one per (base fingerprint, base dtype, train rows), see `cache_key`):
    shard-00000.safetensors ...  rows [i*S, (i+1)*S) packed without padding:
        hidden    [sum_T, d] (bf16 by default)   h_t of every real token of those rows
        input_ids [sum_T] int32, loss_mask [sum_T] int8
        offsets   [S'+1] int64                   row r's tokens are [offsets[r], offsets[r+1])
        aux       [sum_T, k*d] (same dtype)      only with aux_layers (EAGLE-3): the residual stream after
                                                 base layers aux_layers, side by side (models.base.last_hidden_and_aux)
    manifest.json                               written last: marks the cache complete

The writer is resumable: shards are written atomically (temp file + rename) and a restarted build skips
the shards already on disk, so a killed build loses at most one shard of work. N ranks build one cache
together (`RankGroup`): rank r writes shards r, r+N, ...; rank 0 writes the manifest after all finished;
files, manifest and key are those of a one-rank build, so any world size trains from the result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from core.atomic import atomic_path, write_text_atomic
from core.checksum import file_sha256
from data.dataset import collate

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def cache_key(base_fingerprint: str, base_dtype: torch.dtype, dataset, cache_dtype: str,
              aux_layers: list[int] | None = None) -> str:
    """Hash of everything the cached tensors depend on: the base (weights fingerprint and the dtype it ran
    in, since bf16 and fp32 forwards give different h), the exact token rows in order, the storage dtype,
    and the aux layer ids when aux states are stored (no aux = the key of a cache without them)."""
    digest = hashlib.sha256()
    head = [CACHE_VERSION, base_fingerprint, str(base_dtype), cache_dtype, len(dataset)]
    if aux_layers:
        head.append([int(i) for i in aux_layers])
    digest.update(json.dumps(head).encode())
    for row in dataset:
        digest.update(np.asarray(row["input_ids"], dtype=np.int32).tobytes())
        digest.update(np.asarray(row["loss_mask"], dtype=np.int8).tobytes())
    return digest.hexdigest()[:16]


def estimate_bytes(dataset, hidden_size: int, cache_dtype: str = "bf16", num_aux: int = 0) -> int:
    """Bytes on disk: per token (1 + num_aux)·d hidden values + an int32 id + an int8 mask (offsets are
    negligible)."""
    tokens = sum(len(r["input_ids"]) for r in dataset)
    return tokens * ((1 + num_aux) * hidden_size * _DTYPES[cache_dtype].itemsize + 5)


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.safetensors"


@dataclass
class RankGroup:
    """The ranks that build one cache together; the default is a one-process build.

    Shards are the unit of work: rank r writes shards r, r + W, r + 2W, ... (`shard_owner`), so the ranks'
    files are disjoint and each shard holds exactly the rows, micro-batches and bytes of a one-rank build.
    barrier / all_reduce_sum are the process group's (train/distributed.py); data/ only calls them.
    collective_forward: the base forward is itself a collective (ZeRO-3-partitioned base: every forward
    all-gathers parameters), so every rank must run the same number of forwards; a rank out of work runs
    a one-token dummy forward to keep in step.
    """

    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] = lambda: None
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    collective_forward: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def shard_owner(shard: int, world_size: int) -> int:
    """Round-robin: the ranks' shard counts differ by at most one."""
    return shard % world_size


@torch.no_grad()
def build_hidden_cache(base_forward, dataset, directory: str | os.PathLike, *, pad_id: int, device: torch.device,
                       micro_batch_size: int = 4, shard_rows: int = 256, cache_dtype: str = "bf16",
                       info: dict | None = None, aux_layers: list[int] | None = None,
                       ranks: RankGroup | None = None, verify: bool = False) -> Path:
    """Write the cache for `dataset` (rows with input_ids / loss_mask) into `directory`; return it.

    `base_forward(ids, attn, aux_layers) -> (h [b, T, d], aux [b, T, k*d] or None)` is the frozen base's forward
    with a `hidden_size` attribute (models.base.HiddenStates): data/ runs it without knowing the model code.
    Runs it over micro-batches of `micro_batch_size` right-padded rows; padding never
    changes a real token's h (causal attention, padding at the end), and only real tokens are stored.
    Skips work already done: a complete cache returns at once, finished shards of a killed build are kept. A
    complete cache whose shards fail their check (size always; sha256 too with `verify`) gets only those rebuilt.
    With `ranks` (N processes, a directory every rank sees) each rank builds its own shards, rank 0 shows
    the whole job's progress (the done-token count is all-reduced after every micro-batch step) and writes
    the manifest once every rank has finished; collective: every rank of the group must call it.
    """
    ranks = ranks or RankGroup()
    if cache_dtype not in _DTYPES:
        raise ValueError(f"hidden cache dtype {cache_dtype!r}: use one of {', '.join(_DTYPES)}")
    directory = Path(directory)
    key = (info or {}).get("key")
    _check_key(directory, key)  # every rank: all of them fail alike on another run's directory
    if (directory / "manifest.json").is_file():
        bad = check_shards(directory, verify=verify)  # every rank reads the same files: they agree
        if not bad:
            return directory
        ranks.barrier()
        if ranks.is_main:  # this run owns the build: drop the bad shards and the manifest, rebuild only those
            print(f"hidden-state cache {directory}: {len(bad)} bad shard(s), rebuilding only those: "
                  + "; ".join(f"{_shard_path(directory, i).name}: {why}" for i, why in bad.items()), flush=True)
            for i in bad:
                _shard_path(directory, i).unlink(missing_ok=True)
            (directory / "manifest.json").unlink()
        ranks.barrier()
    if ranks.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(directory / "key.json", json.dumps({"key": key}) + "\n")  # claims the dir for this data
        for stale in [*directory.glob(".shard-*.tmp*"), *directory.glob("shard-*.tmp")]:  # a killed writer's
            stale.unlink(missing_ok=True)  # half-written temp files (no rank is writing yet: barrier below)
    ranks.barrier()
    n_rows = len(dataset)
    n_shards = (n_rows + shard_rows - 1) // shard_rows
    hidden_size = int(base_forward.hidden_size)
    done = [i for i in range(n_shards) if _shard_path(directory, i).is_file()]
    aux_layers = [int(i) for i in aux_layers or []]
    size = estimate_bytes(dataset, hidden_size, cache_dtype, len(aux_layers))
    row_tokens = [len(r["input_ids"]) for r in dataset]
    tokens = sum(row_tokens)
    if ranks.is_main:
        # Printed (not only logged) so a user sees the disk cost before the long part starts.
        what = (f"(1 + {len(aux_layers)} aux layers {aux_layers}) x d={hidden_size}" if aux_layers
                else f"d={hidden_size}")
        print(f"hidden-state cache: {n_rows} conversations, {tokens:,} tokens x {what} in {cache_dtype} "
              f"= {size / 2**30:.2f} GiB in {n_shards} shard(s) under {directory}"
              + (f" ({len(done)} already written, resuming)" if done else "")
              + (f", built by {ranks.world_size} ranks" if ranks.world_size > 1 else ""), flush=True)
    dtype = _DTYPES[cache_dtype]
    # This rank's work: (shard, first row, last row + 1) micro-batches of its unfinished shards, in order.
    mine = [s for s in range(n_shards) if shard_owner(s, ranks.world_size) == ranks.rank and s not in done]
    plan = [(s, lo, min(lo + micro_batch_size, (s + 1) * shard_rows, n_rows))
            for s in mine for lo in range(s * shard_rows, min(n_rows, (s + 1) * shard_rows), micro_batch_size)]
    steps = torch.zeros(ranks.world_size, dtype=torch.float64)
    steps[ranks.rank] = len(plan)
    n_steps = int(ranks.all_reduce_sum(steps).max())
    initial = sum(sum(row_tokens[s * shard_rows:(s + 1) * shard_rows]) for s in done)
    bar = tqdm(total=tokens, initial=initial, unit="tok", unit_scale=True, desc="hidden-state cache",
               dynamic_ncols=True, disable=not ranks.is_main)
    hidden_parts, aux_parts, lengths = [], [], []
    for step in range(n_steps):
        n_tok = 0
        if step < len(plan):
            shard, lo, hi = plan[step]
            chunk = [dataset[i] for i in range(lo, hi)]
            batch = collate(chunk, pad_id)
            ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            h, aux = base_forward(ids, attn, aux_layers)  # [b, T, d], [b, T, k*d] or None
            for b, r in enumerate(chunk):
                n = len(r["input_ids"])
                hidden_parts.append(h[b, :n].to("cpu", dtype))
                if aux is not None:
                    aux_parts.append(aux[b, :n].to("cpu", dtype))
                lengths.append(n)
            n_tok = int(attn.sum())
            if step + 1 == len(plan) or plan[step + 1][0] != shard:  # the shard's last micro-batch
                _write_shard(directory, shard, dataset, shard_rows, hidden_parts, lengths, aux_parts)
                hidden_parts, aux_parts, lengths = [], [], []
        elif ranks.collective_forward:  # out of work: keep the other ranks' all-gathers company
            one = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
            base_forward(one, torch.ones_like(one), aux_layers)
        bar.update(int(ranks.all_reduce_sum(torch.tensor([float(n_tok)], dtype=torch.float64)).item()))
    bar.close()
    ranks.barrier()  # every rank's shards are on disk
    if ranks.is_main:
        missing = [i for i in range(n_shards) if not _shard_path(directory, i).is_file()]
        if missing:
            raise RuntimeError(f"hidden-state cache {directory}: shards {missing[:5]} missing after every rank "
                               "finished; the ranks must share one file system (put data.cache_dir on it)")
        # Size and sha256 of every shard (whichever rank or earlier run wrote it): what opening the cache checks.
        files = [{"file": _shard_path(directory, i).name, "bytes": _shard_path(directory, i).stat().st_size,
                  "sha256": file_sha256(_shard_path(directory, i))} for i in range(n_shards)]
        manifest = {"version": CACHE_VERSION, "rows": n_rows, "tokens": tokens, "hidden_size": hidden_size,
                    "shard_rows": shard_rows, "shards": n_shards, "dtype": cache_dtype, "aux_layers": aux_layers,
                    "shard_files": files, **(info or {})}
        write_text_atomic(directory / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    ranks.barrier()  # nobody opens the cache before the manifest exists
    return directory


def _write_shard(directory: Path, shard: int, dataset, shard_rows: int, hidden_parts: list, lengths: list,
                 aux_parts: list | None = None) -> None:
    """One shard file from its rows' h (and EAGLE-3 aux states, if any; in row order), written atomically
    (temp file + rename)."""
    rows = [dataset[i] for i in range(shard * shard_rows, min(len(dataset), (shard + 1) * shard_rows))]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    tensors = {
        "hidden": torch.cat(hidden_parts).contiguous(),
        "input_ids": torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int32),
        "loss_mask": torch.tensor([m for r in rows for m in r["loss_mask"]], dtype=torch.int8),
        "offsets": offsets,
    }
    if aux_parts:
        tensors["aux"] = torch.cat(aux_parts).contiguous()
    with atomic_path(_shard_path(directory, shard)) as tmp:
        save_file(tensors, str(tmp))


def _check_key(directory: Path, key: str | None) -> None:
    """A cache directory belongs to one (base, data) key: refuse to resume or reuse another run's."""
    path = directory / "key.json"
    if key is None or not path.is_file():
        return
    found = json.loads(path.read_text()).get("key")
    if found != key:
        raise ValueError(f"hidden-state cache {directory} was built for other data or another base (key {found}, "
                         f"this run needs {key}); delete it, or set data.hidden_cache=auto to get a directory "
                         "per key")


class CacheError(ValueError):
    """A hidden-state cache that cannot be read as it is; the message names the shards and the fix."""


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        int(manifest["rows"]), int(manifest["shard_rows"]), int(manifest["shards"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CacheError(f"{path} is damaged ({type(err).__name__}: {err}); delete it and build the cache again "
                         "(`specdraft cache --config ...` with the run's configs: finished shards are checked and "
                         "kept)") from None
    return manifest


def check_shards(directory: Path, verify: bool = False) -> dict[int, str]:
    """{shard index: what is wrong} for a finished cache: missing or wrong-size files (always, cheap) and, with
    `verify`, files whose sha256 differs from the manifest's. A cache written before the manifest recorded its
    shards is checked for missing files only."""
    manifest = read_manifest(directory)
    recorded = manifest.get("shard_files")
    bad: dict[int, str] = {}
    for i in range(int(manifest["shards"])):
        path = _shard_path(directory, i)
        if not path.is_file():
            bad[i] = "missing"
        elif recorded and path.stat().st_size != recorded[i]["bytes"]:
            bad[i] = f"{path.stat().st_size} bytes, the manifest says {recorded[i]['bytes']} (cut short or replaced)"
        elif recorded and verify and file_sha256(path) != recorded[i]["sha256"]:
            bad[i] = "sha256 differs from the manifest's (damaged)"
    return bad


class HiddenCache:
    """Read side: `cache[i]` -> {"hidden" [T_i, d], "input_ids" [T_i], "loss_mask" [T_i]} of train row i.

    Shards are memory-mapped by safetensors; one shard's offsets are read once and kept.
    """

    def __init__(self, directory: str | os.PathLike, read_aux: bool = True, verify: bool = False):
        """read_aux=False: rows leave out the aux layers even if the cache has them (a family that reads
        only h, training from an EAGLE-3 cache of the same rows: `find_superset_cache`). Opening checks every
        shard's size (and with `verify` its sha256) against the manifest: a bad shard is a CacheError naming it."""
        self.directory = Path(directory)
        self.read_aux = read_aux
        path = self.directory / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"{self.directory} is not a finished hidden-state cache (no manifest.json); "
                                    "build it with data.hidden_cache=auto (the build resumes where it stopped)")
        self.manifest = read_manifest(self.directory)
        bad = check_shards(self.directory, verify=verify)
        if bad:
            raise CacheError(f"hidden-state cache {self.directory}: bad shard(s) "
                             + "; ".join(f"{_shard_path(self.directory, i).name}: {why}" for i, why in bad.items())
                             + ". Rebuild only those: run `specdraft cache` (or `specdraft train`) with the configs "
                             "that built this cache; the good shards are kept")
        self.shard_rows = int(self.manifest["shard_rows"])
        self._handles: dict[int, tuple] = {}

    def __len__(self) -> int:
        return int(self.manifest["rows"])

    def _shard(self, index: int):
        if index not in self._handles:
            path = _shard_path(self.directory, index)
            try:
                f = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:  # e.g. bytes overwritten in its header
                raise CacheError(f"hidden-state cache shard {path} is damaged ({err}); rebuild it: run `specdraft "
                                 "cache` with the configs that built this cache and data.hidden_cache_verify=true "
                                 "(only bad shards are rebuilt)") from None
            self._handles[index] = (f, f.get_tensor("offsets").tolist())
        return self._handles[index]

    def _bounds(self, row: int) -> tuple:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for a hidden cache of {len(self)} rows")
        f, offsets = self._shard(row // self.shard_rows)
        r = row % self.shard_rows
        return f, offsets[r], offsets[r + 1]

    def length(self, row: int) -> int:
        """The row's token count (from its shard's offsets: nothing of the row is read)."""
        _, lo, hi = self._bounds(row)
        return hi - lo

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        return self.window(row)

    def window(self, row: int, start: int = 0, stop: int | None = None, aux_stop: int | None = None
               ) -> dict[str, torch.Tensor]:
        """The row with only its positions [start, stop) of hidden and [start, aux_stop) of aux read (each cut at
        the row's end; None: to the end), input_ids and loss_mask whole. What one rank of a sequence-parallel group
        reads (train/sequence_parallel.py: its rows plus the halo of h its loss reads past them), so no rank holds
        a whole long row's states."""
        f, lo, hi = self._bounds(row)
        h_lo, h_hi = min(lo + start, hi), hi if stop is None else min(lo + stop, hi)
        out = {"hidden": f.get_slice("hidden")[h_lo:h_hi], "input_ids": f.get_slice("input_ids")[lo:hi],
               "loss_mask": f.get_slice("loss_mask")[lo:hi]}
        if self.read_aux and self.manifest.get("aux_layers"):
            a_hi = hi if aux_stop is None else min(lo + aux_stop, hi)
            out["aux"] = f.get_slice("aux")[h_lo:max(h_lo, a_hi)]
        return out


def collate_cached(rows: list[dict[str, torch.Tensor]], pad_id: int, dtype: torch.dtype,
                   widths: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad cached rows like data.dataset.collate, plus hidden [B, T, d] in `dtype` (zeros on padding).
    widths=(h, a): the rows are windows (HiddenCache.window) of one sequence-parallel rank, hidden [B, h, d] and aux
    [B, a, k*d], each window zero-padded to its width; input_ids / loss_mask stay whole [B, T]."""
    batch = collate([{"input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()} for r in rows],
                    pad_id)
    b, t = batch["input_ids"].shape
    h_width, a_width = widths if widths is not None else (t, t)
    hidden = torch.zeros(b, h_width, rows[0]["hidden"].shape[-1], dtype=dtype)
    for i, r in enumerate(rows):
        hidden[i, : r["hidden"].shape[0]] = r["hidden"].to(dtype)
    batch["hidden"] = hidden
    if "aux" in rows[0]:  # EAGLE-3's aux layers [B, T, k*d], zeros on padding like hidden
        aux = torch.zeros(b, a_width, rows[0]["aux"].shape[-1], dtype=dtype)
        for i, r in enumerate(rows):
            aux[i, : r["aux"].shape[0]] = r["aux"].to(dtype)
        batch["aux"] = aux
    return batch


def find_superset_cache(cache_root: Path, dataset, *, base_fingerprint: str, base_dtype: torch.dtype,
                        cache_dtype: str) -> Path | None:
    """A finished cache under <cache_root>/hidden/ with the same base, dtype and rows as `dataset` plus aux
    layers (an EAGLE-3 cache), or None. Its h is exactly what a cache without aux layers would hold, so a
    family that reads only h trains from it instead of running the base over the same rows a second time
    (~30 min per million tokens on a 2-core CPU). Candidates are matched on their manifest first, then on
    the key recomputed from `dataset` and their aux ids, so a stale or foreign directory is never used."""
    for manifest_path in sorted((cache_root / "hidden").glob("*/manifest.json")):
        try:
            m = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not (m.get("aux_layers") and m.get("rows") == len(dataset) and m.get("dtype") == cache_dtype
                and m.get("base_fingerprint") == base_fingerprint and m.get("base_dtype") == str(base_dtype)):
            continue
        if m.get("key") == cache_key(base_fingerprint, base_dtype, dataset, cache_dtype, m["aux_layers"]):
            return manifest_path.parent
    return None


def resolve_cache_dir(setting: str, cache_root: Path, key: str) -> Path:
    """data.hidden_cache: "auto" -> <cache_root>/hidden/<key>; any other non-empty value is a directory."""
    return cache_root / "hidden" / key if setting == "auto" else Path(setting).expanduser()
