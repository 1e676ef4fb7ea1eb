"""What regeneration writes against what training reads: generated tokens per training token for regenerated files
of the same conversations, e.g. without a token budget and with one at the training length.

    specdraft regenerate --max-records 500 --token-budget 0 --store runs/bench-budget/full [same engine settings]
    python bench/regen_budget.py --file full=runs/bench-budget/full \
        --file budget512=datasets/smollm2-sharegpt-onpolicy --max-records 500 --max-length 512

Each input is an on-policy store (`specdraft regenerate --store DIR`: it keeps every record's generated-token
count). Per store, over its first --max-records source conversations: the tokens the engine generated, the rows
training keeps after cutting at --max-length (data/dataset.py's rendering and masks, as `specdraft train` does),
the supervised tokens inside that window, and the ratio generated / supervised (1.0 = nothing generated is thrown
away). Counts tokens, times nothing. Prints a Markdown table; --json is written through bench/harness.py
(Results): one row per store, on disk as each finishes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, ratio  # noqa: E402


def generated_per_record(store: Path, n: int) -> dict[str, int]:
    """{record id: generated tokens} of the first n source conversations of a store."""
    from data.onpolicy_store import is_store, read_store

    if not is_store(store):
        raise SystemExit(f"{store}: not an on-policy store (a directory with card.json); regenerate with --store")
    card, lines = read_store(store)
    if len(lines) < n:
        raise SystemExit(f"{store} holds {len(lines)} conversations, fewer than --max-records {n}")
    return {f"sharegpt-{x['i']}": int(x.get("g", 0)) for x in lines[:n] if "a" in x}


def training_tokens(store: Path, ids: set[str], tokenizer, max_length: int) -> dict:
    """Rows and supervised tokens training reads from the records `ids` of a store."""
    from core.paths import default_cache_dir
    from data.dataset import build_eval_rows
    from data.onpolicy_store import materialize
    from data.sharegpt import read_sharegpt

    path = materialize(store, read_sharegpt, default_cache_dir())
    keep = [line for line in path.read_text(encoding="utf-8").split("\n") if line and json.loads(line)["id"] in ids]
    with tempfile.TemporaryDirectory() as tmp:
        sub = Path(tmp) / "subset.jsonl"
        sub.write_text("\n".join(keep) + "\n", encoding="utf-8")
        rows = build_eval_rows(tokenizer, str(sub), max_length=max_length, cache_dir=Path(tmp) / "cache")
        return {"rows": len(rows), "window_tokens": sum(len(r["input_ids"]) for r in rows),
                "supervised_tokens": sum(sum(r["loss_mask"]) for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", action="append", required=True, metavar="NAME=PATH",
                   help="an on-policy store directory (specdraft regenerate --store)")
    p.add_argument("--max-records", type=int, default=500, help="the first N source conversations of each")
    p.add_argument("--max-length", type=int, default=512, help="the training length (data.max_length)")
    p.add_argument("--base", default="smollm2", help="whose tokenizer and chat template render the rows")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from models.base import load_base

    tok = load_base(args.base, dtype="fp32").tokenizer
    results = Results(args.json, {"max_records": args.max_records, "max_length": args.max_length, "files": {}})
    rows = results.data["files"]
    for spec in args.file:
        name, _, path = spec.partition("=")
        with results.arm("files", name) as row:
            gen = generated_per_record(Path(path), args.max_records)
            t = training_tokens(Path(path), set(gen), tok, args.max_length)
            row.update({"path": path, "records": len(gen), "generated_tokens": sum(gen.values()), **t,
                        "generated_per_supervised": ratio(sum(gen.values()), max(1, t["supervised_tokens"]), 4)})
    print(f"| file | records | generated tokens | training rows | tokens in the {args.max_length}-token window | "
          "supervised tokens | generated / supervised |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['records']} | {r['generated_tokens']:,} | {r['rows']} | {r['window_tokens']:,} | "
              f"{r['supervised_tokens']:,} | {r['generated_per_supervised']:.2f} |")


if __name__ == "__main__":
    main()
