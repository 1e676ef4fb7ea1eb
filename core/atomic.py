"""Writes that a kill, a full disk or a second process never leave half done: a temp file (or directory) next
to the target, renamed into place. Readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temp file in the same directory (rename is atomic there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _chmod_file_like_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """For writers that want a file name (safetensors' save_file, matplotlib's savefig): yields a temp path next
    to `path` and renames it into place when the block ends without error; the temp file is removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer (two processes or threads never share a temp file); the suffix is kept because some
    # writers add one when it is missing (numpy's savez: .npz).
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _chmod_file_like_umask(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, binary: bool = False):
    """`with atomic_open(path) as f: f.write(...)`: an open temp file that takes `path`'s name when the block ends
    without error (text mode writes UTF-8)."""
    with atomic_path(path) as tmp, open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
        yield f


def write_dir_atomic(out_dir: str | os.PathLike, files: dict[str, Callable[[Path], None]]) -> Path:
    """A directory of files written whole or not at all: each `files[name](path)` writes one file into a temp dir
    next to `out_dir`, which then replaces `out_dir` (an existing one is moved aside first, then removed)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, write in files.items():
            write(tmp / name)
        _chmod_tree_like_umask(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _chmod_file_like_umask(path: Path) -> None:
    """mkstemp's files are private (0600): give the file what a plain open() would."""
    os.chmod(path, 0o666 & ~_umask())


def _chmod_tree_like_umask(directory: Path) -> None:
    """mkdtemp (0700) and safetensors' temp files (0600) are private; give the finished dir the
    permissions a plain mkdir/open would have, so a shared cache is readable by others."""
    umask = _umask()
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def atomic_build_dir(final: Path, is_valid: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """Make sure `final` is a complete, valid directory, building it at most once across processes.

    `build(tmp)` fills a fresh temp dir next to `final`, which is then renamed into place: readers
    never see a half-written `final`. A lock file serialises builders (two deepspeed ranks starting
    together: one converts, the other waits and then reuses its result); if locking is unsupported
    (some network filesystems) both build and the rename still keeps `final` whole -- the loser's
    rename fails and it uses the winner's directory. A stale `final` (is_valid False) is replaced.
    """
    if is_valid(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_valid(final):  # someone else built it while we waited for the lock
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            _chmod_tree_like_umask(tmp)
            if is_valid(final):  # a builder that could not take the lock finished first: use its dir
                return final
            if final.exists():  # stale or half-deleted: move it aside (rename is atomic), then drop it
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=final.parent))
                with contextlib.suppress(OSError):
                    os.rename(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not is_valid(final):  # lost the race to a builder that did not hold the lock
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final

