"""Draft vocabulary on the real SmolLM2: training tokens/s, peak step memory, coverage, held-out
top-1 at equal tokens and drafting time per decode step, for Medusa and Hydra++ at N in {full, 32k, 16k,
8k, 4k}, in ONE process with every variant interleaved step by step (the machine is shared: a load spike
then hits every N alike instead of one of them).

    python bench/draft_vocab.py                                   # the docs/lab/benchmarks.md run
    python bench/draft_vocab.py --train-rows 64 --val-rows 8 --tp-rounds 2 --draft-steps 10   # quick look

Data: the demo's ShareGPT set (1,500 records, <= 512 tokens, SmolLM2 chat template, assistant-only
mask) split 80/20 (seed 0). The map is built from ALL train rows' assistant targets (data/draft_vocab.py),
coverage is reported on the train rows (in-sample) and on the 20% held out; training and held-out top-1
use the first --train-rows / --val-rows of those splits, read from the hidden-state cache (built once,
bf16, the same one `specdraft train` builds for these rows), so no base forward runs in the timed steps.

Drafts are the CPU recipes (configs/cpu_budget.yaml: shared frozen LM head): Medusa K=4 x 1 ResBlock, hard
CE, lr 5e-3; Hydra++ K=4 x 4 blocks + prefix layer, dropout 0.2, teacher loss only, lr 5e-4. Parameters
fp32 (AdamW), compute under CPU bf16 autocast with bf16 hidden states (the fused loss then runs its
LM-head matmuls in bf16, as with train.precision=bf16). A step = draft loss forward/backward + AdamW on
one micro-batch of 4 conversations; tokens/s counts the micro-batch's real tokens, like the training loop's
tokens_per_s. Peak step memory = VmHWM during the step minus the resident memory just before it.

Quality: for each family, the full-vocabulary draft and the draft at --chosen N train on the same
micro-batches in the same order (one epoch of --train-rows, global batch 8, warmup 5% + cosine), then
held-out per-depth top-1 (scored against base ids: out-of-map targets are misses) on --val-rows.
Drafting: propose() of the Medusa / Hydra++ drafter with the tree16 tree in bf16, one committed token per
step along held-out conversations, mean ms per call per N.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, Stopwatch, Timing, peak_memory, ratio, time_once  # noqa: E402


def _label(n: int) -> str:
    return "full" if n == 0 else (f"{n // 1024}k" if n % 1024 == 0 else str(n))


def _build_draft(family: str, view, seed: int):
    import torch

    from models.families.hydra.model import HydraDraft
    from models.families.medusa.model import MedusaDraft

    torch.manual_seed(seed)
    if family == "medusa":
        draft = MedusaDraft(4, 1, view, share_lm_head=True)
    else:
        draft = HydraDraft(4, 4, view, share_lm_head=True, dropout=0.2, prefix_layer=True)
    for p in draft.parameters():  # fp32 master weights; frozen buffers (embeddings, LM-head rows) stay bf16
        p.data = p.data.float()
    return draft


def _recipe(family: str):
    from train.config import LossSection

    if family == "medusa":
        return LossSection(lambda0=1.0, decay=0.8), 5e-3, 0.0
    return LossSection(lambda0=1.0, decay=1.0, teacher_weight=1.0), 5e-4, 0.1


def _micro_batches(cache, rows, micro, pad_id):
    import torch

    from data.hidden_cache import collate_cached

    out = []
    for lo in range(0, len(rows), micro):
        b = collate_cached([cache[i] for i in rows[lo:lo + micro]], pad_id, torch.bfloat16)
        out.append(b)
    return out


def _step(draft, view, loss_cfg, opt, batch):
    import torch

    from models.draft import DraftBatch

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = draft.loss(DraftBatch(batch["hidden"], batch["input_ids"], batch["loss_mask"]), view, loss_cfg)
    out.loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="smollm2")
    p.add_argument("--records", type=int, default=1500)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--train-rows", type=int, default=256, help="conversations trained on (quality phase)")
    p.add_argument("--val-rows", type=int, default=32, help="held-out conversations for top-1 and drafting")
    p.add_argument("--sizes", default="0,32768,16384,8192,4096", help="N values; 0 = the full vocabulary")
    p.add_argument("--chosen", type=int, default=16384, help="the N compared with full at equal tokens")
    p.add_argument("--families", default="medusa,hydra_pp")
    p.add_argument("--tp-rounds", type=int, default=4, help="timed throughput rounds (after 1 warm-up)")
    p.add_argument("--draft-steps", type=int, default=60, help="timed propose() calls per N and family")
    p.add_argument("--micro", type=int, default=4, help="conversations per micro-batch")
    p.add_argument("--global-batch", type=int, default=8, help="conversations per optimizer step (quality phase)")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--coverage-only", action="store_true", help="only the coverage table (no base forward)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        # glibc then unmaps freed blocks >= 64 KiB at once, so RSS follows live tensors and VmHWM is their peak.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

    import torch

    from core.paths import default_cache_dir
    from data.dataset import build_datasets
    from data.draft_vocab import build_draft_vocab, count_targets
    from data.hidden_cache import HiddenCache, build_hidden_cache, cache_key
    from models.base import HiddenStates, load_base
    from models.draft import BaseView

    t_start = Stopwatch()
    sizes = [int(s) for s in args.sizes.split(",")]
    families = args.families.split(",")
    base = load_base(args.base, dtype="bf16")
    tok = base.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    root = default_cache_dir()
    train_ds, val_ds = build_datasets(tok, "sharegpt", max_records=args.records, max_length=args.max_length,
                                      val_fraction=args.val_fraction, seed=0, cache_dir=root / "data",
                                      min_assistant_tokens=8)
    view0 = BaseView.from_model(base.model)
    V = view0.vocab_size
    train_sub = train_ds.select(range(min(args.train_rows, len(train_ds))))
    val_sub = val_ds.select(range(min(args.val_rows, len(val_ds))))
    caches = {}
    for name, ds in () if args.coverage_only else (("train", train_sub), ("val", val_sub)):
        key = cache_key(base.fingerprint, base.model.dtype, ds, "bf16")
        d = build_hidden_cache(HiddenStates(base.model), ds, root / "hidden" / key, pad_id=pad_id,
                               device=torch.device("cpu"),
                               micro_batch_size=4, info={"key": key, "base": base.name,
                                                         "base_fingerprint": base.fingerprint,
                                                         "base_dtype": str(base.model.dtype)})
        caches[name] = HiddenCache(d)
    print(f"data: {len(train_ds)} train / {len(val_ds)} held-out conversations; training on {len(train_sub)}, "
          f"held-out top-1 on {len(val_sub)}; setup {t_start.wall():.0f} s", flush=True)

    # ---- maps and coverage ------------------------------------------------------------------------------
    train_counts, val_counts = count_targets(train_ds, V), count_targets(val_ds, V)
    sub_counts = count_targets(train_sub, V)
    maps, coverage = {0: None}, {}
    for n in sizes:
        if n == 0:
            coverage[0] = {"train": 1.0, "heldout": 1.0, "heldout_map_from_train_rows": 1.0}
            continue
        d2t, _ = build_draft_vocab(train_ds, n, V, base_fingerprint=base.fingerprint, cache_dir=root / "draft_vocab")
        maps[n] = d2t
        small = torch.sort(-sub_counts, stable=True).indices[:n]
        coverage[n] = {"train": float(train_counts[d2t].sum() / train_counts.sum()),
                       "heldout": float(val_counts[d2t].sum() / val_counts.sum()),
                       "heldout_map_from_train_rows": float(val_counts[small].sum() / val_counts.sum())}
    print(f"\ncoverage of the assistant target tokens (map from the {len(train_ds)} train conversations; last "
          f"column: map from only the {len(train_sub)} conversations trained on below)")
    print(f"{'N':>6} {'train':>7} {'held-out':>9} {'held-out, small map':>20}")
    for n in sizes:
        c = coverage[n]
        print(f"{_label(n):>6} {c['train']:>7.4f} {c['heldout']:>9.4f} {c['heldout_map_from_train_rows']:>20.4f}")

    if args.coverage_only:
        _save(args.out, {"coverage": {_label(n): coverage[n] for n in sizes}, "settings": vars(args)})
        return

    def view_for(n):
        v = BaseView.from_model(base.model)
        v.draft_vocab = maps[n]
        return v

    train_batches = _micro_batches(caches["train"], list(range(len(train_sub))), args.micro, pad_id)
    results = {"coverage": {_label(n): coverage[n] for n in sizes}, "throughput": {}, "quality": {}, "drafting": {},
               "settings": vars(args), "threads": torch.get_num_threads(),
               "train_conversations": len(train_ds), "heldout_conversations": len(val_ds)}

    # ---- throughput: every N interleaved, one micro-batch per variant per round ------------------------------
    for fam in families:
        loss_cfg, lr, wd = _recipe(fam)
        variants = {}
        for n in sizes:
            draft = _build_draft(fam, view_for(n), seed=0).train()
            variants[n] = (draft, view_for(n), torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=wd))
        stats = {n: {"tokens": 0, "seconds": 0.0, "peak_kib": 0} for n in sizes}
        rounds = 1 + args.tp_rounds
        for r in range(rounds):
            batch = train_batches[r % len(train_batches)]
            tokens = int(batch["attention_mask"].sum())
            order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]  # rotate who goes first
            for n in order:
                draft, view, opt = variants[n]
                with peak_memory("cpu") as pk:  # VmHWM during the step minus the RSS just before it
                    _, dt = time_once(lambda: _step(draft, view, loss_cfg, opt, batch))  # noqa: B023 (called now)
                peak = pk.delta_bytes // 1024
                if r > 0:  # round 0 warms up (allocator, autocast weight caches, one-time casts)
                    stats[n]["tokens"] += tokens
                    stats[n]["seconds"] += dt
                    stats[n]["peak_kib"] = max(stats[n]["peak_kib"], peak)
        full_tps = stats[0]["tokens"] / stats[0]["seconds"] if 0 in stats else None
        print(f"\n{fam}: training throughput ({args.tp_rounds} interleaved rounds of one {args.micro}-conversation "
              f"micro-batch per N, {torch.get_num_threads()} threads)")
        print(f"{'N':>6} {'tokens/s':>9} {'vs full':>8} {'peak step MiB':>14}")
        results["throughput"][fam] = {}
        for n in sizes:
            s = stats[n]
            tps = s["tokens"] / s["seconds"]
            rel = ratio(tps, full_tps, digits=12) if full_tps else float("nan")  # same rounds, interleaved
            results["throughput"][fam][_label(n)] = {"tokens_per_s": tps, "vs_full": rel,
                                                    "peak_step_mib": s["peak_kib"] / 1024}
            print(f"{_label(n):>6} {tps:>9.0f} {rel:>7.2f}x {s['peak_kib'] / 1024:>14.0f}", flush=True)

        # ---- drafting time per decode step ------------------------------------------------------------------
        results["drafting"][fam] = _drafting_times(fam, variants, sizes, caches["val"], args.draft_steps)
        del variants
        _save(args.out, results)

    # ---- quality at equal tokens: full vs the chosen N, trained side by side -------------------------------------
    if not args.skip_quality:
        for fam in families:
            results["quality"][fam] = _quality(fam, [0, args.chosen], view_for, train_batches, caches["val"], pad_id,
                                               args.global_batch // args.micro, args.micro)
            _save(args.out, results)
    results["wall_s"] = t_start.wall()
    print(f"\ntotal wall time {results['wall_s'] / 60:.1f} min", flush=True)
    _save(args.out, results)


def _save(path: str, results: dict) -> None:
    """Written (atomically) after every phase, so a run cut short keeps what it measured."""
    Results(path or None, results).save()


def _drafting_times(fam, variants, sizes, val_cache, steps):
    """Mean ms per propose() (tree16, bf16 copies of the drafts), one committed token per step."""
    import copy

    import torch

    from eval.engine.drafters.drafter import DecodeState
    from eval.engine.tree import STATIC_TREES, StaticTree
    from models.families.hydra.drafter import HydraDrafter
    from models.families.medusa.drafter import MedusaDrafter

    tree = StaticTree(STATIC_TREES["tree16"])
    drafters = {}
    for n in sizes:
        d = copy.deepcopy(variants[n][0]).eval().to(torch.bfloat16)
        drafters[n] = MedusaDrafter(d, tree) if fam == "medusa" else HydraDrafter(d, tree)
    row = val_cache[0]
    h, ids = row["hidden"].to(torch.bfloat16), row["input_ids"].long()
    prompt = min(64, ids.numel() // 2)
    times = {n: [] for n in sizes}
    for n in sizes:
        drafters[n].reset()
        drafters[n].propose(DecodeState(ids[:prompt], int(ids[prompt]), h[:prompt], ids[:prompt]))  # prefill
    for i in range(min(steps, ids.numel() - prompt - 1)):
        t = prompt + i
        state = DecodeState(ids[:t + 1], int(ids[t + 1]), h[t:t + 1], ids[t:t + 1])
        for n in sizes:  # interleaved
            tree_out, dt = time_once(lambda: drafters[n].propose(state))  # noqa: B023 (called now)
            times[n].append(dt)
            assert int(tree_out.tokens.max()) < 49152 + 1
    out = {}
    print(f"{fam}: drafting time per decode step (tree16, bf16, {len(times[sizes[0]])} steps, interleaved)")
    full = Timing(times[0]).mean if 0 in times else None
    for n in sizes:
        ms = 1e3 * Timing(times[n]).mean
        out[_label(n)] = {"ms_per_step": ms, "vs_full": (full * 1e3 / ms) if full else None}
        print(f"{_label(n):>6} {ms:>8.2f} ms" + (f"  ({full * 1e3 / ms:.2f}x faster than full)" if full else ""))
    return out


def _quality(fam, sizes, view_for, train_batches, val_cache, pad_id, accum: int, micro: int):
    """Train the full and the chosen-N draft on the same micro-batches (`accum` per optimizer step, same order,
    same init, same dropout masks), then held-out top-1 by depth."""
    import torch

    from models.draft import DepthStats, DraftBatch

    loss_cfg, lr, wd = _recipe(fam)
    runs = {}
    total_steps = math.ceil(len(train_batches) / accum)
    warmup = max(1, int(0.05 * total_steps))

    def lr_at(step):  # linear warmup then cosine to 0.1 x lr (the recipes' schedule shape)
        if step < warmup:
            return (step + 1) / warmup
        prog = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))

    for n in sizes:
        draft = _build_draft(fam, view_for(n), seed=0).train()
        opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=wd)
        runs[n] = {"draft": draft, "view": view_for(n), "opt": opt,
                   "sched": torch.optim.lr_scheduler.LambdaLR(opt, lr_at), "seconds": 0.0, "tokens": 0}
    t_phase = Stopwatch()
    for step in range(total_steps):
        batches = train_batches[accum * step: accum * step + accum]
        for n in (sizes if step % 2 == 0 else sizes[::-1]):
            r = runs[n]
            torch.manual_seed(1000 + step)  # same dropout masks for every N
            watch = Stopwatch()
            for b in batches:
                _step(r["draft"], r["view"], loss_cfg, None, b)
                r["tokens"] += int(b["attention_mask"].sum())
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            r["sched"].step()
            r["seconds"] += watch.wall()
        if step % 4 == 0:
            print(f"  {fam} quality run: step {step + 1}/{total_steps}, "
                  f"{t_phase.wall():.0f} s", flush=True)
    out = {}
    val_batches = _micro_batches(val_cache, list(range(len(val_cache))), micro, pad_id)
    for n in sizes:
        r = runs[n]
        r["draft"].eval()
        totals = [DepthStats() for _ in range(4)]
        with torch.no_grad():
            for b in val_batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    res = r["draft"].loss(DraftBatch(b["hidden"], b["input_ids"], b["loss_mask"]), r["view"], loss_cfg)
                for t, s in zip(totals, res.per_depth):
                    t.add(s)
        out[_label(n)] = {"top1": [s.top1 / max(s.count, 1) for s in totals],
                          "top5": [s.topk / max(s.count, 1) for s in totals],
                          "oov": [s.oov / max(s.count, 1) for s in totals],
                          "train_tokens": r["tokens"], "train_tokens_per_s": r["tokens"] / r["seconds"]}
    full, chosen = out[_label(sizes[0])], out[_label(sizes[1])]
    print(f"\n{fam}: held-out top-1 by depth after {full['train_tokens']:,} training tokens each "
          f"({total_steps} steps x {accum * micro} conversations), {len(val_cache)} held-out conversations")
    print(f"{'N':>6} " + " ".join(f"{'depth ' + str(k + 1):>8}" for k in range(4)) + f" {'tokens/s':>9}")
    for n in sizes:
        o = out[_label(n)]
        print(f"{_label(n):>6} " + " ".join(f"{a:>8.4f}" for a in o["top1"]) + f" {o['train_tokens_per_s']:>9.0f}")
    diff = [c - f for c, f in zip(chosen["top1"], full["top1"])]
    print(f"{'diff':>6} " + " ".join(f"{d:>+8.4f}" for d in diff) + "   (target: every |diff| <= 0.01)")
    print(f"out-of-map held-out targets at N={_label(sizes[1])}: " + " / ".join(f"{x:.4f}" for x in chosen["oov"]))
    out["top1_diff"] = diff
    return out


if __name__ == "__main__":
    main()
