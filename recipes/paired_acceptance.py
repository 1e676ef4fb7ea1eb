"""Acceptance-length differences between the drafts of one `specdraft compare` run, paired by prompt, with a 95 %
bootstrap interval: is a lever's gain or loss more than the prompts' scatter? Reads every setting's samples.jsonl
(one row per prompt: new_tokens, accept_lengths = tokens per verify step) and pools the settings' prompts.

    .venv/bin/python recipes/paired_acceptance.py runs/compare-eagle3-levers levers-base-256-ttt3

AL of a draft = its new tokens over its verify steps (as the compare tables); difference = draft's AL - baseline's on
the same prompts, resampled by prompt (10,000 draws, seed 0).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def per_prompt(samples: Path) -> dict[str, tuple[int, int]]:
    """{setting/prompt id: (new tokens, verify steps)} of one draft's samples.jsonl."""
    out = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        out[f"{samples.parent.parent.name}/{row['id']}"] = (sum(row["accept_lengths"]), len(row["accept_lengths"]))
    return out


def al(rows: list[tuple[int, int]]) -> float:
    return sum(t for t, _ in rows) / max(1, sum(s for _, s in rows))


def main(compare_dir: str, baseline: str, draws: int = 10_000) -> None:
    root = Path(compare_dir)
    drafts: dict[str, dict[str, tuple[int, int]]] = {}
    for samples in sorted(root.glob("*/*/samples.jsonl")):
        drafts.setdefault(samples.parent.name, {}).update(per_prompt(samples))
    if baseline not in drafts:
        sys.exit(f"no draft {baseline!r} in {root}; drafts there: {', '.join(sorted(drafts))}")
    base = drafts[baseline]
    rng = random.Random(0)
    print(f"| draft | prompts | AL | AL - {baseline} | 95 % interval (paired bootstrap) |")
    print("|---|---:|---:|---:|---|")
    for name, rows in sorted(drafts.items()):
        ids = sorted(set(rows) & set(base))
        diff = al([rows[i] for i in ids]) - al([base[i] for i in ids])
        boot = sorted(al([rows[i] for i in pick]) - al([base[i] for i in pick])
                      for pick in ([rng.choice(ids) for _ in ids] for _ in range(draws)))
        lo, hi = boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1]
        print(f"| {name} | {len(ids)} | {al([rows[i] for i in ids]):.3f} | {diff:+.3f} | {lo:+.3f} .. {hi:+.3f} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
