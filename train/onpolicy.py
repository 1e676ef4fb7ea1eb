"""The on-policy held-out set: the base's own answers to prompts the draft never trained on.

A draft is judged at decode time on what the base itself writes, so held-out accuracy on ShareGPT's ChatGPT answers
says little about acceptance (the base writes very differently). With data.onpolicy_heldout = N, training also
scores the draft, teacher forced, on the base's answers to the N conversations that follow the training ones in the
prompt source: the same conversations `specdraft eval dataset=sharegpt` holds out. They are regenerated once (turn
by turn, greedy unless data.self_distill_temperature says otherwise) and cached under <cache>/selfdistill/; a
longer regeneration with the same settings (`specdraft regenerate`, any engine or precision) serves the slice
without generating.
"""

from __future__ import annotations

import logging

from core.paths import default_cache_dir
from data.dataset import build_eval_rows
from data.packed import is_packed, packed_train_data
from data.self_distill import build_self_distilled, train_data_entry

log = logging.getLogger(__name__)

HELDOUT_TURNS = 8  # user turns regenerated per held-out conversation (`specdraft regenerate`'s default)


def heldout_prompt_slice(source: str, max_records: int | None) -> tuple[str, int]:
    """(prompt source, conversations to skip) for a training source read with max_records: a regenerated file
    (or packed rows) names the ShareGPT slice its prompts came from; the held-out prompts start after it."""
    entry = packed_train_data(source) if is_packed(source) else train_data_entry(source, max_records)
    origin = entry.get("derived_from") or entry
    prompts, skip = origin.get("source"), origin.get("max_records")
    if prompts is None or skip is None:
        raise ValueError(f"data.onpolicy_heldout needs prompts after the training conversations, but the training "
                         f"data reads all of {prompts or source!r}; set data.max_records (the held-out prompts are "
                         "the ones after it), or data.onpolicy_heldout=0")
    return prompts, int(skip)


def onpolicy_heldout_rows(d, base, source: str, max_records: int | None):
    """The tokenized on-policy held-out rows (input_ids, loss_mask) for DataSection `d`, or None when off."""
    if d.onpolicy_heldout <= 0:
        return None
    prompts, skip = heldout_prompt_slice(source, max_records)
    path = build_self_distilled(base, prompts, max_records=d.onpolicy_heldout, skip=skip,
                                max_new_tokens=d.self_distill_max_new_tokens, temperature=d.self_distill_temperature,
                                max_turns=HELDOUT_TURNS, seed=d.seed, cache_dir=d.cache_dir or None, any_engine=True)
    rows = build_eval_rows(base.tokenizer, str(path), max_length=d.max_length,
                           cache_dir=d.cache_dir or default_cache_dir() / "data",
                           min_assistant_tokens=d.min_assistant_tokens)
    log.info("on-policy held-out: %d conversations after the first %d of %s (%s)", len(rows), skip, prompts, path)
    return rows
