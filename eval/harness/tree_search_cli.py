"""`specdraft tree-search --draft runs/<run>/export`: grow a static tree from rank statistics on held-out
prompts (eval/harness/tree_search.py), time real decode steps per candidate size on this machine, store the
fastest tree in the export's config.json (used by `specdraft eval` with tree=auto) and write
tree_search.json / tree_search.md / tree_search.png.

Steps:
  1. tuning prompts: held-out ShareGPT (after the draft's training conversations), minus the prompts of
     the `exclude_eval` eval config, so the tree is never tuned on the prompts it is judged on;
  2. per prompt: the base's greedy continuation (new_tokens + depth tokens, so every counted position
     knows its true tokens at every depth), one base prefill over prompt + continuation for h [T, d],
     drafter.true_path_ranks -> ranks [T, D]; rows t = P-1 .. P-2+new_tokens (roots in the continuation);
  3. greedy growth up to max_nodes -> predicted acceptance per size;
  4. per size in `sizes`: speculative_generate on the first timing prompts -> seconds per base step and
     the measured acceptance (a sanity check of the prediction); tokens/s = predicted acceptance / step;
  5. pick the best size, write.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.atomic import atomic_open, write_text_atomic
from core.paths import REPO_ROOT
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.harness.config import EvalConfig, load_eval_config
from eval.harness.tree_search import (
    TreeSearchConfig,
    acceptance_curve,
    candidate_sizes,
    grow_tree,
    load_tree_search_config,
    node_hit_counts,
    pick_size,
    tree_choices,
)

log = logging.getLogger("specdraft.tree_search")
DEFAULT_CONFIG = REPO_ROOT / "configs" / "eval" / "tree_search.yaml"


def _eval_view(cfg: TreeSearchConfig, **changes) -> EvalConfig:
    """The slice of an EvalConfig that prompt loading, the backend and build_drafter read."""
    base = EvalConfig(name="tree_search", dataset=cfg.dataset, num_prompts=cfg.num_prompts,
                      heldout_skip=cfg.heldout_skip, max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed,
                      backend=cfg.backend, dtype=cfg.dtype, device=cfg.device, base_path=cfg.base_path)
    return dataclasses.replace(base, **changes)


def tuning_prompts(cfg: TreeSearchConfig, export_cfg: dict, tokenizer) -> list:
    """cfg.num_prompts held-out prompts, none of which is in the `exclude_eval` config's prompt set."""
    from eval.harness.prompts import config_prompts
    from eval.harness.runner import resolve_heldout_skip

    ecfg = resolve_heldout_skip(_eval_view(cfg), export_cfg)
    excluded: set[str] = set()
    if cfg.exclude_eval:
        path = Path(cfg.exclude_eval)
        path = path if path.is_file() else REPO_ROOT / path
        other = load_eval_config([str(path)])
        if other.dataset == cfg.dataset:  # a different source cannot share prompts
            excluded = {p.id for p in config_prompts(resolve_heldout_skip(other, export_cfg), tokenizer)}
    pool = config_prompts(dataclasses.replace(ecfg, num_prompts=cfg.num_prompts + len(excluded)), tokenizer)
    prompts = [p for p in pool if p.id not in excluded][: cfg.num_prompts]
    if not prompts:
        raise ValueError(f"every tuning prompt of {cfg.dataset!r} is in the eval set {cfg.exclude_eval!r}; "
                         "use another dataset or exclude_eval=''")
    return prompts


