"""(k, w) sweep of the N-gram drafter (docs/families/ngram.md): acceptance length and
speedup over own AR on the same engine, written as sweep.json, sweep.md and sweep_heatmap.png.

Used by `specdraft eval --method ngram sweep_k=[1,2,4] sweep_w=[1,2,3]` and by
bench/ngram_sweep.py. Greedy only; every cell is also checked token-identical to AR (reported, not asserted).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.hardware import resolve_device
from eval.engine.backends.choice import make_backend
from eval.engine.decoder import autoregressive_generate, eos_ids, speculative_generate
from eval.harness.prompts import config_prompts
from models.base import load_base
from models.families.ngram.drafter import NgramDrafter, ngram_options
from models.families.ngram.model import bigram_table_for


def _run(gen_fn, prompts):
    """-> (new tokens, decode seconds, base steps, token lists), the prefill's token excluded."""
    n = secs = steps = 0
    outs = []
    for p in prompts:
        g = gen_fn(p.input_ids)
        n, secs, steps = n + len(g.tokens) - 1, secs + g.decode_time, steps + g.base_steps
        outs.append(g.tokens)
    return n, secs, steps, outs


def sweep(cfg, ks: list[int], ws: list[int]) -> dict:
    opts = ngram_options(cfg.extra)
    base = load_base(cfg.base_path or cfg.method_base, dtype=cfg.dtype, device=resolve_device(cfg.device))
    table, _, _ = bigram_table_for(base, max(max(ks), int(opts["table_k"]))) if opts["strategy"] != "context" \
        else (None, None, None)
    backend, eos = make_backend(cfg.backend, base.model), eos_ids(base.model, base.tokenizer)
    prompts = config_prompts(cfg, base.tokenizer)
    new = cfg.max_new_tokens
    autoregressive_generate(backend, prompts[0].input_ids, max_new_tokens=8, eos_ids=eos)  # warm-up
    ar_n, ar_s, _, ar_out = _run(lambda ids: autoregressive_generate(backend, ids, max_new_tokens=new,
                                                                     eos_ids=eos), prompts)
    cells = []
    for k in ks:
        for w in ws:
            d = NgramDrafter(k, w, int(opts["q"]), opts["strategy"], table)
            n, s, steps, outs = _run(lambda ids, d=d: speculative_generate(backend, d, ids, max_new_tokens=new,
                                                                             eos_ids=eos), prompts)
            cells.append({"k": k, "w": w, "acceptance_length": n / steps, "tokens_per_second": n / s,
                          "speedup": (n / s) / (ar_n / ar_s), "lossless": outs == ar_out})
            print(f"k={k:3d} w={w:3d}  tau={cells[-1]['acceptance_length']:.2f}  speedup={cells[-1]['speedup']:.2f}",
                  flush=True)
    return {"base_model": base.name, "dtype": str(base.dtype).removeprefix("torch."), "dataset": cfg.dataset,
            "num_prompts": len(prompts), "max_new_tokens": new, "strategy": opts["strategy"],
            "ar_tokens_per_second": ar_n / ar_s, "threads": torch.get_num_threads(), "cells": cells}


def write(result: dict, ks: list[int], ws: list[int], out: Path) -> None:
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    cell = {(c["k"], c["w"]): c for c in result["cells"]}
    lines = [f"# N-gram ({result['strategy']}) sweep: {result['base_model']} {result['dtype']}, "
             f"{result['num_prompts']} prompts x {result['max_new_tokens']} tokens, own AR "
             f"{result['ar_tokens_per_second']:.1f} tok/s", "", "acceptance length / speedup vs own AR", "",
             "| k \\ w | " + " | ".join(map(str, ws)) + " |", "|---" * (len(ws) + 1) + "|"]
    for k in ks:
        lines.append(f"| {k} | " + " | ".join(f"{cell[k, w]['acceptance_length']:.2f} / {cell[k, w]['speedup']:.2f}x"
                                             for w in ws) + " |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    fig = Figure(figsize=(1.2 * len(ws) + 2, 0.8 * len(ks) + 2))
    axes = fig.subplots(1, 2)
    for ax, key in zip(axes, ("acceptance_length", "speedup"), strict=True):
        grid = [[cell[k, w][key] for w in ws] for k in ks]  # [len(ks), len(ws)]
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(ws)), [str(w) for w in ws])
        ax.set_yticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("w (tokens per row)")
        ax.set_ylabel("k (rows)")
        ax.set_title(key.replace("_", " "))
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "sweep_heatmap.png", dpi=100)
