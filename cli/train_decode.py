"""Acceptance while training: the callable `specdraft train` hands to train/loop.py: train, which scores every
snapshot with it and exports the best.

train/ and eval.engine are one layer and may not import each other, so the composition root builds the scoring side
here. At each snapshot the loop calls `score(export_dir, base, step)`; it loads the snapshot's export onto the
training base (no second base) as a greedy chain of the family's depth, and returns its acceptance length (new
tokens / base decode steps, the bonus token counted, as `specdraft eval` and `specdraft field` report it), with the
texts it was measured on, on which the loop scores its teacher-forced estimates. Two ways (train.snapshot_eval):

field   the exact simulated greedy AL on the base's stored answers (eval/field/simulation.py): train.decode_eval_prompts
        prompts of each of train.field_eval_sets (held-out ShareGPT slices of train.field_refs), their whole stored
        answers; `simulated_al` = the mean over those sets of each set's AL, as the field report's headline. The
        base's teacher-forced pass over them is cached once (the field cache); each snapshot costs the drafter's
        forwards only. Rows go to <snapshot>/field/.
decode  decode the first user turn of held-out ShareGPT conversations, the ones after the training slice (the same
        pool `specdraft eval dataset=sharegpt` and data.onpolicy_heldout use), a seeded draw of
        train.decode_eval_prompts of them, drawn once per run; `decoded_al`.
auto    field when train.field_refs holds this base's answers, else decode (said once in the log).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DECODE_MAX_PROMPT_TOKENS = 256  # longer held-out prompts are skipped (decoding cost on a CPU)


def make_decode_eval(cfg) -> Callable | None:
    """The scoring callable for TrainConfig `cfg` (train.snapshot_eval), or None when train.decode_eval_prompts is
    0."""
    if cfg.train.decode_eval_prompts <= 0:
        return None
    if cfg.train.snapshot_eval == "decode":
        return _make_decode(cfg)
    decode = None
    if cfg.train.snapshot_eval == "auto":
        try:
            decode = _make_decode(cfg)
        except ValueError as exc:  # nothing held out to decode: only the stored answers can score this run
            if _stored_base(cfg) != cfg.base.path:
                raise  # nor stored answers for this base: fail now, before any training, as decode would
            decode_error = exc

            def decode(export_dir, base, step):
                raise ValueError(f"train.snapshot_eval=auto found no stored answers for this base and cannot "
                                 f"decode: {decode_error}")
    field = _make_field(cfg)
    chosen: list[Callable] = []

    def score(export_dir: Path, base, step: int) -> dict:
        if not chosen:  # the first snapshot decides, once the base (its fingerprint) is known
            chosen.append(_choose(cfg, base, field, decode))
        return chosen[0](export_dir, base, step)

    return score


def _choose(cfg, base, field: Callable, decode: Callable | None) -> Callable:
    from eval.field.refs import RefsError, read_refs

    try:
        read_refs(_refs_dir(cfg), base.fingerprint, _field_sets(cfg))
    except (RefsError, FileNotFoundError) as exc:
        if decode is None:  # snapshot_eval=field was asked for: fail with the reason, nothing half-scored
            raise RefsError(f"train.snapshot_eval=field: {exc}") from exc
        log.warning("train.snapshot_eval=auto: scoring snapshots by decoding held-out prompts, not on stored "
                    "answers (%s)", exc)
        return decode
    log.info("scoring snapshots by simulated greedy AL on the stored answers in %s (sets %s, %d prompts each)",
             cfg.train.field_refs, ",".join(_field_sets(cfg)), cfg.train.decode_eval_prompts)
    return field


def _stored_base(cfg) -> str | None:
    """The base name on train.field_refs's card (None without one): a cheap check before the base is loaded."""
    import json

    card = _refs_dir(cfg) / "card.json"
    return json.loads(card.read_text()).get("base") if card.is_file() else None


def _refs_dir(cfg) -> Path:
    from core.paths import REPO_ROOT

    p = Path(cfg.train.field_refs)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def _field_sets(cfg) -> list[str]:
    return [s.strip() for s in cfg.train.field_eval_sets.split(",") if s.strip()]


