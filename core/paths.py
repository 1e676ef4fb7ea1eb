"""Where specdraft keeps what it builds once and reuses (converted bases, tokenized data, hidden-state caches,
bigram tables, regenerated data): `$SPECDRAFT_CACHE`, else ~/.cache/specdraft."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECDRAFT_CACHE"
# The checkout (`pip install -e .` is the supported set-up): default configs and the vLLM venv are found from it.
REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdraft")


def repo_relative(arg: str) -> str:
    """`arg` as a command recorded in a tracked file should show it: an absolute path inside a git checkout (this one
    or another, e.g. a worktree's output written into the main checkout) relative to that checkout's root, so no
    machine's path is kept; anything else unchanged."""
    p = Path(arg)
    if not p.is_absolute():
        return arg
    for parent in p.parents:
        if (parent / ".git").exists():
            return str(p.relative_to(parent))
    return arg
