"""The training loop: frozen base outside DeepSpeed, the draft inside it.

Per optimizer step, for each of this rank's micro-batches:
    h = base(input_ids)            no grad, [B, T, d]
    loss = draft.loss(h, ...)      weighted per-depth losses
    engine.backward(loss)          the one backward() of the project
    engine.step()                  DeepSpeed steps the optimizer at the accumulation boundary
The data order is a function of (seed, step) (train/data_order.py), so resume needs only the step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from core.atomic import write_text_atomic
from core.config_loader import ConfigError, to_dict, to_yaml
from data.dataset import collate
from data.draft_vocab import vocab_report
from data.hidden_cache import (
    collate_cached,
)
from data.packed import is_packed, packed_train_data
from data.self_distill import train_data_entry
from models.base import draft_inputs
from models.draft import BaseView, DepthStats, DraftBatch, estimated_acceptance_length
from models.export.specdraft import export_specdraft
from models.registry import DRAFT_MODELS
from train import checkpoint
from train.best_export import DECODED_FILE, LAST_DIR, score_key, select_best_export
from train.chain_estimate import CHAIN_FAMILIES, chain_estimates
from train.config import TrainConfig, saved_config_tree
from train.data_order import DataOrder
from train.distributed import DistInfo, all_reduce_sum, any_rank, barrier, init_distributed
from train.ds_config import build_deepspeed_config
from train.heldout import evaluate_heldout, format_heldout_table, with_onpolicy
from train.init_from import initial_vocab, load_initial_weights
from train.onpolicy import onpolicy_heldout_rows
from train.optimizer import build_optimizer
from train.run_inputs import (
    draft_vocab,
    epoch_tokens_of,
    load_base_and_data,
    open_hidden_cache,
    threads_and_precision,
)
from train.schedule import TimeBudgetedSchedule
from train.sequence_parallel import SequenceParallel
from train.tracking import Tracker

log = logging.getLogger("specdraft.train")


class LossStep(nn.Module):
    """What the DeepSpeed engine wraps: the draft, with its training loss as forward.

    The base's frozen lm_head / embeddings reach the loss through `view` (not registered here), so
    DeepSpeed never sees, shards or checkpoints base weights.
    """

    def __init__(self, draft: nn.Module, view: BaseView, loss_cfg):
        super().__init__()
        self.draft = draft
        self.view, self.loss_cfg = view, loss_cfg

    def forward(self, hidden, input_ids, loss_mask, aux_hidden=None, shard=None):
        if shard is not None:  # sequence parallelism: this rank's rows (train/sequence_parallel.py)
            return self.draft.loss(DraftBatch(hidden, input_ids, loss_mask, aux_hidden, shard), self.view,
                                   self.loss_cfg)
        return self.draft.loss(DraftBatch(hidden, input_ids, loss_mask, aux_hidden), self.view, self.loss_cfg)


def _sequence_parallel_step(engine, sp: SequenceParallel, batch: dict, cached: bool, base, aux_layers: list[int],
                            pad_id: int, halo: int, compute_dtype, device):
    """One micro-batch's forward under sequence parallelism: this rank's rows (sliced from the cached h, or the base
    forward run sequence-parallel), the draft's loss over them (train/sequence_parallel.py)."""
    ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    mask = batch["loss_mask"].to(device)
    if cached:
        aux = batch["aux"].to(device) if aux_layers else None
        part = sp.split(ids, attn, mask, pad_id, halo, hidden=batch["hidden"].to(device), aux=aux, windowed=True)
    else:
        part = sp.split(ids, attn, mask, pad_id, halo, base=base.model, aux_layers=aux_layers, dtype=compute_dtype)
    return engine(part.hidden, part.input_ids, part.loss_mask, part.aux, shard=part.shard)


def _setup_logging(info: DistInfo) -> None:
    level = logging.INFO if info.is_main else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("DeepSpeed", "deepspeed", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class TrainingInterrupted(RuntimeError):
    """Raised after a SIGTERM-triggered checkpoint, so the process exits non-zero (143) and a scheduler
    knows the run is not finished; `resume=auto` continues it."""


class _StopRequest:
    """SIGTERM (e.g. a cluster pre-emption) sets a flag; the loop saves at the next step and exits."""

    def __init__(self):
        self.requested = False
        self._prev = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._prev)


