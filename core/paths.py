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
