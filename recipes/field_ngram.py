"""The learning-free N-gram draft on the field benchmark: the baseline row of docs/lab/field_families.md.

`specdraft field` judges exports only; the N-gram draft has none (`specdraft eval --method ngram`). This runs the
field benchmark's own exact path (eval/field/simulation.py: exact_rows, one prompt at a time through the unchanged
decoder loop against the stored answers, the field cache of the base's pass shared with every draft that reads no
aux layers) with the N-gram drafter, and writes the same report files (field.json, field.md, rows-0.jsonl):

    .venv/bin/python recipes/field_ngram.py --shape chain4 --out runs/ngram-field/field-chain4   # prompt lookup, 4
    .venv/bin/python recipes/field_ngram.py --shape tree --out runs/ngram-field/field-tree       # k=10 x w=10 mixed

Shapes: `chain4` = one prompt-lookup row of up to 4 tokens (what vLLM and llama.cpp serve as n-gram drafting:
strategy longest_match, k = 1, w = 4); `tree` = the eval default, 10 rows x 10 tokens from context n-grams and the
model's bigram table (strategy mixed); `rows4x4` = the same with 4 rows x 4 tokens, 16 nodes (the learned
families' tree budget). fp32, all stored answers unless --num-prompts (each set's first N). Rows are
written as they finish, so a killed run resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"chain4": {"k": 1, "w": 4, "strategy": "longest_match"}, "tree": {},
          "rows4x4": {"k": 4, "w": 4}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default="datasets/smollm2-field-refs")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="chain4")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=0, help="each set's first N (default 0: every stored answer)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from core.jsonl import read_finished_rows
    from eval.engine.backends.choice import choose_backend
    from eval.field.refs import read_refs
    from eval.field.report import field_report, write_field_report
    from eval.field.simulation import exact_rows, first_per_set
    from models.base import load_base
    from models.families.ngram.drafter import build_ngram_drafter

    t0 = time.perf_counter()
    base = load_base("smollm2", dtype="fp32")
    card, refs = read_refs(a.refs, base.fingerprint, None, dtype="float32")
    if a.num_prompts:
        refs = first_per_set(refs, a.num_prompts)
    backend_name, _ = choose_backend("auto", base.model)
    drafter, info = build_ngram_drafter(base, SHAPES[a.shape])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows-0.jsonl"
    done = {r["id"]: r for r in read_finished_rows(rows_path, repair=True)} if rows_path.is_file() else {}
    todo = [r for r in refs if r.id not in done]
    print(f"field ngram {a.shape}: {len(refs)} prompts, {len(todo)} to judge", file=sys.stderr, flush=True)
    with open(rows_path, "a") as f:
        for i in range(0, len(todo), 16):  # a batch of rows at a time: resumable
            part = exact_rows(drafter, todo[i:i + 16], base, backend_name=backend_name)
            for r in todo[i:i + 16]:
                f.write(json.dumps(part[r.id]) + "\n")
                done[r.id] = part[r.id]
            f.flush()
            print(f"  {len(done)}/{len(refs)} {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    rows = [done[r.id] for r in refs]
    meta = {"draft": f"ngram ({a.shape})", "family": "ngram", "shape": a.shape, "dtype": "float32",
            "backend": backend_name, "refs": str(a.refs), "refs_sha256": card["data_sha256"],
            "base": card["base"], "tuning": None, "seconds": round(time.perf_counter() - t0, 1),
            "threads": torch.get_num_threads(), "simulated": True, "path": "exact", "lockstep": 0,
            "prompts_chosen": f"each set's first {a.num_prompts}" if a.num_prompts else "all",
            "stored_prompts": int(card["prompts"]), "max_new_tokens": card["max_new_tokens"],
            "command": "python recipes/field_ngram.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            **{k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))}}
    report = field_report(rows, meta)
    write_field_report(out, report)
    print(f"wrote {out}/field.json: mean over sets {report['mean_over_sets']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
