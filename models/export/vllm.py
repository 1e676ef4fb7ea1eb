"""`specdraft export --format vllm`: a draft in the layout vLLM loads (docs/howto/serve.md).

Every vLLM export directory holds `speculative_config.json`: the dict to pass as
`LLM(..., speculative_config=...)` (its "model" is this directory's absolute path at export time), and, where
the draft needs more engine arguments, `engine_args.json`: further `LLM(...)` keyword arguments.
A family declares its vLLM method (FamilyFacts.vllm_method) and registers the writer of its directory
(FamilySpec.writers["vllm"], in its package: models/families/<name>/export_vllm.py); this module holds what those
writers share (the count tune chose, vLLM's per-batch-size schedule, the draft vocabulary, the config files).

Draft vocabulary: a draft that predicts over N < V tokens carries a persistent buffer `d2t` [N] int64
(draft id -> base id) and `"draft_vocab_size": N` in its specdraft config.json (0 or missing = the full
vocabulary). vLLM scatters the N logits into a [V] row at `token_map` (-inf elsewhere). vLLM 0.32 sizes
per-head LM heads by V even with a token map, so it reads a draft vocabulary only with the shared head.
vLLM 0.32's `MedusaModel.load_weights` also never reports `token_map` as loaded, so the loader's strict
check ("Following weights were not initialized from checkpoint: {'token_map'}") refuses every export with a
draft vocabulary although the map was read. `engine_args.json` turns that check off for such an export
(`model_loader_extra_config={"enable_weights_track": false}`); serve-check and compare then verify the
engine's output token by token against plain decoding instead.

"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.vocab_map import check_fits

SPECULATIVE_CONFIG_FILE = "speculative_config.json"
ENGINE_ARGS_FILE = "engine_args.json"  # extra LLM(...) keyword arguments the draft needs (absent = none)
# `specdraft tune` stores vLLM's fastest speculative-token count under this key of the export's config.json (only
# when speculating beat vLLM AR); the exporters below write it instead of the draft's trained depth.
TUNED_TOKENS_KEY = "vllm_num_speculative_tokens"
# `specdraft tune --concurrency` stores vLLM's per-batch-size schedule under this key: [[start, end, k], ...], vLLM's
# speculative_config `num_speculative_tokens_per_batch_size` (inclusive batch-size ranges from 1; k = 0 drafts
# nothing; vLLM caps each k at num_speculative_tokens, so the exporters set that to the largest k).
TUNED_SCHEDULE_KEY = "vllm_num_speculative_tokens_per_batch_size"


def speculative_tokens(export_cfg: dict, trained: int) -> int:
    """The tuned count when the export has one, else the depth the draft was trained for."""
    return int(export_cfg.get(TUNED_TOKENS_KEY) or trained)


def untuned(export_cfg: dict, keep_count: bool = False) -> dict:
    """The export's config.json without tune's per-batch-size schedule, and without its count unless keep_count: what
    a check, compare or sweep exports when it drafts one fixed count, one request at a time."""
    drop = (TUNED_SCHEDULE_KEY,) if keep_count else (TUNED_SCHEDULE_KEY, TUNED_TOKENS_KEY)
    return {k: v for k, v in export_cfg.items() if k not in drop}


def check_schedule(schedule) -> list[list[int]]:
    """A per-batch-size schedule as vLLM 0.32 validates it (v1/spec_decode/dynamic/utils.py): a non-empty list of
    [start, end, k], 1 <= start <= end, k >= 0, sorted and non-overlapping, the first starting at 1, some k > 0."""
    ok = isinstance(schedule, list) and schedule and all(
        isinstance(e, list | tuple) and len(e) == 3 and all(isinstance(x, int) for x in e) for e in schedule)
    rows = [list(e) for e in schedule] if ok else []
    ok = ok and rows[0][0] == 1 and all(1 <= a <= b and k >= 0 for a, b, k in rows) \
        and all(rows[i][0] > rows[i - 1][1] for i in range(1, len(rows))) and max(k for *_, k in rows) > 0
    if not ok:
        raise ValueError(f"{TUNED_SCHEDULE_KEY} {schedule!r} is not a vLLM schedule: [[start, end, k], ...] from batch "
                         "size 1, sorted, non-overlapping, k >= 0 and some k > 0, e.g. [[1, 1, 3], [2, 3, 2], "
                         "[4, 8, 1]]; rerun `specdraft tune --concurrency 1,2,4,8` or remove the key")
    return rows


def scheduled_config(spec: dict, export_cfg: dict) -> dict:
    """The speculative_config with tune's per-batch-size schedule when the export has one: the schedule, and
    num_speculative_tokens = its largest k (vLLM caps every entry at it)."""
    schedule = export_cfg.get(TUNED_SCHEDULE_KEY)
    if not schedule:
        return spec
    rows = check_schedule(schedule)
    return {**spec, "num_speculative_tokens": max(k for *_, k in rows), "num_speculative_tokens_per_batch_size": rows}


def draft_vocabulary(draft: torch.nn.Module, export_cfg: dict, vocab_size: int) -> torch.Tensor | None:
    """The draft's d2t [N] int64 (None = full vocabulary), checked against its config's draft_vocab_size and
    the base's vocab_size V."""
    n = int(export_cfg.get("draft_vocab_size") or 0)
    d2t = draft.state_dict().get("d2t")
    if n == 0 and d2t is None:
        return None
    if d2t is None:
        raise ValueError(f"the export says draft_vocab_size={n} but the draft has no d2t buffer; re-export the run "
                         "(the draft vocabulary must travel in model.safetensors)")
    d2t = d2t.detach().cpu().long().contiguous()
    if n and d2t.numel() != n:
        raise ValueError(f"draft_vocab_size={n} in config.json but d2t holds {d2t.numel()} ids; the export is "
                         "inconsistent: re-export the run")
    check_fits(d2t, vocab_size, where="d2t of the draft")
    return d2t


def vllm_ngram_config(options: dict) -> dict:
    """Our N-gram options (eval extra: w tokens per row, q query tokens) -> vLLM's speculative_config.

    vLLM proposes one row: its counterpart is our strategy=longest_match with k=1 (eval/serving/serve_check.py runs
    that)."""
    w, q = int(options.get("w", 10)), int(options.get("q", 1))
    q_min = int(options.get("q_min") or q)  # 0 / missing: exactly q query tokens
    if w < 1 or not 1 <= q_min <= q:
        raise ValueError(f"ngram needs w >= 1 and 1 <= q_min <= q, got w={w}, q_min={q_min}, q={q}")
    return {"method": "ngram", "num_speculative_tokens": w, "prompt_lookup_min": q_min, "prompt_lookup_max": q}


def read_engine_args(vllm_dir: Path) -> dict:
    """The extra `LLM(...)` keyword arguments a vLLM export needs ({} for most drafts)."""
    path = Path(vllm_dir) / ENGINE_ARGS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def read_speculative_config(vllm_dir: Path) -> dict:
    path = Path(vllm_dir) / SPECULATIVE_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: {vllm_dir} is not a `specdraft export --format vllm` directory")
    return json.loads(path.read_text())
