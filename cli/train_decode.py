"""Decoded acceptance while training: the callable `specdraft train` hands to train/loop.py: train.

train/ and eval.engine are one layer and may not import each other, so the composition root builds the decoder
side here. At each snapshot the loop calls `decode(export_dir, base, step)`; it loads the snapshot's export onto
the training base (no second base), drafts a greedy chain of the family's depth with the bundled decoder, and
returns the decoded acceptance length (new tokens / base decode steps, the bonus token counted, as `specdraft eval`
reports it) with the texts it decoded, on which the loop scores its teacher-forced estimates.

Prompts: the first user turn of held-out ShareGPT conversations, the ones after the training slice (the same pool
`specdraft eval dataset=sharegpt` and data.onpolicy_heldout use), a seeded draw of train.decode_eval_prompts of
them, drawn once per run so every snapshot decodes the same prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

DECODE_MAX_PROMPT_TOKENS = 256  # longer held-out prompts are skipped (decoding cost on a CPU)


def make_decode_eval(cfg) -> Callable | None:
    """The decode callable for TrainConfig `cfg`, or None when train.decode_eval_prompts is 0."""
    n = cfg.train.decode_eval_prompts
    if n <= 0:
        return None
    from train.onpolicy import heldout_prompt_slice

    # Fails now, before any training, when the run reads all of its prompt source (nothing held out).
    source, skip = heldout_prompt_slice(cfg.data.source, cfg.data.max_records)
    prompts: list = []

    def decode(export_dir: Path, base, step: int) -> dict:
        from eval.engine.backends.choice import make_backend
        from eval.engine.decoder import eos_ids, speculative_generate
        from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
        from eval.harness.config import EvalConfig
        from eval.harness.prompts import load_eval_prompts
        from models.export.load import load_export

        if not prompts:
            prompts.extend(load_eval_prompts("sharegpt", base.tokenizer, num_prompts=n, seed=cfg.train.seed,
                                             sharegpt_source=source, heldout_skip=skip,
                                             max_prompt_tokens=DECODE_MAX_PROMPT_TOKENS))
        loaded = load_export(export_dir, base=base)
        spec = drafter_family(loaded.family)
        depth = spec.max_chain(loaded.draft) or cfg.draft.num_heads
        eval_cfg = EvalConfig(name="train-decode", dataset="sharegpt", max_new_tokens=cfg.train.decode_eval_tokens)
        overrides = chain_overrides(loaded.family, depth)
        extra = {**eval_cfg.extra, **overrides.pop("extra", {})}
        eval_cfg = dataclasses.replace(eval_cfg, **overrides, extra=extra)
        drafter, _info = build_drafter(loaded.draft, loaded.config, eval_cfg)
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
        return {"decoded_al": new_tokens / max(steps, 1), "prompts": len(prompts), "new_tokens": new_tokens,
                "steps": steps, "chain_depth": depth, "prompt_source": source, "heldout_skip": skip,
                "prompt_ids": [p.id for p in prompts], "texts": texts}

    return decode
