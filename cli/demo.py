"""`specdraft demo`: the main job on this machine, end to end, on the real small base.

1. train a one-head Hydra draft on SmolLM2-135M-Instruct + a ShareGPT subset (configs/hydra.yaml +
   configs/demo.yaml): the frozen base runs once over the data into the hidden-state cache, then several
   cheap epochs train the head from it, with a wall-time budget so it fits a laptop CPU;
2. print the held-out per-head accuracy table (written by training to runs/demo/heldout.json);
3. decode MT-bench prompts with the bundled speculative decoder (configs/eval/demo.yaml: dtype=fast, i.e. bf16 on
   CPUs with bf16 matrix instructions and fp32 elsewhere, a 3-node tree
   of the head's top-3), with own-AR and transformers-generate baselines side by side in the same run, and
   print acceptance length (with the tree size), both speedups and the losslessness verdict in words;
4. (bf16 only; an fp32 run is exact already) an exact fp32 check on a few prompts: there the speculative output
   must equal plain greedy decoding token for token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from cli import CONFIGS

RECIPE = "hydra.yaml"  # the family recipe configs/demo.yaml is stacked on


def _family(cfg) -> str:
    return {"hydra": "Hydra++" if cfg.draft.prefix_layer else "Hydra"}.get(cfg.draft.family, cfg.draft.family)


def run_demo(overrides: list[str]) -> int:
    from train.config import load_train_config
    from train.loop import train

    cfg = load_train_config([str(CONFIGS / RECIPE), str(CONFIGS / "demo.yaml")], overrides)
    t0 = time.perf_counter()
    heads = f"{cfg.draft.num_heads} {_family(cfg)} head{'s' if cfg.draft.num_heads > 1 else ''}"
    cache = "the base's hidden states cached once, then " if cfg.data.hidden_cache else ""
    print(f"[demo 1/4] training {heads} on {cfg.base.path} with {cfg.data.max_records} ShareGPT conversations "
          f"({cache}{cfg.train.epochs:g} epochs, budget {cfg.train.max_minutes:g} min of training)", flush=True)
    run_dir = train(cfg)
    t_train = time.perf_counter() - t0
    evaluate_demo_run(run_dir)
    print(f"demo finished in {(time.perf_counter() - t0) / 60:.1f} min (training incl. set-up "
          f"{t_train / 60:.1f} min); run directory {run_dir}")
    return 0


def evaluate_demo_run(run_dir: Path) -> None:
    """Steps 2-4 of the demo on a finished run: held-out table, MT-bench decoding, exact check, summary."""
    from core.hardware import resolve_device, resolve_dtype
    from eval.harness.config import load_eval_config
    from eval.harness.lossless import format_verdict
    from eval.harness.runner import eval_export, format_summary
    from train.heldout import format_heldout_table

    heldout = run_dir / "heldout.json"
    print("[demo 2/4] held-out accuracy of the draft (teacher forced, next to a trivial predictor)", flush=True)
    if heldout.exists():
        print(format_heldout_table(json.loads(heldout.read_text())), flush=True)
    eval_cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")])
    # dtype=fast: bf16 on CPUs with bf16 matrix instructions, fp32 elsewhere (then the run itself is the exact check)
    dtype = resolve_dtype(eval_cfg.dtype, resolve_device(eval_cfg.device))
    print(f"[demo 3/4] speculative decoding on {eval_cfg.num_prompts} {eval_cfg.dataset} prompts "
          f"({eval_cfg.max_new_tokens} new tokens each, {str(dtype).removeprefix('torch.')}), own AR and HF generate "
          "in the same run", flush=True)
    report, out_dir = eval_export(run_dir / "export", eval_cfg)
    exact = None
    if dtype != torch.float32:
        check_cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")], [
            "dtype=fp32", "num_prompts=2", "max_new_tokens=32", "hf_baseline=false", "warmup_tokens=4",
            "name=mtbench-demo-fp32-check"])
        print(f"[demo 4/4] exact losslessness check in fp32 on {check_cfg.num_prompts} prompts", flush=True)
        exact, _ = eval_export(run_dir / "export", check_cfg)
    else:
        print("[demo 4/4] the decoding above ran in fp32 (this CPU has no fast bf16): its verdict is the exact "
              "losslessness check", flush=True)

    print("\n" + "=" * 100)
    print(format_summary(report, out_dir))
    if exact is not None:
        print(f"  fp32 check: {format_verdict(exact)}")
