"""`specdraft demo`: the main job on this machine, end to end, on the real small base.

1. train Medusa heads on SmolLM2-135M-Instruct + a ShareGPT subset (configs/medusa.yaml + configs/demo.yaml,
   with a wall-time budget so it fits a laptop CPU);
2. print the held-out per-head accuracy table (written by training to runs/demo/heldout.json);
3. evaluate the export with the bundled speculative decoder on MT-bench prompts (configs/eval/demo.yaml),
   with own-AR and transformers-generate baselines in the same run, and print acceptance length and speedups.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from train.cli import CONFIGS


def run_demo(overrides: list[str]) -> int:
    from train.config import load_train_config
    from train.loop import train

    cfg = load_train_config([str(CONFIGS / "medusa.yaml"), str(CONFIGS / "demo.yaml")], overrides)
    t0 = time.perf_counter()
    print(f"[demo 1/3] training {cfg.draft.num_heads} Medusa heads on {cfg.base.path} with "
          f"{cfg.data.max_records} ShareGPT conversations (budget {cfg.train.max_minutes:g} min of training)",
          flush=True)
    run_dir = train(cfg)
    t_train = time.perf_counter() - t0
    evaluate_demo_run(run_dir)
    print(f"demo finished in {(time.perf_counter() - t0) / 60:.1f} min (training incl. set-up "
          f"{t_train / 60:.1f} min); run directory {run_dir}")
    return 0


def evaluate_demo_run(run_dir: Path) -> None:
    """Steps 2-3 of the demo on a finished run: decode MT-bench prompts, check exactness, print the tables."""
    from eval.config import load_eval_config
    from eval.runner import eval_export, format_summary
    from train.heldout import format_heldout_table

    eval_cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")])
    print(f"[demo 2/3] speculative decoding on {eval_cfg.num_prompts} {eval_cfg.dataset} prompts "
          f"({eval_cfg.max_new_tokens} new tokens each), own AR and HF generate in the same run", flush=True)
    report, out_dir = eval_export(run_dir / "export", eval_cfg)
    exact = None
    if eval_cfg.dtype != "fp32":
        # In bf16 a 16-token tree forward and a 1-token forward round differently, so greedy near-ties can
        # flip and outputs drift apart; that is precision, not the algorithm. Check exactness in fp32.
        check_cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")], [
            "dtype=fp32", "num_prompts=3", "max_new_tokens=48", "hf_baseline=false", "name=mtbench-demo-fp32-check"])
        print(f"[demo 3/3] losslessness check in fp32 on {check_cfg.num_prompts} prompts", flush=True)
        exact, _ = eval_export(run_dir / "export", check_cfg)

    print("\n" + "=" * 100)
    heldout = run_dir / "heldout.json"
    if heldout.exists():
        print(format_heldout_table(json.loads(heldout.read_text())))
    print(format_summary(report, out_dir))
    if exact is not None:
        print(f"  ({eval_cfg.dtype}: tree and single-token forwards round differently, so greedy near-ties can flip; "
              f"in fp32 the speculative output equals plain greedy decoding on "
              f"{round(exact['lossless_fraction'] * exact['num_prompts'])}/{exact['num_prompts']} prompts)")
