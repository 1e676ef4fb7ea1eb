"""Atomic, resumable DeepSpeed checkpoints under runs/<run>/checkpoints/<tag>/.

Every rank writes its shard into checkpoints/.partial/<tag>/; after a barrier rank 0 renames that to
checkpoints/<tag>/ and only then points checkpoints/latest at it. A run killed mid-save therefore
leaves the previous checkpoint and `latest` intact; the half-written directory is removed next time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from core.atomic import write_text_atomic

PARTIAL = ".partial"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The directory `latest` points at; else the newest finished step directory (every `step*` directory
    got there by an atomic rename, so each is complete); None when there is none."""
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        target = ckpt_root / pointer.read_text().strip()
        if target.is_dir():
            return target
    finished = sorted(p for p in ckpt_root.glob("step*") if p.is_dir())
    return finished[-1] if finished else None


def save(engine, ckpt_root: Path, step: int, client_state: dict, keep: int, rank: int) -> Path:
    tag = step_tag(step)
    partial = ckpt_root / PARTIAL
    if rank == 0:
        shutil.rmtree(partial / tag, ignore_errors=True)
    _barrier()
    # save_latest=False: DeepSpeed's own `latest` file would be written before our rename.
    engine.save_checkpoint(str(partial), tag=tag, client_state=client_state, save_latest=False)
    _barrier()
    final = ckpt_root / tag
    if rank == 0:
        # Re-saving an existing tag (e.g. resuming a run that had finished): move the old one aside first,
        # so a kill at any moment leaves a complete directory under the name `latest` may point at.
        aside = ckpt_root / PARTIAL / f"{tag}.old"
        shutil.rmtree(aside, ignore_errors=True)
        if final.exists():
            os.replace(final, aside)
        os.replace(partial / tag, final)
        shutil.rmtree(aside, ignore_errors=True)
        write_text_atomic(ckpt_root / "latest", tag)
        _prune(ckpt_root, keep)
    _barrier()
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    tags = sorted(p for p in ckpt_root.glob("step*") if p.is_dir())
    for old in tags[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(engine, ckpt_dir: Path) -> dict:
    """Restore model, optimizer, scheduler into `engine`; return the client state (step, ...)."""
    path, client_state = engine.load_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {ckpt_dir}; delete it or set resume=none")
    return client_state or {}
