"""Random-weight GGUFs of real LLaMA shapes, for timing llama.cpp on bases people run on CPUs (no acceptance is
claimed from them: the weights are noise). Runs in the converter venv (`make llamacpp`), whose gguf-py knows the
EAGLE-3 architecture:

    .venv-llamacpp/bin/python bench/llamacpp_random_gguf.py --shape llama-8b --out-dir DIR [--base-type q8_0]

Writes DIR/<shape>-base-<type>.gguf (architecture llama, the Llama-3 tokenizer from llama.cpp's own
models/ggml-vocab-llama-bpe.gguf) and DIR/<shape>-eagle3-f16.gguf (one EAGLE-3 layer of the base's shape reading
three base layers, a 32,000-token draft vocabulary as the published Llama-3.1-8B EAGLE-3 drafts use). Tensors
are generated while the file is written, a chunk at a time: an 8B Q8_0 file (8.5 GB) never sits in memory.
Skips files that exist; each file's write is timed by bench/harness.py (time_once), whose only project import is
core/atomic.py, which the converter venv can load from the checkout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, in the converter venv

from bench.harness import time_once  # noqa: E402

# Llama-3.2-1B and Llama-3.1-8B (their config.json values)
SHAPES = {
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, tied=True),
    "llama-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, tied=False),
}
VOCAB = 128256
DRAFT_VOCAB = 32000
ROPE_THETA = 500000.0
EPS = 1e-5
TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "f16": GGMLQuantizationType.F16}


class RandomTensor:
    """Stands in for a numpy array in GGUFWriter: knows its byte size and writes random blocks of `qtype` when
    the writer asks (`tofile`), in chunks. Weights ~ N(0, 0.02)-sized; norms are ones."""

    CHUNK_BLOCKS = 1 << 20

    def __init__(self, rows: int, cols: int, qtype: GGMLQuantizationType, rng: np.random.Generator,
                 ones: bool = False):
        self.rows, self.cols, self.qtype, self.rng, self.ones = rows, cols, qtype, rng, ones
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        if cols % block:
            raise ValueError(f"a row of {cols} does not split into {qtype.name} blocks of {block}")
        self.blocks = rows * cols // block
        self.block_bytes = type_bytes
        self.nbytes = self.blocks * type_bytes

    def tofile(self, fout) -> None:
        for lo in range(0, self.blocks, self.CHUNK_BLOCKS):
            n = min(self.CHUNK_BLOCKS, self.blocks - lo)
            fout.write(self._chunk(n).tobytes())

    def _chunk(self, n: int) -> np.ndarray:
        q = self.qtype
        if q == GGMLQuantizationType.F32:
            return np.ones(n, np.float32) if self.ones else (self.rng.standard_normal(n, np.float32) * 0.02)
        if q == GGMLQuantizationType.F16:
            return (self.rng.standard_normal(n, np.float32) * 0.02).astype(np.float16)
        out = self.rng.integers(0, 256, size=(n, self.block_bytes), dtype=np.uint8)
        # each block starts with its fp16 scale d; random int8 / nibbles times d give weights of ~0.02
        d = np.float16(0.02 / 73.0 if q == GGMLQuantizationType.Q8_0 else 0.02 / 4.6)
        out[:, :2] = np.frombuffer(np.full(n, d, np.float16).tobytes(), np.uint8).reshape(n, 2)
        return out


def _tokenizer_fields(writer: GGUFWriter, vocab_file: Path) -> None:
    """Copy the Llama-3 tokenizer (tokens, types, merges, special ids) from llama.cpp's vocab-only GGUF."""
    r = GGUFReader(str(vocab_file))

    def val(key):
        return r.fields[key].contents()

    writer.add_tokenizer_model(val("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(val("tokenizer.ggml.pre"))
    writer.add_token_list(val("tokenizer.ggml.tokens"))
    writer.add_token_types(val("tokenizer.ggml.token_type"))
    writer.add_token_merges(val("tokenizer.ggml.merges"))
    writer.add_bos_token_id(int(val("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(val("tokenizer.ggml.eos_token_id")))


def _common(writer: GGUFWriter, s: dict, layers: int, vocab: int) -> None:
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_vocab_size(vocab)


def _tensor(writer: GGUFWriter, name: str, out_rows: int, in_cols: int, qtype, rng, ones: bool = False) -> None:
    """A [out_rows, in_cols] weight (GGUF lists it as ne = [in_cols, out_rows])."""
    t = RandomTensor(out_rows, in_cols, qtype, rng, ones)
    shape = [out_rows, in_cols] if out_rows > 1 else [in_cols]
    writer.add_tensor_info(name, shape, np.dtype(np.float32), t.nbytes, raw_dtype=qtype)
    writer.tensors[-1][name].tensor = t


def _layer(writer: GGUFWriter, i: int, s: dict, qtype, rng, attn_in: int) -> None:
    d, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    f32 = GGMLQuantizationType.F32
    _tensor(writer, f"blk.{i}.attn_norm.weight", 1, d, f32, rng, ones=True)
    _tensor(writer, f"blk.{i}.attn_q.weight", q, attn_in, qtype, rng)
    _tensor(writer, f"blk.{i}.attn_k.weight", kv, attn_in, qtype, rng)
    _tensor(writer, f"blk.{i}.attn_v.weight", kv, attn_in, qtype, rng)
    _tensor(writer, f"blk.{i}.attn_output.weight", d, q, qtype, rng)
    _tensor(writer, f"blk.{i}.ffn_norm.weight", 1, d, f32, rng, ones=True)
    _tensor(writer, f"blk.{i}.ffn_gate.weight", s["ffn"], d, qtype, rng)
    _tensor(writer, f"blk.{i}.ffn_up.weight", s["ffn"], d, qtype, rng)
    _tensor(writer, f"blk.{i}.ffn_down.weight", d, s["ffn"], qtype, rng)


def write_base(path: Path, shape: str, qtype, vocab_file: Path, seed: int = 0) -> None:
    s, rng = SHAPES[shape], np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random {shape}")
    _common(w, s, s["layers"], VOCAB)
    w.add_file_type(int(qtype))
    _tokenizer_fields(w, vocab_file)
    _tensor(w, "token_embd.weight", VOCAB, s["hidden"], qtype, rng)
    for i in range(s["layers"]):
        _layer(w, i, s, qtype, rng, attn_in=s["hidden"])
    _tensor(w, "output_norm.weight", 1, s["hidden"], GGMLQuantizationType.F32, rng, ones=True)
    if not s["tied"]:
        _tensor(w, "output.weight", VOCAB, s["hidden"], qtype, rng)
    _write(w)


def write_eagle3(path: Path, shape: str, vocab_file: Path, seed: int = 1) -> None:
    """The layout llama.cpp's converter gives our EAGLE-3 exports: fc [3d -> d], one layer whose q/k/v read
    [embedding; hidden] (2d wide) with a second input norm (attn_norm_2), its own norm and LM head over the draft
    vocabulary, and d2t (draft id -> target id offset; zeros: the first DRAFT_VOCAB target ids)."""
    s, rng = SHAPES[shape], np.random.default_rng(seed)
    f16, f32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    L = s["layers"]
    w = GGUFWriter(str(path), "eagle3")
    w.add_name(f"random {shape} EAGLE-3")
    w.add_array("eagle3.target_layers", [2, L // 2, L - 3])
    w.add_uint32("eagle3.target_hidden_size", s["hidden"])
    w.add_bool("eagle3.norm_before_residual", False)
    w.add_bool("eagle3.norm_before_fc", False)
    _common(w, s, 1, VOCAB)
    w.add_file_type(int(f16))
    _tokenizer_fields(w, vocab_file)
    d = s["hidden"]
    _tensor(w, "fc.weight", d, 3 * d, f16, rng)
    _tensor(w, "blk.0.attn_norm_2.weight", 1, d, f32, rng, ones=True)
    _layer(w, 0, s, f16, rng, attn_in=2 * d)
    _tensor(w, "output.weight", DRAFT_VOCAB, d, f16, rng)
    _tensor(w, "output_norm.weight", 1, d, f32, rng, ones=True)
    d2t = np.zeros(DRAFT_VOCAB, np.int64)
    w.add_tensor("d2t", d2t)
    _write(w)


def _write(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--base-type", choices=sorted(TYPES), default="q8_0")
    p.add_argument("--vocab", required=True, help="llama.cpp's models/ggml-vocab-llama-bpe.gguf")
    a = p.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{a.shape}-base-{a.base_type}.gguf"
    draft = out / f"{a.shape}-eagle3-f16.gguf"
    for path, make in ((base, lambda t: write_base(t, a.shape, TYPES[a.base_type], Path(a.vocab))),
                       (draft, lambda t: write_eagle3(t, a.shape, Path(a.vocab)))):
        if path.is_file():
            print(f"exists: {path}")
            continue
        tmp = path.with_name(path.name + ".tmp")
        _, seconds = time_once(lambda make=make, tmp=tmp: make(tmp))
        tmp.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {seconds:.0f} s")


if __name__ == "__main__":
    main()
