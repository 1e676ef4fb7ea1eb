"""Stale locks of torch's JIT extension builds (torch.utils.cpp_extension), which DeepSpeed uses for its CPU ops.

Why: `deepspeed.init_distributed` on a CPU builds (or only loads) its shared-memory op, holding a lock file
`<TORCH_EXTENSIONS_DIR>/<op>/lock` while it does. A process killed in that window (SIGKILL, a killed process group)
leaves the file behind, and every later run waits for it forever, silently (torch's FileBaton polls for the file
to go away). A lock is stale when no process is building in that directory (the compiler and ninja run with it as
their working directory) and it is older than a build's start-up.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

STARTUP_S = 120.0  # from taking the lock to starting ninja in the build dir: Python work, seconds at most


def extensions_root() -> Path:
    """Where torch builds JIT extensions, as torch.utils.cpp_extension._get_build_directory decides:
    TORCH_EXTENSIONS_DIR as it is, else torch's default root / py<XY><abiflags>_<rocm..|cu..|cpu>."""
    import sys

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def _building_in(directory: Path) -> bool:
    """Whether some process (ninja, the compiler) has `directory` as its working directory."""
    target = os.path.realpath(directory)
    for pid in os.listdir("/proc"):  # the caller checked that there is a /proc
        if not pid.isdigit():
            continue
        try:
            if os.path.realpath(f"/proc/{pid}/cwd") == target:
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def clear_stale_build_locks(root: Path | None = None, startup_s: float = STARTUP_S,
                            now: float | None = None) -> list[Path]:
    """Delete the stale `lock` files under `root` (default: extensions_root()); returns the deleted paths, each also
    logged as a warning. A lock that some build may still hold is left alone."""
    root = extensions_root() if root is None else Path(root)
    if not root.is_dir() or not os.path.isdir("/proc"):  # no /proc: nothing tells a live build from a dead one
        return []
    now = time.time() if now is None else now
    cleared = []
    for lock in sorted(root.glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue
        if age < startup_s or _building_in(lock.parent):
            continue
        try:
            lock.unlink()
        except OSError:
            continue
        log.warning("removed %s: a torch extension build lock %.0f min old with no build running (a run killed while "
                    "it built this op); runs would otherwise wait for it forever", lock, age / 60)
        cleared.append(lock)
    return cleared
