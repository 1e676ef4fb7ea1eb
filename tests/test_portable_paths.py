"""What the repository ships for readers on other machines (drafts/, docs/, datasets/) names no path of the machine
that wrote it: a serving line in a draft's NOTES.md or tuning.json, or a command in a lab page, says
$VLLM_PYTHON, $BASE_DIR, $SCRATCH, ... (explained where they are used), never /root/..., /work/..., /tmp/...."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("drafts", "docs", "datasets")
BINARY_SUFFIXES = {".safetensors", ".xz", ".gz", ".png", ".jpg", ".gguf", ".bin", ".pt", ".npy", ".pdf"}
# A path that starts a word (not the tail of a URL, ~/... or a relative path) under a machine's own directories.
MACHINE_PATH = re.compile(r"(?<![\w.~/$-])((?:/root/|/home/[\w.-]+/|/Users/[\w.-]+/|/work/|/tmp/(?=[\w.-]))"
                          r"[^\s'\"`()<>{},;\\]*)")
# (file, pattern) pairs allowed; each needs its reason. These pages use /tmp/<dir> as a scratch directory the
# reader's own commands create (mkdir -p /tmp/p2, run_dir=/tmp/...), and their owners have not moved them to
# $SCRATCH yet.
ALLOWED = {
    ("docs/howto/gpu_kit.md", "/tmp/"),
    ("docs/lab/serving.md", "/tmp/"),
}


def machine_paths(text: str) -> list[str]:
    return [m.group(1) for m in MACHINE_PATH.finditer(text)]


def shipped_text_files(root: Path = ROOT) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *SCANNED], cwd=root, capture_output=True, check=True)
        files = [root / p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file under the directories
        files = [p for d in SCANNED for p in sorted((root / d).rglob("*")) if p.is_file()]
    texts = []
    for path in files:
        if path.suffix in BINARY_SUFFIXES or not path.is_file():
            continue
        with open(path, "rb") as f:
            if b"\0" in f.read(8192):
                continue
        texts.append(path)
    return texts


def test_shipped_files_name_no_machine_path():
    files = shipped_text_files()
    # a shipped draft's export config and the lab notes: the scan reads the shipped files, not an empty list
    assert any(p.parts[-2:] == ("export", "config.json") and "drafts" in p.parts for p in files) and any(
        p.parts[-2:] == ("lab", "benchmarks.md") for p in files), "the scan missed the shipped files"
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        allowed = [pattern for file, pattern in ALLOWED if file == rel]
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits = [h for h in machine_paths(line) if not any(h.startswith(p) for p in allowed)]
            if hits:
                found.append(f"{rel}:{i}: {', '.join(hits)}: {line.strip()[:160]}")
    assert not found, ("absolute paths of one machine in shipped files; use a placeholder ($SCRATCH, $VLLM_PYTHON, "
                       "...) or a path relative to the repository:\n" + "\n".join(found))


@pytest.mark.parametrize("line,paths", [
    ("/root/.cache/specdraft/llamacpp/11434.0.0/build/bin/llama-server -m x",
     ["/root/.cache/specdraft/llamacpp/11434.0.0/build/bin/llama-server"]),
    ("VLLM_CPU_KVCACHE_SPACE=1 /work/main/.venv-vllm/bin/python -m vllm", ["/work/main/.venv-vllm/bin/python"]),
    ('"model": "/home/alice/runs/x"', ["/home/alice/runs/x"]),
    ("git clone /work/main /tmp/fresh-demo", ["/work/main", "/tmp/fresh-demo"]),
    ("open `/Users/bob/specdraft`", ["/Users/bob/specdraft"]),
    ("https://github.com/org/work/tmp/x, ~/.cache/specdraft, runs/root/x, /tmp alone", []),
    ('"$VLLM_PYTHON" --model "$BASE_DIR"; git clone $REPO $SCRATCH/fresh-demo', []),
])
def test_the_pattern(line, paths):
    assert machine_paths(line) == paths
