"""The demo's tree, chosen on this machine: `specdraft tune`'s sweep (eval/tune/sweep.py) over the few trees a
one-head draft has, side by side with own AR, before the demo decodes MT-bench with the fastest one.

Why measure instead of fixing one tree: what verifying 2, 3 or 4 tokens costs against a 1-token step depends on the
CPU and the dtype far more than on the draft. On the AVX512-BF16 EPYC a bf16 forward over 4 tokens costs ~1.1 AR
steps, but the same CPU in fp32 pays ~1.3 for 4 tokens and ~0.9 for 2, and an AVX2-only EPYC verifies 4 fp32 tokens
at about one step (bench/demo_costs.py; docs/lab/benchmarks.md, "The demo: the soft loss and a tree chosen per
machine"). The same trained head made 1.20x own AR with its top-3 in bf16 and 0.89x with it in fp32 on one machine,
where its top-1 alone made 1.11x.

The sweep decodes held-out ShareGPT conversations (those after the ones the draft trained on: never the MT-bench
prompts the demo reports), TUNE_PROMPTS x TUNE_TOKENS tokens, REPEATS paired passes against AR per shape, keeps
the shape that beats AR and that no other one beats beyond the noise (eval/choice/stats.py: choose; of trees
the noise cannot separate, the faster measured one: TIE), and re-times it against AR before trusting it
(eval/tune/sweep.py: confirm). The record goes to the export's tuning.json like any `specdraft tune` run, marked
as a quick choice (2 repeats): applied as tuned only by the demo run that made it.
"""

from __future__ import annotations

import time
from pathlib import Path

from cli import CONFIGS

# The trees of a one-head Hydra draft: its top-k for x_{t+2}, k = 1..3 (root + k nodes verified).
DEMO_SHAPES = (
    ("top-1 (2 nodes)", {"tree_choices": [[0]]}),
    ("top-2 (3 nodes)", {"tree_choices": [[0], [1]]}),
    ("top-3 (4 nodes)", {"tree_choices": [[0], [1], [2]]}),
)
TUNE_PROMPTS = 3
TUNE_TOKENS = 48
TUNE_PROMPT_TOKENS = 256  # longer conversations are skipped: each pass prefills every prompt again
# Fewer than `specdraft tune`'s default of 3: the demo's whole run is priced in minutes (cli/demo_plan.py) and the
# sweep is one of its steps. 2 repeats of 3 shapes still pool 3 + 6 degrees of freedom into the noise, and the
# confirmation re-times the winner; what the demo loses is power (a small gain is more often called a tie with AR,
# and the demo then decodes with the top-1 and says so). Under tune's MIN_REPEATS the record is a quick choice
# (eval/choice/record.py: repeats_mark): the demo's own eval applies it, a later `specdraft eval` of the export
# says so in one line and decodes its untuned default.
REPEATS = 2
WARMUP_TOKENS = 4
# Which of the trees that beat AR wins when the noise cannot separate them: the faster measured one. The demo
# reports the speed it reaches, and with 2 repeats a real gain of a bigger tree is often inside the noise (an AMX
# box measured its top-3 at 1.51x AR and took the top-1 as "tied" under `specdraft tune`'s cheaper-wins rule).
TIE = "faster"
# Tokens the sweep decodes: per shape and for the winner's confirmation, REPEATS passes of AR and of the shape over
# the prompts (cli/demo_plan.py prices them like the MT-bench decoding, per token).
TUNE_DECODED_TOKENS = (len(DEMO_SHAPES) + 1) * REPEATS * 2 * TUNE_PROMPTS * TUNE_TOKENS


