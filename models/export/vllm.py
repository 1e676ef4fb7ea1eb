"""`specdraft export --format vllm`: a draft in the layout vLLM loads (docs/howto/serve.md).

Every vLLM export directory holds `speculative_config.json`: the dict to pass as
`LLM(..., speculative_config=...)` (its "model" is this directory's absolute path at export time), and, where
the draft needs more engine arguments, `engine_args.json`: further `LLM(...)` keyword arguments.
A family declares its vLLM method and the exporter below that writes its directory in its FamilyFacts
(`vllm_method`, `exporters["vllm"]`); a family vLLM cannot serve gets an error naming the formats it does have.

Medusa, read from vLLM 0.32's `model_executor/models/medusa.py` + `transformers_utils/configs/medusa.py`:
    model.safetensors
        blocks.{h}.layers.{l}.weight [d, d], .bias [d]   ResBlock l of head h: x + SiLU(W x + b)
        lm_heads.{h}.weight [V, d]                       own LM head per head, or
        lm_head.weight [V or N, d]                       one shared head (config original_lm_head: true)
        token_map [N] int64                              draft vocabulary: draft id -> base id (d2t)
    config.json  model_type "medusa", num_heads, num_hidden_layers (ResBlocks per head), hidden_size,
                 vocab_size (the base's V), truncated_vocab_size (N, = V without a draft vocabulary),
                 medusa_fc_bias: true (our ResBlocks have a bias), original_lm_head
vLLM drafts a chain of each head's top-1 (no tree): head h's argmax is the token at depth h+1, so its
per-position acceptance equals our decoder's with the chain tree of the same length.

Draft vocabulary: a draft that predicts over N < V tokens carries a persistent buffer `d2t` [N] int64
(draft id -> base id) and `"draft_vocab_size": N` in its specdraft config.json (0 or missing = the full
vocabulary). vLLM scatters the N logits into a [V] row at `token_map` (-inf elsewhere). vLLM 0.32 sizes
per-head LM heads by V even with a token map, so it reads a draft vocabulary only with the shared head.
vLLM 0.32's `MedusaModel.load_weights` also never reports `token_map` as loaded, so the loader's strict
check ("Following weights were not initialized from checkpoint: {'token_map'}") refuses every export with a
draft vocabulary although the map was read. `engine_args.json` turns that check off for such an export
(`model_loader_extra_config={"enable_weights_track": false}`); serve-check and compare then verify the
engine's output token by token against plain decoding instead.

N-gram: vLLM's `ngram` method is prompt lookup (one row of up to num_speculative_tokens tokens copied
after the earliest match of the longest suffix of n tokens, prompt_lookup_min <= n <= prompt_lookup_max).
Ours with strategy=longest_match (k=1) is that rule; our context ranking and model bigram rows have no vLLM
counterpart.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import write_dir_atomic
from models.draft import BaseView
from models.export.specdraft import draft_tensors
from models.registry import FAMILIES, vllm_schedule_methods
from models.vocab_map import check_fits

SPECULATIVE_CONFIG_FILE = "speculative_config.json"
ENGINE_ARGS_FILE = "engine_args.json"  # extra LLM(...) keyword arguments the draft needs (absent = none)
# vLLM 0.32 Medusa + token_map: load_weights reads the map but does not report it loaded (module docstring).
MEDUSA_TOKEN_MAP_ENGINE_ARGS = {"model_loader_extra_config": {"enable_weights_track": False}}
# `specdraft tune` stores vLLM's fastest speculative-token count under this key of the export's config.json (only
# when speculating beat vLLM AR); the exporters below write it instead of the draft's trained depth.
TUNED_TOKENS_KEY = "vllm_num_speculative_tokens"
# `specdraft tune --concurrency` stores vLLM's per-batch-size schedule under this key: [[start, end, k], ...], vLLM's
# speculative_config `num_speculative_tokens_per_batch_size` (inclusive batch-size ranges from 1; k = 0 drafts
# nothing; vLLM caps each k at num_speculative_tokens, so the exporters set that to the largest k).
TUNED_SCHEDULE_KEY = "vllm_num_speculative_tokens_per_batch_size"
# vLLM 0.32 methods whose proposer drafts the count the scheduler picks per step (v1/spec_decode/
# llm_base_proposer.py: propose(num_speculative_tokens, ...), 0 returning no drafts): the families declaring
# FamilyFacts.vllm_schedule. Medusa's proposer asserts the configured count (v1/spec_decode/medusa.py), so a Medusa
# export never gets a schedule.
SCHEDULE_METHODS = vllm_schedule_methods()


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


def medusa_vllm_tensors(draft, base: BaseView, d2t: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Our Medusa state dict -> vLLM's Medusa tensor names (see the module docstring)."""
    ours = draft_tensors(draft)
    out: dict[str, torch.Tensor] = {}
    for h in range(draft.num_heads):
        for i in range(draft.num_layers):
            out[f"blocks.{h}.layers.{i}.weight"] = ours[f"heads.{h}.{i}.linear.weight"]  # [d, d]
            out[f"blocks.{h}.layers.{i}.bias"] = ours[f"heads.{h}.{i}.linear.bias"]  # [d]
    if draft.share_lm_head:
        w = base.lm_head_weight.detach().cpu()  # [V, d], the frozen base head the heads were trained on
        out["lm_head.weight"] = (w if d2t is None else w.index_select(0, d2t)).contiguous().clone()  # [V|N, d]
    else:
        if d2t is not None:
            raise ValueError(
                f"this Medusa draft has {draft.num_heads} own LM heads over a draft vocabulary of {d2t.numel()} "
                "tokens; vLLM 0.32 reads a draft vocabulary (token_map) only with one shared LM head (it sizes "
                "per-head LM heads by the full vocabulary). Train with draft.share_lm_head=true, or without a "
                "draft vocabulary, or use --format specdraft / medusa with our decoder")
        for h in range(draft.num_heads):
            out[f"lm_heads.{h}.weight"] = ours[f"heads.{h}.{draft.num_layers}.weight"]  # [V, d]
    if d2t is not None:
        out["token_map"] = d2t  # [N] int64
    return out