def train(cfg: TrainConfig, decode_eval: Callable | None = None) -> Path:
    """Run (or resume) a training run; returns its run directory.

    decode_eval(export_dir, base, step) -> {"decoded_al", "texts": [(prompt + answer ids, prompt length)], ...}:
    decodes held-out prompts with a snapshot's export (cli/train_decode.py builds it: train/ may not import the
    decoder). Used when cfg.train.decode_eval_prompts > 0; the export is then the best snapshot by decoded AL.
    """
    info = init_distributed()
    _setup_logging(info)
    if cfg.train.decode_eval_prompts and decode_eval is None:
        log.warning("train.decode_eval_prompts=%d but no decoder was given (train() called directly, not through "
                    "`specdraft train`): no decoded acceptance, export/ is the final state",
                    cfg.train.decode_eval_prompts)
    decode = decode_eval if cfg.train.decode_eval_prompts else None
    run_dir = cfg.resolved_run_dir
    ckpt_root = run_dir / "checkpoints"
    _check_resumed_config(cfg, run_dir, ckpt_root)  # every rank: all fail alike, before any work
    if info.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.yaml", to_yaml(cfg))
    precision, base_dtype = threads_and_precision(cfg, info)

    base, train_ds, val_ds, source, max_records, partitioned = load_base_and_data(cfg, info, base_dtype)
    if decode and (partitioned or info.world_size > 1):  # the decoder runs one whole base on one rank
        log.warning("train.decode_eval_prompts is for single-rank runs with a whole base; not decoding at snapshots")
        decode = None
    # The base's own answers to the prompts after the training ones (rank 0 alone scores held-out sets).
    onpolicy_ds = onpolicy_heldout_rows(cfg.data, base, source, max_records) if info.is_main else None
    # Every rank builds its share of the cache's shards (collective; a ready cache is only opened).
    t_cache = time.perf_counter()
    hidden_cache = open_hidden_cache(cfg, base, train_ds, info, partitioned) if cfg.data.hidden_cache else None
    cache_seconds = time.perf_counter() - t_cache
    view = partitioned.view() if partitioned else BaseView.from_model(base.model)
    for turn in (0, 1):  # rank 0 builds and caches the draft vocabulary; the others read the cache
        if (turn == 0) == info.is_main:
            d2t = draft_vocab(cfg, base, train_ds, view.vocab_size)
            if cfg.train.init_from:  # the started-from draft's map: its LM head's rows stand for those tokens
                d2t = initial_vocab(cfg.train.init_from, cfg.draft.family, d2t)
        barrier()
    view.draft_vocab = d2t.to(info.device) if d2t is not None else None
    vocab_info = vocab_report(d2t, train_ds, val_ds, view.vocab_size) if info.is_main else {}
    if d2t is not None and info.is_main:
        log.info("draft vocabulary: N=%d of V=%d tokens; target coverage %.4f train / %.4f held-out",
                 d2t.numel(), view.vocab_size, vocab_info["draft_vocab_coverage_train"],
                 vocab_info["draft_vocab_coverage_heldout"])
    pad_id = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else 0

    torch.manual_seed(cfg.train.seed)  # same initial draft on every rank
    # Hydra++ / CTC copy the base's last decoder layer: gathered whole while the draft is built.
    with partitioned.gathered_last_layer() if partitioned else contextlib.nullcontext():
        draft = DRAFT_MODELS[cfg.draft.family].from_config(cfg.draft, view)
    if cfg.train.init_from:  # a trained draft's weights instead of the family's initialisation
        load_initial_weights(draft, cfg.train.init_from, cfg.draft.family, view, base.fingerprint)
        log.info("draft initialised from %s", cfg.train.init_from)
    aux_layers = list(getattr(draft, "aux_layers", None) or [])  # base layers the draft reads besides h
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    # train.sequence_parallel > 1: groups of ranks share each conversation; the data order and DeepSpeed's batch
    # are per group (data-parallel rank / size)
    sp = SequenceParallel(cfg.train.sequence_parallel, info.rank, info.world_size) \
        if cfg.train.sequence_parallel > 1 else None
    dp_rank, dp_size = (sp.dp_rank, sp.dp_size) if sp else (info.rank, info.world_size)
    if sp is not None:
        log.info("sequence parallelism: each conversation split over %d ranks (DeepSpeed Ulysses), %d group(s) of "
                 "them reading different conversations", sp.size, sp.dp_size)
    order = DataOrder(len(train_ds), cfg.train.global_batch_size, cfg.train.micro_batch_size,
                      dp_rank, dp_size, cfg.train.seed)
    epoch_tokens = epoch_tokens_of(train_ds)  # what one pass over the train rows sees
    total_steps = cfg.train.max_steps or _steps_for(cfg.train, epoch_tokens, len(train_ds), order.steps_per_epoch)
    warmup = int(cfg.train.warmup_ratio * total_steps)
    log.info("base %s (%s) | %s draft, %.2fM trainable params | %d train / %d val conversations, %d tokens an "
             "epoch | %d steps x %d conversations | %d rank(s) on %s, %s", base.name, base.fingerprint,
             cfg.draft.family, n_params / 1e6, len(train_ds), len(val_ds), epoch_tokens, total_steps,
             cfg.train.global_batch_size, info.world_size, info.device, precision)

    import deepspeed

    step_module = LossStep(draft, view, cfg.loss)
    if cfg.deepspeed.zero_stage == 3:
        # The loss reads LM-head weights directly (fused chunked CE), outside their Linear's forward.
        for p in draft.parameters():
            deepspeed.zero.register_external_parameter(step_module, p)
    # AdamW, or Muon + AdamW (train.optimizer); vocabulary-sized matrices (heads, tables) stay on AdamW
    vocab_sizes = {view.vocab_size} | ({int(d2t.numel())} if d2t is not None else set())
    optimizer = build_optimizer(cfg.train, draft, vocab_sizes)
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # each group's peak LR, before the schedule
    lr_multiplier = TimeBudgetedSchedule(total_steps, warmup, cfg.train.min_lr_ratio, 60 * cfg.train.max_minutes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier)
    ds_config = build_deepspeed_config(cfg, dp_size, precision)
    engine, _, _, scheduler = deepspeed.initialize(model=step_module, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config, **({"mpu": sp.mpu} if sp else {}))
    compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    start_step, seconds_before, cpu_before = 0, 0.0, 0.0
    candidates = checkpoint.resume_candidates(ckpt_root) if cfg.resume == "auto" else (
        [Path(cfg.resume)] if cfg.resume != "none" else [])
    resume_from = None
    if candidates:
        resume_from, state = checkpoint.load_newest_good(engine, candidates)
        start_step, seconds_before = int(state["step"]), float(state.get("train_seconds", 0.0))
        # CPU seconds before this start (None: a checkpoint written before they were counted, so unknown)
        cpu_before = state.get("train_cpu_seconds", None if start_step else 0.0)
        # LambdaLR's state_dict carries the multiplier object's fields and the base LRs of the saved run;
        # the schedule of *this* config wins (e.g. a run extended with a larger train.max_steps).
        lr_multiplier.configure(total_steps, warmup, cfg.train.min_lr_ratio, 60 * cfg.train.max_minutes)
        scheduler.base_lrs = list(base_lrs)
        log.info("resumed from %s at step %d (%.1f min of training before)", resume_from, start_step,
                 seconds_before / 60)
    elif cfg.resume == "auto":
        log.info("resume=auto: no checkpoint in %s, starting from step 0", ckpt_root)

    tracker = Tracker(run_dir, to_dict(cfg), cfg.wandb, cfg.run_name, info.is_main, resume_step=start_step)
    if d2t is not None and info.is_main:
        tracker.log(dict(vocab_info), start_step)
    stop = _StopRequest()
    pbar = tqdm(total=total_steps, initial=start_step, disable=not info.is_main, unit="step", dynamic_ncols=True)
    window = [DepthStats() for _ in range(cfg.draft.num_heads)]
    window_loss, window_micro, window_tokens, window_t0 = 0.0, 0, 0, time.perf_counter()
    # The time budget covers the whole run, across resumes: the clock starts where the checkpoint left it.
    train_t0 = time.perf_counter() - seconds_before
    # This process's CPU seconds (all its threads) plus those of the starts before it: what the run cost, which a
    # wall clock on a shared box overstates and a `time` around a killed process never reports.
    clock = CpuClock(cpu_before)
    lr_multiplier.start(train_t0)
    step = start_step
    sigterm = False  # agreed across ranks: did any rank get SIGTERM?
    grad_norm = None
    # sequence parallelism: the ranks of a group draw alike (the blocks DFlash samples are the group's, not a rank's)
    seed_rank = info.rank if sp is None else sp.dp_rank
    halo = int(getattr(draft, "num_heads", cfg.draft.num_heads)) + 1  # rows of h past its own a rank's loss reads
    try:
        while step < total_steps:
            torch.manual_seed(cfg.train.seed + 1_000_003 * step + seed_rank)  # dropout RNG depends on step only
            for rows in order.micro_batches(step):
                if hidden_cache is not None and sp is not None:  # only this rank's window of each row is read
                    start, h_stop, a_stop = sp.window(max(hidden_cache.length(i) for i in rows), halo)
                    batch = collate_cached([hidden_cache.window(i, start, h_stop, a_stop) for i in rows], pad_id,
                                           compute_dtype, widths=(h_stop - start, a_stop - start))
                elif hidden_cache is not None:  # h read from disk: no base forward
                    batch = collate_cached([hidden_cache[i] for i in rows], pad_id, compute_dtype)
                else:
                    batch = collate([train_ds[i] for i in rows], pad_id)
                ids = batch["input_ids"].to(info.device)
                attn = batch["attention_mask"].to(info.device)
                mask = batch["loss_mask"].to(info.device)
                aux = None  # EAGLE-3: the base's aux layers [B, T, k*d] (draft.aux_layers)
                if sp is not None:  # this rank's rows of the group's micro-batch (the base forward sharded too)
                    out = _sequence_parallel_step(engine, sp, batch, hidden_cache is not None, base, aux_layers,
                                                  pad_id, halo, compute_dtype, info.device)
                elif hidden_cache is not None:
                    hidden = batch["hidden"].to(info.device)
                    if aux_layers:
                        aux = batch["aux"].to(info.device)
                else:
                    # [B, T, d] (+ EAGLE-3's [B, T, k*d]), no [B, T, V] logits; a ZeRO-3 base gathers each layer's
                    # parameters in turn
                    hidden, aux = draft_inputs(base.model, ids, attn, aux_layers)
                    hidden = hidden.to(compute_dtype)
                    aux = aux.to(compute_dtype) if aux is not None else None
                if sp is None:
                    out = engine(hidden, ids, mask, aux) if aux is not None else engine(hidden, ids, mask)
                engine.backward(out.loss)
                if engine.is_gradient_accumulation_boundary():
                    grad_norm = _grad_norm(engine, draft)
                engine.step()
                for acc, s in zip(window, out.per_depth):
                    acc.add(s)
                window_loss += float(out.loss.detach())  # sequence parallelism: the rank's share of the loss
                if sp is None or sp.rank == 0:  # a group's micro-batch and tokens count once
                    window_micro += 1
                    window_tokens += int(attn.sum())
            step += 1
            pbar.update(1)
            out_of_time = cfg.train.max_minutes > 0 and time.perf_counter() - train_t0 > 60 * cfg.train.max_minutes
            must_stop = any_rank(stop.requested or out_of_time, info.device)
            if step % cfg.train.log_every == 0 or step == total_steps or must_stop:
                metrics = _window_metrics(window, window_loss, window_micro, window_tokens,
                                          time.perf_counter() - window_t0, info, draft.prefix_accuracy)
                metrics.update(lr=scheduler.get_last_lr()[0], grad_norm=grad_norm)
                tracker.log(metrics, step)
                pbar.set_postfix(loss=f"{metrics['loss']:.3f}", acc1=f"{metrics['top1/head1']:.3f}",
                                 tok_s=f"{metrics['tokens_per_s']:.0f}")
                window = [DepthStats() for _ in range(cfg.draft.num_heads)]
                window_loss, window_micro, window_tokens, window_t0 = 0.0, 0, 0, time.perf_counter()
            if must_stop or (cfg.train.save_every and step % cfg.train.save_every == 0 and step < total_steps):
                checkpoint.save(engine, ckpt_root, step, _client_state(step, train_t0, clock),
                                cfg.train.keep_checkpoints, info.rank)
            if cfg.train.export_every and step % cfg.train.export_every == 0 and step < total_steps and not must_stop:
                _finish(cfg, engine, draft, base, view, (val_ds, onpolicy_ds), pad_id, compute_dtype, info, tracker,
                        run_dir, step, time.perf_counter() - train_t0,
                        _train_data_entry(source, max_records, epoch_tokens), vocab_info, bool(partitioned),
                        out=run_dir / "exports" / checkpoint.step_tag(step), decode_eval=decode,
                        cpu_seconds=clock.seconds())
            _test_crash_hook(step)
            if must_stop:
                # Ranks may get SIGTERM seconds apart (the launcher signals them in turn): agree on it, so all
                # of them skip the export and exit 143 together instead of some entering collectives alone.
                sigterm = any_rank(stop.requested, info.device)
                why = "SIGTERM" if sigterm else f"time budget train.max_minutes={cfg.train.max_minutes}"
                log.warning("stopping at step %d/%d (%s); checkpoint saved, resume with resume=auto",
                            step, total_steps, why)
                break
        else:
            checkpoint.save(engine, ckpt_root, step, _client_state(step, train_t0, clock), cfg.train.keep_checkpoints,
                            info.rank)
    finally:
        pbar.close()
        stop.restore()

    loop_end = time.perf_counter()
    if not sigterm:  # finished, or out of its time budget: export what we have
        # Decoding at snapshots: the final state goes to export_last/, and export/ becomes the best decoded one.
        _finish(cfg, engine, draft, base, view, (val_ds, onpolicy_ds), pad_id, compute_dtype, info, tracker, run_dir,
                step, time.perf_counter() - train_t0, _train_data_entry(source, max_records, epoch_tokens),
                vocab_info, bool(partitioned), out=run_dir / LAST_DIR if decode else None, decode_eval=decode,
                cpu_seconds=clock.seconds())
        if decode and info.is_main:
            _select_export(run_dir)
        if info.is_main:  # what each part of this run took (`specdraft demo` compares them with its plan)
            write_text_atomic(run_dir / "phase_seconds.json", json.dumps(
                {"cache": round(cache_seconds, 1), "loop": round(loop_end - train_t0, 1),
                 "finish": round(time.perf_counter() - loop_end, 1)}) + "\n")
    tracker.close()
    barrier()
    if sigterm:
        raise TrainingInterrupted(f"stopped by SIGTERM at step {step}/{total_steps}; checkpoint saved in "
                                  f"{ckpt_root}; continue with resume=auto")
    return run_dir


