"""The shape `specdraft eval` decodes when no tuning.json choice applies on this machine: a short probe, not the
export's default.

Why: an export's default shape is what its trainer guessed for another machine. The shipped EAGLE-3's default is a
16-node dynamic tree; on a CPU decoding in fp32 it verifies 16 tokens a step and ran at 0.31x own AR
(docs/lab/benchmarks.md), while a chain of 1-2 runs above AR on every CPU kind measured. So an eval that has no
applicable tuning sweeps a few cheap shapes first: chains of 1..PROBE_CHAIN top-1 tokens and the export's default,
PROBE_PROMPTS held-out prompts of PROBE_TOKENS tokens, PROBE_REPEATS paired passes against own AR each
(eval/tune/sweep.py: sweep_engine, the tuner's own statistics), and decodes the one it chooses. Of shapes the noise
cannot separate it takes the faster measured one (an eval reports the speed it reaches); when none beats AR it
takes the fastest measured one and says so. The probe is no tune: the summary's first line still says the speed
column is untuned, names the shape and its probe speed, and gives the `specdraft tune` command.

The probe's choice is kept under the user cache ($SPECDRAFT_CACHE, else ~/.cache/specdraft): shape_probe/<key
hash>.json, keyed by what its timing depends on (the draft's weights and config, the CPU, torch, the dtype, the
thread count, the backend, the acceptance rule, specdraft's version), so a suite's sets and later evals on this
machine probe once. Beside it the file keeps its provenance (core/keyed_cache.py: the host, the CPU's model and
kernel flags, PROBE_CODE's version, the load around the probe, the date): a choice probed on another host or CPU,
by other code, or on a loaded machine is probed again, with one line saying why. With PROBE_REPEATS under tune's
MIN_REPEATS its choice is a quick one ("quick": true, eval/choice/record.py: repeats_mark): it picks the shape
an untuned eval decodes and is never reported as tuned. Never written into the export (a shipped draft's directory
is tracked). `untuned_probe=false` decodes the export's default instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

from core.keyed_cache import code_version, keyed_path, provenance, read_keyed, write_keyed
from core.load import LoadWatch

log = logging.getLogger("specdraft.untuned_probe")

PROBE_DIR = "shape_probe"
PROBE_FORMAT = 2  # 1: the export's default was timed as plain AR (empty knobs)
PROBE_CHAIN = 3  # chains of 1..3: deeper ones verify more tokens a step than a CPU gets back at today's acceptance
PROBE_PROMPTS = 2
PROBE_TOKENS = 32
PROBE_PROMPT_TOKENS = 256  # longer held-out prompts are skipped: each pass prefills every prompt again
PROBE_REPEATS = 2
PROBE_WARMUP = 4
PROBE_BUDGET_S = 300.0
TIE = "faster"
DEFAULT_LABEL = "the export's default"
# The code whose timing a cached choice holds: this probe, the sweep and its statistics, our decoder as a tune
# engine, the decode loop and its backends. Another version of any of them probes again.
_EVAL = Path(__file__).resolve().parents[1]
PROBE_CODE = (Path(__file__).resolve(), _EVAL / "tune" / "sweep.py", _EVAL / "tune" / "ours.py",
              _EVAL / "tune" / "choice" / "stats.py", _EVAL / "engine" / "decoder.py", _EVAL / "engine" / "tree.py",
              *(_EVAL / "engine" / "backends" / f for f in ("backend.py", "fast.py", "fast_core.py", "fast_matmul.py",
                                                             "hf.py")))


def probe_code_version() -> str:
    """The version of the code a cached choice was probed by (PROBE_CODE's source digest)."""
    return code_version(PROBE_CODE)


# The export's default shape as a setting: `tree=auto` is the eval config's own default (the export's shape, else the
# family's), so applying it changes nothing; the knobs must not be empty, since the sweep takes a setting with no
# knobs for plain AR decoding (eval/tune/sweep.py: Setting.speculative).
DEFAULT_KNOBS = {"tree": "auto"}


def probe_shapes(family: str) -> list[tuple[str, dict]]:
    """(label, knobs) of the probe: chains of 1..PROBE_CHAIN where the family has a chain, and the export's default
    shape (DEFAULT_KNOBS)."""
    from eval.engine.drafters.registry import chain_overrides

    shapes = []
    for d in range(1, PROBE_CHAIN + 1):
        try:
            shapes.append((f"chain {d}", chain_overrides(family, d)))
        except ValueError:  # the family has no chain (CTC)
            break
    return [*shapes, (DEFAULT_LABEL, dict(DEFAULT_KNOBS))]


def draft_digest(export_dir: Path) -> str:
    """16 hex chars of sha256 over the export's config.json and weights (*.safetensors): the draft the probe timed."""
    h = hashlib.sha256()
    for path in sorted(Path(export_dir).glob("*.safetensors")) + [Path(export_dir) / "config.json"]:
        if path.is_file():
            h.update(path.name.encode())
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def probe_key(export_dir: Path, cfg, here: dict, family: str) -> dict:
    """What the probe's choice holds for: the draft, the CPU (model and flags), torch, where the eval runs
    (eval/choice/apply.py: ours_here: device, dtype, threads, specdraft's version), the backend asked for and
    the shapes probed."""
    import torch

    from core.dtype_probe_cache import cpu_signature

    # the acceptance rule and temperature change what a shape accepts, so a sampling eval is probed on its own
    key = {"format": PROBE_FORMAT, "draft": draft_digest(export_dir), **cpu_signature(), "torch": torch.__version__,
           **{k: here.get(k) for k in ("device", "gpu", "dtype", "threads", "version")}, "backend": cfg.backend,
           "acceptance": cfg.acceptance, "temperature": cfg.temperature, "shapes": probe_shapes(family)}
    return json.loads(json.dumps(key))  # as the cache file reads back (tuples become lists), so the two compare


def cache_path(key: dict, cache_dir: Path | None = None) -> Path:
    return keyed_path(PROBE_DIR, key, cache_dir)


def _check_choice(choice) -> str | None:
    """None when `choice` is a usable cached choice (a label and knobs), else what is wrong with it."""
    if not isinstance(choice, dict) or not isinstance(choice.get("label"), str) \
            or not isinstance(choice.get("knobs"), dict):
        return "no shape (label and knobs)"
    return None


def read_cached(key: dict, cache_dir: Path | None = None, *, code: str | None = None) -> dict | None:
    """The choice cached for `key`, or None: none yet (silently), a bad file (a warning naming it), or, with `code`
    (PROBE_CODE's version), a choice probed elsewhere, by other code or loaded (one line says why); probed again."""
    return read_keyed(PROBE_DIR, key, "choice", _check_choice, "shape probe cache", log, cache_dir, code=code)


def summarize(record: dict) -> dict:
    """From a sweep record (sweep_engine): what the eval decodes and why. label / knobs: the shape; speedup: its
    probe speed against own AR (the confirmation's when it was confirmed); beats_ar: whether the probe's statistics
    said it beats AR; points: every measured shape's label, speedup and acceptance."""
    points = [p for p in record.get("points", []) if p.get("status") == "ok" and p.get("speedup") is not None]
    choice = record.get("choice") or {}
    if choice.get("speculate"):  # eval/choice/stats.py: choose, then sweep.py: judge_confirmation
        best = {"label": choice["label"], "knobs": choice["knobs"], "speedup": choice.get("speedup_vs_ar"),
                "beats_ar": True, "reason": choice.get("reason", "")}
    elif points:  # none beat AR: the fastest measured shape (an eval of a draft still drafts)
        p = max(points, key=lambda q: q["speedup"])
        best = {"label": p["label"], "knobs": p["knobs"], "speedup": p["speedup"], "beats_ar": False,
                "reason": "no shape beat own AR in the probe; the fastest measured one"}
    else:
        best = {"label": DEFAULT_LABEL, "knobs": dict(DEFAULT_KNOBS), "speedup": None, "beats_ar": False,
                "reason": f"nothing measured ({record.get('error') or 'every shape failed or was skipped'})"}
    best["points"] = [{"label": p["label"], "speedup": p["speedup"], "acceptance_length": p.get("acceptance_length")}
                      for p in points]
    best["prompts"] = len(record.get("prompts") or [])
    best["max_new_tokens"] = record.get("max_new_tokens")
    best.update({k: record[k] for k in ("repeats", "quick") if k in record})  # the repeat rule's mark
    return best


def probe_config(cfg, export_dir: Path, tokenizer) -> tuple[object, list | None]:
    """(the eval config the probe decodes, its prompts when already loaded): held-out ShareGPT (the conversations
    after the draft's training ones; never the prompts the eval reports), else the eval's own set drawn with another
    seed (the draft trained on every ShareGPT conversation, or the ShareGPT package is not installed, as in the GPU
    image; its prompts None: the engine loads them); PROBE_PROMPTS x PROBE_TOKENS; no HF baseline; the eval's
    dtype, backend, device and threads."""
    from eval.harness.prompts import config_prompts
    from eval.harness.runner import resolve_heldout_skip
    from models.export.specdraft import read_export_config

    # seed + 1: another draw than the eval's (an eval of dataset=sharegpt skips the same training conversations)
    probe = dataclasses.replace(cfg, name="shape-probe", suite="", suite_sets=[], num_prompts=PROBE_PROMPTS,
                                max_new_tokens=PROBE_TOKENS, hf_baseline=False, warmup_tokens=PROBE_WARMUP,
                                max_prompt_tokens=PROBE_PROMPT_TOKENS, both_turns=False, seed=cfg.seed + 1)
    try:
        held = resolve_heldout_skip(dataclasses.replace(probe, dataset="sharegpt", heldout_skip=None),
                                    read_export_config(export_dir))
        return held, config_prompts(held, tokenizer)  # loadable here (the package is installed, prompts are left)
    except (ValueError, ImportError, OSError) as exc:
        log.warning("shape probe: no held-out ShareGPT prompts (%s); probing on the eval's own set %s, drawn with "
                    "seed %d", exc, cfg.dataset, probe.seed)
        return probe, None


def probe_untuned_shape(loaded, cfg, export_dir: Path, here: dict, budget_s: float = PROBE_BUDGET_S,
                        cache_dir: Path | None = None) -> dict:
    """The shape an untuned eval decodes (summarize's dict, with "cached": whether it was read from the cache and
    "cache_file"). `loaded`: the eval's loaded export (models.export.load.LoadedExport), reused, not loaded again."""
    from eval.tune.command import progress_bar
    from eval.tune.ours import OursEngine
    from eval.tune.sweep import sweep_engine

    shapes = probe_shapes(loaded.family)
    if len(shapes) < 2:  # a family without a chain: the export's default is the only shape, nothing to choose
        return {"label": DEFAULT_LABEL, "knobs": dict(DEFAULT_KNOBS), "speedup": None, "beats_ar": False,
                "points": [], "prompts": 0,
                "reason": "the family has no chain: the export's default is the only shape", "cached": False}
    key = probe_key(export_dir, cfg, here, loaded.family)
    code = probe_code_version()
    cached = read_cached(key, cache_dir, code=code)
    if cached is not None:
        return {**cached, "cached": True}
    pcfg, prompts = probe_config(cfg, export_dir, loaded.base.tokenizer)
    engine = OursEngine(loaded, pcfg, searched_tree=False, shapes=shapes, prompts=prompts)
    t0 = time.monotonic()
    watch = LoadWatch()
    bar, progress = progress_bar([engine], desc="shape probe")
    with bar:
        record = sweep_engine(engine, PROBE_REPEATS, time.monotonic() + budget_s, progress, tie=TIE)
    choice = summarize(record)
    choice["load"] = watch.record()
    choice["seconds"] = round(time.monotonic() - t0, 1)
    choice["dataset"] = pcfg.dataset
    if not choice["points"]:  # nothing measured (AR failed, the budget ran out): not kept, the next eval tries again
        return {**choice, "cached": False}
    try:
        path = write_keyed(PROBE_DIR, key, "choice", choice, cache_dir, prov=provenance(code, choice["load"]),
                           measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    except OSError as exc:  # a read-only cache costs the next eval a probe, not this eval its result
        log.warning("shape probe: could not keep the choice in %s (%s); the next eval probes again",
                    cache_path(key, cache_dir), exc)
        return {**choice, "cached": False}
    return {**choice, "cached": False, "cache_file": str(path)}

