"""Atomic, resumable DeepSpeed checkpoints under runs/<run>/checkpoints/<tag>/.

Every rank writes its shard into checkpoints/.partial/<tag>/; after a barrier rank 0 renames that to
checkpoints/<tag>/ and only then points checkpoints/latest at it. A run killed mid-save therefore
leaves the previous checkpoint and `latest` intact; the half-written directory is removed next time.

Each finished checkpoint lists its files and their sizes (FILES_MANIFEST). Resuming tries the checkpoint
`latest` names, then the older ones, newest first: a damaged `latest` pointer, a file cut short or a checkpoint
DeepSpeed cannot load is skipped with a warning naming it, and the run continues from the newest good one
(`train.keep_checkpoints`, default 2, keeps one to fall back to).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from core.atomic import write_text_atomic

PARTIAL = ".partial"
FILES_MANIFEST = "specdraft_files.json"  # {relative path: bytes} of every file of a finished checkpoint
log = logging.getLogger("specdraft.train")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The directory `latest` points at; else the newest finished step directory (every `step*` directory
    got there by an atomic rename, so each is complete); None when there is none."""
    candidates = resume_candidates(ckpt_root)
    return candidates[0] if candidates else None


def resume_candidates(ckpt_root: Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one `latest` names, then every other finished one, newest
    first. A `latest` that is unreadable or names no checkpoint is reported and skipped."""
    finished = sorted((p for p in ckpt_root.glob("step*") if p.is_dir()), reverse=True)
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        try:
            target = ckpt_root / pointer.read_text(encoding="utf-8").strip()
            ok = target.is_dir() and target.parent == ckpt_root and target.name.startswith("step")
        except (OSError, UnicodeDecodeError, ValueError):
            ok = False
        if ok:
            return [target, *[p for p in finished if p != target]]
        if finished:
            log.warning("%s is damaged (it names no finished checkpoint); falling back to the newest one, %s",
                        pointer, finished[0].name)
    return finished


def check_files(ckpt_dir: Path) -> str | None:
    """What is wrong with a finished checkpoint's files (missing, or another size than when saved), else None.
    A checkpoint saved before FILES_MANIFEST existed is not checked."""
    manifest = ckpt_dir / FILES_MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{manifest.name} is damaged ({err})"
    for rel, size in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, {size} when saved (cut short or replaced)"
    return None


def load_newest_good(engine, candidates: list[Path]) -> tuple[Path, dict]:
    """Load the first checkpoint of `candidates` that is whole and that DeepSpeed can load; warn about each one
    skipped. Returns (its directory, its client state)."""
    problems = []
    for ckpt in candidates:
        why = check_files(ckpt)
        if why is None:
            try:
                return ckpt, load(engine, ckpt)
            except Exception as err:  # noqa: BLE001 - torch/DeepSpeed raise many types for a damaged file
                why = f"{type(err).__name__}: {str(err)[:200]}"
        problems.append(f"{ckpt.name}: {why}")
        log.warning("checkpoint %s cannot be used (%s); trying the next older one", ckpt, why)
    raise ValueError(f"no usable checkpoint in {candidates[0].parent if candidates else '?'} "
                       f"({'; '.join(problems)}); delete the damaged ones, or start over with resume=none")


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
        files = {str(f.relative_to(partial / tag)): f.stat().st_size for f in sorted((partial / tag).rglob("*"))
                 if f.is_file()}
        write_text_atomic(partial / tag / FILES_MANIFEST, json.dumps(files, indent=1) + "\n")
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
    for old in tags[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load(engine, ckpt_dir: Path) -> dict:
    """Restore model, optimizer, scheduler into `engine`; return the client state (step, ...)."""
    path, client_state = engine.load_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {ckpt_dir}; delete it or set resume=none")
    return client_state or {}


# What a checkpoint means depends on these (the draft's shape, its data and their order, the loss, the base, the
# optimizer whose state it holds): a resumed run must not change them. Anything else (the schedule, the budget,
# logging, threads) may change.
RESUME_FIXED = ("base.", "data.source", "data.max_records", "data.max_length", "data.val_fraction",
                "data.min_assistant_tokens", "data.seed", "data.self_distill", "data.chat_template",
                "data.hidden_cache_dtype", "draft.", "loss.", "train.seed", "train.global_batch_size",
                "train.optimizer", "train.sequence_parallel", "deepspeed.zero_stage")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k != "extra":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_config_changes(saved: dict, now: dict) -> list[str]:
    """`key: saved -> now` for every RESUME_FIXED key whose value differs between the run directory's
    config.yaml and the config resuming it."""
    a, b = _flatten(saved), _flatten(now)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k.startswith(RESUME_FIXED) and a.get(k) != b.get(k)]