def _train_data_entry(source, max_records, epoch_tokens: int) -> dict:
    """The export's train_data: which conversations trained the draft (so `specdraft eval dataset=sharegpt` picks
    prompts it never saw) and how many tokens an epoch held."""
    entry = packed_train_data(source) if is_packed(source) else train_data_entry(source, max_records)
    return {**entry, "epoch_tokens": epoch_tokens}


def _steps_for(t, epoch_tokens: int, rows: int, steps_per_epoch: int) -> int:
    """Optimizer steps of a run without train.max_steps: train.max_tokens at the mean conversation length of the
    train split (global_batch_size conversations a step), else train.epochs passes."""
    if t.max_tokens:
        return max(1, round(t.max_tokens / (epoch_tokens / rows * t.global_batch_size)))
    return max(1, math.floor(t.epochs * steps_per_epoch))


def _test_crash_hook(step: int) -> None:
    """Tests simulate a hard crash (no chance to save) after a given step: SPECDRAFT_TEST_KILL_AT_STEP=N."""
    if os.environ.get("SPECDRAFT_TEST_KILL_AT_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


class CpuClock:
    """CPU seconds of a run across its starts: `before` (from the checkpoint; None = not counted by the run that
    wrote it) plus this process's time.process_time() since the clock was made."""

    def __init__(self, before: float | None):
        self.before, self.t0 = before, time.process_time()

    def seconds(self) -> float | None:
        return None if self.before is None else self.before + time.process_time() - self.t0


def _client_state(step: int, train_t0: float, clock: CpuClock) -> dict:
    """What a checkpoint needs besides DeepSpeed's own state: the data position is a function of the step; the
    seconds so far keep the time budget and the run's cost across resumes."""
    return {"step": step, "train_seconds": time.perf_counter() - train_t0, "train_cpu_seconds": clock.seconds()}


def _grad_norm(engine, draft) -> float | None:
    """Global gradient norm before clipping, read at the accumulation boundary before engine.step().

    ZeRO-1/2 and bf16 optimizers report it; with fp32 and ZeRO-0 DeepSpeed discards it while clipping,
    so it is computed from the (already all-reduced) .grad tensors. None (logged as null) if unavailable.
    """
    norm = engine.get_global_grad_norm()
    if norm is not None:
        return float(norm)
    grads = [p.grad for p in draft.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def _window_metrics(window: list[DepthStats], loss_sum: float, n_micro: int, tokens: int, seconds: float,
                    info: DistInfo, prefix_accuracy: bool = False) -> dict:
    """Per-depth loss / top-1 / top-5 over the log window, summed over ranks."""
    table = torch.tensor([[s.loss_sum, s.count, s.top1, s.topk, s.oov] for s in window] +
                         [[loss_sum, n_micro, tokens, 0.0, 0.0]], dtype=torch.float64, device=info.device)
    table = all_reduce_sum(table).cpu()
    metrics = {"loss": float(table[-1, 0] / max(1.0, table[-1, 1])),
               "tokens_per_s": float(table[-1, 2] / max(seconds, 1e-9))}
    top1 = []
    for k, (ls, cnt, t1, tk, oov) in enumerate(table[:-1].tolist(), start=1):
        metrics[f"loss/head{k}"] = ls / max(cnt - oov, 1.0)  # mean over the targets that carry a loss
        if oov:  # draft vocabulary: targets outside the map (scored as misses), as a fraction
            metrics[f"oov/head{k}"] = oov / cnt
        cnt = max(cnt, 1.0)
        metrics[f"top1/head{k}"] = t1 / cnt
        metrics[f"top5/head{k}"] = tk / cnt
        top1.append(t1 / cnt)
    metrics["est_accept_len"] = estimated_acceptance_length(top1, prefix_accuracy)
    return metrics


def _select_export(run_dir: Path) -> None:
    """export/ = the best-scored snapshot; heldout.json beside it stays the final state's, as without scoring."""
    record = select_best_export(run_dir)
    if (run_dir / LAST_DIR / "heldout.json").is_file():
        shutil.copyfile(run_dir / LAST_DIR / "heldout.json", run_dir / "heldout.json")
    key = record["score_key"]
    log.info("export/ = %s (step %d, %s %.3f); the final state (step %d, %s %.3f) is in %s/", record["source"],
             record["step"], key, record[key], record["last_step"], key, record[f"last_{key}"], LAST_DIR)


def _decode_snapshot(cfg, draft, base, view, compute_dtype, info, tracker, export_dir: Path, step: int,
                     decode_eval: Callable) -> None:
    """Score the export just written (cli/train_decode.py: simulated AL on stored base answers, or decoded AL on
    held-out prompts), score the teacher-forced estimates on the base's own answers to the same prompts, write
    export_dir/decoded.json and log the score (rank 0)."""
    result = decode_eval(export_dir, base, step)
    key = score_key(result)
    est = {}
    if cfg.draft.family in CHAIN_FAMILIES:
        est = chain_estimates(draft, base.model, view, result["texts"], cfg.loss, info.device, compute_dtype)
    record = {"step": step, "score_key": key, key: result[key],
              **{k: v for k, v in result.items() if k not in ("texts", key, "score_key")}, **est}
    (export_dir / DECODED_FILE).write_text(json.dumps(record, indent=2) + "\n")
    tracker.log({key: record[key], **{f"decoded/{k}": v for k, v in est.items() if k.startswith("est_accept_len")}},
                step)
    log.info("step %d: %s %.3f on %s held-out prompts (teacher-forced chain estimate %s, product %s)", step, key,
             record[key], record.get("prompts", "?"), _fmt(est.get("est_accept_len_chain")),
             _fmt(est.get("est_accept_len_product")))


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _finish(cfg, engine, draft, base, view, heldout_sets, pad_id, compute_dtype, info, tracker, run_dir, step,
            train_seconds: float, train_data: dict, vocab_info: dict | None = None, partitioned: bool = False,
            out: Path | None = None, decode_eval: Callable | None = None, cpu_seconds: float | None = None) -> None:
    """Export the draft's weights and measure held-out per-depth accuracy (rank 0; with a ZeRO-3 base every
    rank runs the held-out forwards, which are collective, and rank 0 alone writes). heldout_sets = (the split's
    val rows, the on-policy held-out rows or None). out: a snapshot directory (exports/step<N>/, which gets the
    export and its heldout.json) instead of the run's export/ and heldout.json; written through a temporary
    directory and renamed, so a kill mid-snapshot leaves no half export."""
    val_ds, onpolicy_ds = heldout_sets
    import deepspeed

    params = list(draft.parameters()) if cfg.deepspeed.zero_stage == 3 else []
    export_dir = run_dir / "export" if out is None else out.with_name(out.name + ".tmp")
    if out is not None and info.is_main:
        shutil.rmtree(export_dir, ignore_errors=True)  # a snapshot a kill cut short
    with deepspeed.zero.GatheredParameters(params, enabled=bool(params)):
        if info.is_main:
            # train_data lets `specdraft eval dataset=sharegpt` pick prompts this draft never saw.
            export_specdraft(draft, export_dir, base.name, base.fingerprint,
                             extra={"trained_steps": step, "train_seconds": round(train_seconds, 1),
                                    # this rank's CPU seconds over every start (null: a start before they were kept)
                                    "train_cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
                                    # what was trained: the weights file also holds a frozen LM head kept for serving
                                    "trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
                                    "hidden_cache": bool(cfg.data.hidden_cache),
                                    "train_dtype": str(compute_dtype).removeprefix("torch."),
                                    "train_data": train_data, **(vocab_info or {}),
                                    # the Jinja source when data.chat_template replaced the tokenizer's
                                    # own, so eval renders prompts the way training did
                                    **({"chat_template": base.tokenizer.chat_template}
                                       if cfg.data.chat_template else {})})
            log.info("exported the draft to %s", export_dir if out is None else out)
        if cfg.train.val_batches > 0 and (info.is_main or partitioned):
            result = evaluate_heldout(draft, base.model, view, val_ds, pad_id, cfg, info.device, compute_dtype)
            if onpolicy_ds is not None:  # every row: the slice is small and chosen on purpose
                result = with_onpolicy(result, evaluate_heldout(draft, base.model, view, onpolicy_ds, pad_id, cfg,
                                                                info.device, compute_dtype, max_rows=len(onpolicy_ds)))
            if info.is_main:
                heldout_path = run_dir / "heldout.json" if out is None else export_dir / "heldout.json"
                heldout_path.write_text(json.dumps(result, indent=2) + "\n")
                tracker.log({f"val/{k}": v for k, v in result["summary"].items()}, step)
                print(format_heldout_table(result), flush=True)
        if decode_eval is not None and info.is_main and not partitioned:
            _decode_snapshot(cfg, draft, base, view, compute_dtype, info, tracker, export_dir, step, decode_eval)
    if out is not None and info.is_main:
        shutil.rmtree(out, ignore_errors=True)
        export_dir.rename(out)


def _check_resumed_config(cfg: TrainConfig, run_dir: Path, ckpt_root: Path) -> None:
    """Resuming a run whose checkpoints were made with another draft, data or loss would silently train something
    else: refuse it, naming the keys that differ."""
    saved = run_dir / "config.yaml"
    if cfg.resume == "none" or not saved.is_file() or not any(ckpt_root.glob("step*")):
        return
    import yaml

    try:
        old = yaml.safe_load(saved.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        log.warning("%s is unreadable (%s); it is rewritten with this run's config", saved, err)
        return
    try:  # an older run's config.yaml: flat family keys at their new place, the keys it predates at their defaults
        old = saved_config_tree(old)
    except ConfigError as err:
        log.warning("%s: %s; compared as it is", saved, err)
    changes = checkpoint.resume_config_changes(old, to_dict(cfg))
    if changes:
        raise ValueError(f"resuming {run_dir}: this config differs from the one its checkpoints were trained with "
                         f"({saved}) in {'; '.join(changes)}. Resume with the same values, or start a new run "
                         "(another run_name / run_dir, or resume=none to start this one over)")