def tune_demo_tree(export_dir: Path, overrides: list[str], budget_s: float = 320.0,
                   config: Path = CONFIGS / "eval" / "demo.yaml", dataset: str = "sharegpt") -> dict:
    """Sweep DEMO_SHAPES on this machine in the eval's dtype (overrides for `config`, e.g. the plan's dtype) on
    `dataset` (held-out ShareGPT: the conversations after the draft's training ones); write the record to the
    export's tuning.json and return the choice (eval/choice/stats.py: choose), with "tree_choices": the tree the
    demo decodes with (top-1 when no shape beats AR: the demo still shows its draft, and says so)."""
    import torch

    from core.hardware import resolve_device
    from eval.choice.record import machine_info
    from eval.choice.stats import DEFAULT_ALPHA, DEFAULT_MIN_GAIN
    from eval.harness.config import load_eval_config
    from eval.harness.run_dtype import export_decode_dtypes
    from eval.harness.runner import resolve_heldout_skip
    from eval.tune.command import progress_bar
    from eval.tune.ours import OursEngine
    from eval.tune.report import write_export
    from eval.tune.sweep import sweep_engine
    from models.export.load import load_export
    from models.export.specdraft import read_export_config

    sweep = [f"num_prompts={TUNE_PROMPTS}", f"max_new_tokens={TUNE_TOKENS}", "hf_baseline=false",
             f"warmup_tokens={WARMUP_TOKENS}", f"max_prompt_tokens={TUNE_PROMPT_TOKENS}", "name=demo-tune"]
    cfg = load_eval_config([str(config)], [*overrides, *sweep, f"dataset={dataset}"])
    if cfg.num_threads:  # as the eval that follows runs (eval/harness/runner.py), so that its tuning applies there
        torch.set_num_threads(cfg.num_threads)
    try:
        cfg = resolve_heldout_skip(cfg, read_export_config(export_dir))
    except ValueError:  # trained on every ShareGPT conversation: MT-bench questions drawn with another seed
        # (they may overlap the ones the demo reports; nothing else is held out)
        cfg = load_eval_config([str(config)], [*overrides, *sweep, "dataset=mtbench", "seed=1"])
    cfg, _ = export_decode_dtypes(cfg, export_dir)  # dtype=fast: the decode dtype the eval after it resolves to
    loaded = load_export(export_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=resolve_device(cfg.device),
                         chat_template=cfg.chat_template)
    engine = OursEngine(loaded, cfg, searched_tree=False, shapes=DEMO_SHAPES)
    t0 = time.monotonic()
    bar, progress = progress_bar([engine])
    with bar:
        record = sweep_engine(engine, REPEATS, time.monotonic() + budget_s, progress, tie=TIE)
    record["tuned"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    record["machine"] = machine_info(device=str(resolve_device(cfg.device)))
    context = {"export": str(export_dir), "machine": machine_info(), "dataset": cfg.dataset,
               "num_prompts": cfg.num_prompts, "max_new_tokens": cfg.max_new_tokens, "repeats": REPEATS,
               "alpha": DEFAULT_ALPHA, "min_gain": DEFAULT_MIN_GAIN, "tie": TIE, "budget_minutes": budget_s / 60,
               "wall_seconds": time.monotonic() - t0, "command": "specdraft demo (its tree sweep)"}
    write_export(export_dir, context, {"ours": record})
    del engine, loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    choice = dict(record["choice"])
    choice["tree_choices"] = choice["knobs"].get("tree_choices") if choice["speculate"] else [[0]]
    choice["points"] = [(p["label"], p.get("speedup"), p.get("acceptance_length")) for p in record["points"]
                        if p.get("status") == "ok"]
    return choice


def describe(choice: dict) -> str:
    """One line: each tree's measured speedup and acceptance, and what the demo decodes with."""
    measured = "; ".join(f"{label} {speed:.2f}x AR (AL {al:.2f})" for label, speed, al in choice["points"])
    if choice["speculate"]:
        return f"{measured or 'nothing measured'} -> {choice['label']} ({choice['reason']})"
    return (f"{measured or 'nothing measured'} -> no tree beat AR here ({choice['reason']}); the demo decodes with "
            "the cheapest, its top-1")