def medusa_vllm_config(draft, base: BaseView, d2t: torch.Tensor | None, export_cfg: dict) -> dict:
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": base.hidden_size,
        "vocab_size": base.vocab_size,  # vLLM scatters draft-vocabulary logits back into a [V] row
        "truncated_vocab_size": base.vocab_size if d2t is None else int(d2t.numel()),
        "num_heads": draft.num_heads,
        "num_hidden_layers": draft.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": bool(draft.share_lm_head),
        # Provenance (vLLM ignores unknown keys): serve-check compares the fingerprint with the base it serves.
        "base_model_name_or_path": export_cfg.get("base_model"),
        "base_fingerprint": export_cfg.get("base_fingerprint"),
        "specdraft_family": "medusa",
    }


def export_vllm_medusa(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    d2t = draft_vocabulary(draft, export_cfg, base.vocab_size)
    tensors = medusa_vllm_tensors(draft, base, d2t)
    config = medusa_vllm_config(draft, base, d2t, export_cfg)
    out_dir = Path(out_dir)
    spec = {"method": "medusa", "model": str(out_dir.resolve()),
            "num_speculative_tokens": speculative_tokens(export_cfg, draft.num_heads)}
    files = {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
        SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(json.dumps(spec, indent=2) + "\n"),
    }
    if d2t is not None:
        files[ENGINE_ARGS_FILE] = lambda p: p.write_text(json.dumps(MEDUSA_TOKEN_MAP_ENGINE_ARGS, indent=2) + "\n")
    return write_dir_atomic(out_dir, files)


def vllm_ngram_config(options: dict) -> dict:
    """Our N-gram options (eval extra: w tokens per row, q query tokens) -> vLLM's speculative_config.

    vLLM proposes one row: its counterpart is our strategy=longest_match with k=1 (eval/serving/serve_check.py runs
    that)."""
    w, q = int(options.get("w", 10)), int(options.get("q", 1))
    q_min = int(options.get("q_min") or q)  # 0 / missing: exactly q query tokens
    if w < 1 or not 1 <= q_min <= q:
        raise ValueError(f"ngram needs w >= 1 and 1 <= q_min <= q, got w={w}, q_min={q_min}, q={q}")
    return {"method": "ngram", "num_speculative_tokens": w, "prompt_lookup_min": q_min, "prompt_lookup_max": q}


def export_vllm_ngram(options: dict, out_dir: Path) -> Path:
    spec = vllm_ngram_config(options)
    return write_dir_atomic(Path(out_dir), {
        SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(json.dumps(spec, indent=2) + "\n")})


def export_vllm_eagle3(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """EAGLE-3 in speculators format (models/export/speculators.py; d2t/t2d carry the draft vocabulary), plus the
    speculative_config vLLM needs: method eagle3, a chain of ttt_steps drafts (what the draft was trained for).
    A P-EAGLE draft (parallel_drafting) is written as speculators' peagle and adds `parallel_drafting: true`: vLLM
    drafts its ttt_steps tokens from one forward (never on a per-batch-size schedule: not measured with it)."""
    from models.export.speculators import export_speculators

    n = speculative_tokens(export_cfg, draft.ttt_steps)
    out_dir = export_speculators(draft, Path(out_dir), export_cfg.get("base_model") or "base", speculative_tokens=n)
    spec = {"method": "eagle3", "model": str(Path(out_dir).resolve()), "num_speculative_tokens": n}
    if getattr(draft, "parallel_drafting", False):
        spec["parallel_drafting"] = True
    else:
        spec = scheduled_config(spec, export_cfg)
    (Path(out_dir) / SPECULATIVE_CONFIG_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    return Path(out_dir)


def export_vllm_dflash(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """DFlash in speculators format (models/export/speculators_dflash.py: Qwen3-shaped layers, d2t/t2d, the learned
    mask embedding in mask_embedding.pt), plus the speculative_config vLLM needs: method dflash, the block's
    block_size - 1 drafts (vLLM's query is the root + num_speculative_tokens mask slots)."""
    from models.export.speculators import verifier_path
    from models.export.speculators_dflash import export_dflash_speculators

    out_dir = Path(out_dir)
    spec = scheduled_config({"method": "dflash", "model": str(out_dir.resolve()),
                             "num_speculative_tokens": speculative_tokens(export_cfg, draft.block_size - 1)},
                            export_cfg)
    return export_dflash_speculators(draft, out_dir, verifier_path(export_cfg.get("base_model") or "base"),
                                     extra_files={SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(
                                         json.dumps(spec, indent=2) + "\n")})


def export_vllm_dspark(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """DSpark in speculators format (models/export/speculators_dspark.py: DFlash's layers + the Markov and confidence
    heads), plus the speculative_config vLLM needs: method dspark, the block's block_size drafts (every slot drafts,
    the root's included: sample_from_anchor)."""
    from models.export.speculators import verifier_path
    from models.export.speculators_dspark import export_dspark_speculators

    out_dir = Path(out_dir)
    spec = {"method": "dspark", "model": str(out_dir.resolve()),
            "num_speculative_tokens": speculative_tokens(export_cfg, draft.block_size)}
    return export_dspark_speculators(draft, out_dir, verifier_path(export_cfg.get("base_model") or "base"),
                                     extra_files={SPECULATIVE_CONFIG_FILE: lambda p: p.write_text(
                                         json.dumps(spec, indent=2) + "\n")})


def export_vllm(draft, out_dir: Path, export_cfg: dict, base: BaseView) -> Path:
    """Hand a trained draft to its family's vLLM exporter (FamilyFacts.exporters["vllm"], one of the functions above),
    or fail naming the formats it has."""
    family = export_cfg.get("family", getattr(draft, "family", "?"))
    facts = FAMILIES.get(family)
    if facts is None or not facts.trainable or facts.vllm_method is None:
        have = ", ".join(facts.export_formats if facts else ("specdraft",))
        servable = ", ".join(n for n, f in FAMILIES.items() if f.trainable and f.vllm_method)
        free = ", ".join(n for n, f in FAMILIES.items() if not f.trainable and f.vllm_method)
        raise ValueError(f"vLLM cannot serve a {family!r} draft (vLLM 0.32 serves {servable} drafts and its own "
                         f"{free}); formats for {family}: {have} (`specdraft export --format ...`), and our decoder "
                         "(`specdraft eval`) runs it")
    return facts.writer("vllm")(draft, out_dir, export_cfg, base)


def read_engine_args(vllm_dir: Path) -> dict:
    """The extra `LLM(...)` keyword arguments a vLLM export needs ({} for most drafts)."""
    path = Path(vllm_dir) / ENGINE_ARGS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def read_speculative_config(vllm_dir: Path) -> dict:
    path = Path(vllm_dir) / SPECULATIVE_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: {vllm_dir} is not a `specdraft export --format vllm` directory")
    return json.loads(path.read_text())