def _chain_drafter(cfg, export_dir: Path, base, max_new_tokens: int):
    """(the snapshot's drafter as a greedy chain of its family's depth, the depth)."""
    from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
    from eval.harness.config import EvalConfig
    from models.export.load import load_export

    loaded = load_export(export_dir, base=base)
    spec = drafter_family(loaded.family)
    depth = spec.max_speculative_tokens(loaded.draft) or cfg.draft.num_heads
    eval_cfg = EvalConfig(name="train-snapshot", dataset="sharegpt", max_new_tokens=max_new_tokens)
    overrides = chain_overrides(loaded.family, depth)
    extra = {**eval_cfg.extra, **overrides.pop("extra", {})}
    eval_cfg = dataclasses.replace(eval_cfg, **overrides, extra=extra)
    drafter, _info = build_drafter(loaded.draft, loaded.config, eval_cfg)
    return drafter, depth


def _make_field(cfg) -> Callable:
    refs: list = []

    def field(export_dir: Path, base, step: int) -> dict:
        from eval.engine.backends.choice import choose_backend
        from eval.field.refs import read_refs
        from eval.field.report import field_report
        from eval.field.simulation import first_per_set, run_field

        if not refs:
            _card, stored = read_refs(_refs_dir(cfg), base.fingerprint, _field_sets(cfg))
            refs.extend(first_per_set(stored, cfg.train.decode_eval_prompts))
        drafter, depth = _chain_drafter(cfg, export_dir, base, max(r.n for r in refs))
        backend_name, _ = choose_backend("auto", base.model)
        was_training = base.model.training
        base.model.eval()
        try:
            rows = run_field(drafter, refs, base, backend_name=backend_name, out_dir=Path(export_dir) / "field",
                             progress=False)
        finally:
            base.model.train(was_training)
        report = field_report(rows, {"step": step}, draws=200)
        by_id = {r.id: r for r in refs}
        return {"score_key": "simulated_al", "simulated_al": report["mean_over_sets"],
                "per_set": {t["set"]: t["acceptance_length"] for t in report["sets"]},
                "prompts": len(rows), "steps": sum(len(r["accept_lengths"]) for r in rows),
                "num_speculative_tokens": depth,
                "refs": cfg.train.field_refs, "prompt_ids": [r["id"] for r in rows],
                "texts": [(list(by_id[r["id"]].prompt) + list(by_id[r["id"]].answer[:r["new_tokens"] + 1]),
                           len(by_id[r["id"]].prompt)) for r in rows]}

    return field


def _make_decode(cfg) -> Callable:
    n = cfg.train.decode_eval_prompts
    from train.onpolicy import heldout_prompt_slice

    # Fails now, before any training, when the run reads all of its prompt source (nothing held out).
    source, skip = heldout_prompt_slice(cfg.data.source, cfg.data.max_records)
    prompts: list = []

    def decode(export_dir: Path, base, step: int) -> dict:
        from eval.engine.backends.choice import make_backend
        from eval.engine.decoder import eos_ids, speculative_generate
        from eval.harness.prompts import load_eval_prompts

        if not prompts:
            prompts.extend(load_eval_prompts("sharegpt", base.tokenizer, num_prompts=n, seed=cfg.train.seed,
                                             sharegpt_source=source, heldout_skip=skip,
                                             max_prompt_tokens=DECODE_MAX_PROMPT_TOKENS))
        drafter, depth = _chain_drafter(cfg, export_dir, base, cfg.train.decode_eval_tokens)
        backend = make_backend("auto", base.model)
        eos = eos_ids(base.model, base.tokenizer)
        new_tokens = steps = 0
        texts = []
        was_training = base.model.training
        base.model.eval()
        try:
            for p in prompts:
                g = speculative_generate(backend, drafter, p.input_ids, max_new_tokens=cfg.train.decode_eval_tokens,
                                         eos_ids=eos)
                new_tokens += len(g.tokens) - 1  # the prefill's token is not a decode step's
                steps += g.base_steps
                texts.append((list(p.input_ids) + list(g.tokens), len(p.input_ids)))
        finally:
            base.model.train(was_training)
        return {"score_key": "decoded_al", "decoded_al": new_tokens / max(steps, 1), "prompts": len(prompts),
                "new_tokens": new_tokens, "steps": steps, "num_speculative_tokens": depth, "prompt_source": source,
                "heldout_skip": skip, "prompt_ids": [p.id for p in prompts], "texts": texts}

    return decode