def collect_ranks(backend, drafter, prompts, eos: list[int], cfg: TreeSearchConfig, depth: int
                  ) -> tuple[torch.Tensor, list[dict]]:
    """-> (ranks [N, depth] over every counted position of every prompt, per-prompt records)."""
    rows, records = [], []
    for p in tqdm(prompts, desc="tree search: continuations + ranks", unit="prompt", dynamic_ncols=True):
        prompt = torch.tensor(p.input_ids, dtype=torch.long)
        gen = autoregressive_generate(backend, prompt, max_new_tokens=cfg.new_tokens + depth, eos_ids=eos)
        seq = torch.cat([prompt, torch.tensor(gen.tokens, dtype=torch.long)])  # [T] prompt + continuation
        backend.reset(seq.numel())
        _, hidden = backend.prefill(seq.to(backend.device))  # hidden [T, d]: h_t for every position
        drafter.reset()
        ranks = drafter.true_path_ranks(hidden, seq, depth, cfg.max_rank)  # [T, depth]
        # Roots ids[t+1] in the continuation (t >= P-1), true tokens known at every depth (t+1+depth < T).
        start, stop = prompt.numel() - 1, min(prompt.numel() - 1 + cfg.new_tokens, seq.numel() - 1 - depth)
        rows.append(ranks[start:max(start, stop)])
        records.append({"id": p.id, "prompt_tokens": prompt.numel(), "continuation_tokens": len(gen.tokens),
                        "positions": max(0, stop - start), "stop_reason": gen.stop_reason})
    return torch.cat(rows), records


def time_sizes(backend, draft, export_cfg: dict, grown, sizes: list[int], prompts, eos: list[int],
               cfg: TreeSearchConfig) -> tuple[list[dict], float]:
    """Per size: real decode steps on `prompts` -> {step_time_s, measured_acceptance, ...}; and the AR
    (1-node) step time on the same prompts as the reference."""
    from eval.engine.drafters.registry import build_drafter

    def run(gen_fn) -> dict:
        if cfg.warmup_tokens:  # allocator, oneDNN kernels for this tree width: keep them out of the timing
            gen_fn(prompts[0].input_ids, cfg.warmup_tokens)
        passes = []  # greedy: every pass makes the same steps; only the seconds differ
        for _ in range(cfg.timing_repeats):
            secs = steps = accepted = new = 0
            for p in prompts:
                g = gen_fn(p.input_ids, cfg.timing_new_tokens)
                secs, steps = secs + g.decode_time, steps + g.base_steps
                accepted, new = accepted + sum(g.accepted_lengths), new + len(g.tokens) - 1
            passes.append(secs)
        secs = min(passes)  # the least disturbed pass (other processes share the CPU)
        if steps == 0:
            raise ValueError("the timing prompts ended before any decode step (EOS at once); raise "
                             "timing_prompts or use other prompts")
        return {"step_time_s": secs / steps, "measured_acceptance": accepted / steps,
                "measured_tokens_per_second": new / secs if secs > 0 else None, "base_steps": steps}

    ar = run(lambda ids, n: autoregressive_generate(backend, ids, max_new_tokens=n, eos_ids=eos))
    out = []
    for size in tqdm(sizes, desc="tree search: timing sizes", unit="size", dynamic_ncols=True):
        drafter, _ = build_drafter(draft, export_cfg, _eval_view(cfg, tree_choices=tree_choices(grown, size)))
        row = run(lambda ids, n, d=drafter: speculative_generate(backend, d, ids, max_new_tokens=n, eos_ids=eos))
        out.append({"size": size, **row})
    return out, ar["step_time_s"]


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def search(export_dir: Path, cfg: TreeSearchConfig) -> tuple[dict, Path]:
    """The whole search on one export; returns (result dict as in tree_search.json, output dir)."""
    from core.hardware import resolve_device
    from eval.engine.backends.choice import choose_backend, make_backend
    from eval.engine.decoder import eos_ids
    from eval.engine.drafters.registry import build_drafter
    from models.export.load import load_export

    export_dir = Path(export_dir)
    device = resolve_device(cfg.device)
    loaded = load_export(export_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=device)
    base, draft, export_cfg, family = loaded.base, loaded.draft, loaded.config, loaded.family
    probe, _ = build_drafter(draft, export_cfg, _eval_view(cfg, tree_choices=[[0]]))
    if not hasattr(probe, "true_path_ranks"):
        raise ValueError(f"tree search needs rank statistics (drafter.true_path_ranks), which the {family!r} "
                         "drafter does not provide; it works for static-tree families (medusa, hydra)")
    heads = getattr(draft, "num_heads", None)
    if heads is None:
        raise ValueError(f"the {family!r} draft has no num_heads, so the tree depth is unknown")
    depth = min(cfg.max_depth or heads, heads)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else export_dir.parent / "tree_search"

    t0 = time.perf_counter()
    backend, eos = make_backend(cfg.backend, base.model), eos_ids(base.model, base.tokenizer)
    prompts = tuning_prompts(cfg, export_cfg, base.tokenizer)
    ranks, records = collect_ranks(backend, probe, prompts, eos, cfg, depth)
    num_positions = int(ranks.shape[0])
    if num_positions == 0:
        raise ValueError("no usable positions: every continuation stopped at once (EOS); raise num_prompts "
                         "or new_tokens")
    grown = grow_tree(node_hit_counts(ranks, cfg.max_rank), num_positions, cfg.max_nodes)
    curve = acceptance_curve(grown)
    sizes = candidate_sizes(cfg.sizes, len(grown))
    if not sizes:
        raise ValueError(f"no draft was ever right within rank {cfg.max_rank} on {num_positions} positions, so no "
                         "tree can beat plain decoding; check that this draft belongs to this base")
    timed, ar_step = time_sizes(backend, draft, export_cfg, grown, sizes, prompts[: cfg.timing_prompts], eos, cfg)
    predicted = [curve[s] for s in sizes]
    step_times = [r["step_time_s"] for r in timed]
    best = pick_size(sizes, predicted, step_times)
    chosen = tree_choices(grown, sizes[best])
    result = {
        "export": str(export_dir), "family": family, "base_model": base.name,
        "backend": choose_backend(cfg.backend, base.model)[0],
        "dtype": str(base.dtype).removeprefix("torch."), "machine": machine_name(device),
        "dataset": cfg.dataset, "prompts": [p.id for p in prompts],
        "timing_prompts": [p.id for p in prompts[: cfg.timing_prompts]], "new_tokens": cfg.new_tokens,
        "timing_new_tokens": cfg.timing_new_tokens, "timing_repeats": cfg.timing_repeats,
        "positions": num_positions, "max_depth": depth,
        "max_rank": cfg.max_rank, "max_nodes": cfg.max_nodes, "per_prompt": records,
        "nodes": [{"choice": list(n.choice), "hits": n.count, "p_hit": n.p_hit} for n in grown],
        "predicted_acceptance_curve": curve, "sizes": sizes, "predicted_acceptance": predicted,
        "step_time_s": step_times, "measured_acceptance": [r["measured_acceptance"] for r in timed],
        "measured_tokens_per_second": [r["measured_tokens_per_second"] for r in timed],
        "predicted_tokens_per_second": [a / s for a, s in zip(predicted, step_times, strict=True)],
        "ar_step_time_s": ar_step, "chosen_size": sizes[best], "chosen_tree": chosen,
        "wall_seconds": time.perf_counter() - t0,
    }
    write_outputs(result, out_dir)
    if cfg.write_export:
        store_tree(export_dir, result)
    return result, out_dir


# ---------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------




SUMMARY_KEYS = ("sizes", "predicted_acceptance", "step_time_s", "measured_acceptance", "chosen_size",
                "prompts", "dtype", "backend", "machine", "positions", "ar_step_time_s")


def store_tree(export_dir: Path, result: dict) -> None:
    """Put the chosen tree under "tree" (and a summary under "tree_search") in config.json, every other
    key unchanged; eval/engine/drafters/static.py resolve_tree uses it when the eval asks for tree=auto."""
    path = Path(export_dir) / "config.json"
    config = json.loads(path.read_text())
    config["tree"] = result["chosen_tree"]
    config["tree_search"] = {k: result[k] for k in SUMMARY_KEYS}
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")


def write_outputs(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "tree_search.md", markdown(result))
    _plot(result, out_dir / "tree_search.png")
    write_text_atomic(out_dir / "tree_search.json", json.dumps(result, indent=2, allow_nan=False) + "\n")


def markdown(r: dict) -> str:
    ar_tps = 1.0 / r["ar_step_time_s"]
    lines = [f"# Tree search: {r['family']} on {r['base_model']} "
             f"({r['dtype']}, {r['backend']} backend, {r['machine']})",
             "", f"{len(r['prompts'])} held-out {r['dataset']} prompts x {r['new_tokens']} greedy tokens = "
             f"{r['positions']} positions; depth <= {r['max_depth']}, ranks < {r['max_rank']}. Timing: "
             f"{len(r['timing_prompts'])} prompt(s) x {r['timing_new_tokens']} tokens; own AR "
             f"{1000 * r['ar_step_time_s']:.1f} ms/step = {ar_tps:.1f} tok/s.", "",
             "| nodes | predicted acceptance | measured acceptance | ms / step | predicted tok/s | "
             "measured tok/s | predicted speedup vs AR |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, size in enumerate(r["sizes"]):
        mark = " **(chosen)**" if size == r["chosen_size"] else ""
        meas = r["measured_tokens_per_second"][i]
        lines.append(f"| {size}{mark} | {r['predicted_acceptance'][i]:.3f} | {r['measured_acceptance'][i]:.3f} | "
                     f"{1000 * r['step_time_s'][i]:.1f} | {r['predicted_tokens_per_second'][i]:.1f} | "
                     f"{'n/a' if meas is None else f'{meas:.1f}'} | "
                     f"{r['predicted_tokens_per_second'][i] / ar_tps:.2f}x |")
    lines += ["", f"Chosen tree ({r['chosen_size']} nodes + root): `{json.dumps(r['chosen_tree'])}`", "",
              "Predicted acceptance = 1 + sum of the tree's node hit rates over every position (exact per greedy "
              "step; a real decode only drafts at step boundaries, so the measured number on the few timing "
              "prompts scatters around it). See docs/howto/tree_search.md.", ""]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state (as eval/harness/report.py)

    fig = Figure(figsize=(11, 4), dpi=100, layout="constrained")
    ax_acc, ax_tps = fig.subplots(1, 2)
    curve = r["predicted_acceptance_curve"]
    ax_acc.plot(range(len(curve)), curve, label="predicted (all positions)")
    ax_acc.plot(r["sizes"], r["measured_acceptance"], "o", label="measured (timing decode)")
    ax_acc.set_xlabel("tree nodes (root excluded)")
    ax_acc.set_ylabel("acceptance length (tokens / base step)")
    ax_acc.set_title("Acceptance vs tree size")
    ax_acc.legend()
    ax_tps.plot(r["sizes"], r["predicted_tokens_per_second"], "o-", label="predicted acceptance / step time")
    meas = [(s, v) for s, v in zip(r["sizes"], r["measured_tokens_per_second"], strict=True) if v is not None]
    if meas:
        ax_tps.plot([s for s, _ in meas], [v for _, v in meas], "s--", label="measured (timing decode)")
    ax_tps.axhline(1.0 / r["ar_step_time_s"], color="k", linestyle=":", label="own AR")
    ax_tps.axvline(r["chosen_size"], color="C3", linestyle="--", label=f"chosen: {r['chosen_size']}")
    ax_tps.set_xlabel("tree nodes (root excluded)")
    ax_tps.set_ylabel("new tokens / s")
    ax_tps.set_title(f"Throughput vs tree size ({r['dtype']}, {r['machine']})", fontsize=9)
    ax_tps.legend(fontsize=8)
    with atomic_open(path, binary=True) as f:
        fig.savefig(f, format="png")


def run_tree_search_cli(args) -> int:
    cfg = load_tree_search_config(args.config or [str(DEFAULT_CONFIG)], args.overrides)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.draft:
        raise ValueError("pass --draft runs/<run>/export (a trained export)")
    result, out_dir = search(Path(args.draft), cfg)
    i = result["sizes"].index(result["chosen_size"])
    print(f"tree search: chose {result['chosen_size']} nodes (predicted acceptance "
          f"{result['predicted_acceptance'][i]:.2f}, {result['predicted_tokens_per_second'][i]:.1f} tok/s vs own AR "
          f"{1.0 / result['ar_step_time_s']:.1f})" + (f"; stored in {args.draft}/config.json" if cfg.write_export
                                                      else "") + f"\n  report: {out_dir / 'tree_search.md'}")
    return 0
