"""Our decoder as a `specdraft tune` engine (eval/tune/sweep.py): chains of 1-6 and the family's tree shapes and
sizes, each an EvalConfig override a user can pass to `specdraft eval` (and which eval applies from tuning.json).

Settings, in order: chains of 1..MAX_CHAIN top-1 tokens (unless the family has no chain: CTC); the shapes its
drafter module declares (`tune_shapes`, eval/engine/drafters/registry.py: Medusa, Hydra and DFlash the static
trees wide2 / tree16 / medusa63, EAGLE-3 EAGLE-2 dynamic trees of 4-32 nodes, ReDrafter 2 / 4 / 8 beams, CTC 4-24
paths); for the families that declare `searched_trees` (Medusa, Hydra), trees grown by the tree search
(eval/harness/tree_search.py) on held-out ShareGPT prompts, never the tuning prompts.
A shape the draft cannot run (a chain deeper than its heads) is left out when the settings are listed.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata

import torch

from eval.choice.apply import apply_knobs
from eval.choice.record import machine_info
from eval.engine.backends.choice import choose_backend, make_backend
from eval.engine.decoder import autoregressive_generate, eos_ids, speculative_generate
from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
from eval.harness.config import EvalConfig
from eval.harness.prompts import config_prompts
from eval.tune.sweep import Measurement, Setting

MAX_CHAIN = 6
SEARCHED_SIZES = (4, 8, 16, 32)
ASSUMED_TOKENS_PER_SECOND = 15.0  # a-priori pace of a CPU decode (SmolLM2 fp32 ran at ~22 tok/s, docs/lab)


class OursEngine:
    """Our decoder on a loaded export (models.export.load.LoadedExport), the eval config's prompts, dtype, backend
    and thread count. Sessions share the base and its backend (one decode at a time)."""

    name = "ours"
    open_seconds = 2.0

    def __init__(self, loaded, cfg: EvalConfig, *, searched_tree: bool = True, tree_search_prompts: int = 8,
                 shapes: Sequence[tuple[str, dict]] | None = None, prompts: list | None = None):
        """shapes: (label, knobs) pairs to sweep instead of the family's list (`specdraft demo` sweeps the few
        trees a one-head draft has); a shape the draft cannot run is left out, as in the family's list. prompts:
        cfg's prompts when the caller has already loaded them (config_prompts), else loaded here."""
        self.loaded, self.cfg = loaded, cfg
        self.shapes = None if shapes is None else list(shapes)
        self.family = loaded.family
        self.base = loaded.base
        self.backend = make_backend(cfg.backend, self.base.model)
        self.eos = eos_ids(self.base.model, self.base.tokenizer)
        self.prompts = prompts if prompts is not None else config_prompts(cfg, self.base.tokenizer)
        self.pass_seconds = len(self.prompts) * cfg.max_new_tokens / ASSUMED_TOKENS_PER_SECOND
        self.searched_tree, self.tree_search_prompts = searched_tree, tree_search_prompts
        self.notes: list[str] = []
        self._settings: list[Setting] | None = None

    def describe(self) -> dict:
        try:
            version = metadata.version("specdraft")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return {"engine": "ours", "version": f"specdraft {version}", "family": self.family,
                "backend": choose_backend(self.cfg.backend, self.base.model)[0],
                "dtype": str(next(self.base.model.parameters()).dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(), "machine": machine_info(), "dataset": self.cfg.dataset,
                "prompts": [p.id for p in self.prompts], "max_new_tokens": self.cfg.max_new_tokens,
                "notes": self.notes}

    # -- settings -------------------------------------------------------------------------------------------
    def settings(self) -> list[Setting]:
        if self._settings is None:
            self._settings = [s for s in self._candidates() if s is not None]
        return self._settings

    def _setting(self, label: str, knobs: dict) -> Setting | None:
        """The setting if the draft can run it (its cost: tokens verified per step besides the root)."""
        try:
            drafter, _ = build_drafter(self.loaded.draft, self.loaded.config, apply_knobs(self.cfg, knobs))
        except ValueError:
            return None
        return Setting(label, knobs, float(getattr(drafter, "max_nodes", 1) - 1))

    def _candidates(self):
        if self.shapes is not None:
            yield from (self._setting(label, knobs) for label, knobs in self.shapes)
            return
        f = self.family
        for d in range(1, MAX_CHAIN + 1):
            try:
                knobs = chain_overrides(f, d)
            except ValueError:  # the family has no chain (CTC)
                break
            yield self._setting(f"chain {d}", knobs)
        spec = drafter_family(f)
        for label, knobs in spec.tune_shapes(self.loaded.draft):
            yield self._setting(label, knobs)
        if spec.searched_trees and self.searched_tree:
            for size, choices in self._searched_trees():
                yield self._setting(f"searched tree, {size} nodes", {"tree_choices": choices})

    def _searched_trees(self) -> list[tuple[int, list]]:
        """Trees of SEARCHED_SIZES grown from rank statistics on held-out prompts (the tree search's own steps)."""
        from eval.harness.tree_search import TreeSearchConfig, candidate_sizes, grow_tree, node_hit_counts, tree_choices
        from eval.harness.tree_search_cli import collect_ranks, tuning_prompts

        draft = self.loaded.draft
        ts = TreeSearchConfig(num_prompts=self.tree_search_prompts, new_tokens=48, max_nodes=max(SEARCHED_SIZES),
                              backend=self.cfg.backend, base_path=self.cfg.base_path)
        try:
            prompts = tuning_prompts(ts, self.loaded.config, self.base.tokenizer)
        except ValueError as exc:  # e.g. no held-out ShareGPT conversations: the static trees remain
            self.notes.append(f"no searched trees: {exc}")
            return []
        probe, _ = build_drafter(draft, self.loaded.config, apply_knobs(self.cfg, {"tree_choices": [[0]]}))
        depth = int(draft.num_heads)
        ranks, _ = collect_ranks(self.backend, probe, prompts, self.eos, ts, depth)
        if ranks.shape[0] == 0:
            self.notes.append("no searched trees: the held-out continuations ended at once")
            return []
        grown = grow_tree(node_hit_counts(ranks, ts.max_rank), int(ranks.shape[0]), ts.max_nodes)
        self.notes.append(f"searched trees grown on {len(prompts)} held-out {ts.dataset} prompts "
                          f"({int(ranks.shape[0])} positions)")
        return [(s, tree_choices(grown, s)) for s in candidate_sizes(SEARCHED_SIZES, len(grown))]

    # -- sessions -------------------------------------------------------------------------------------------
    def open(self, setting: Setting):
        if not setting.speculative:
            return _OursSession(self, None)
        drafter, _ = build_drafter(self.loaded.draft, self.loaded.config, apply_knobs(self.cfg, setting.knobs))
        return _OursSession(self, drafter)

    def generate(self, drafter, ids, n):
        if drafter is None:
            return autoregressive_generate(self.backend, ids, max_new_tokens=n, eos_ids=self.eos)
        return speculative_generate(self.backend, drafter, ids, max_new_tokens=n, eos_ids=self.eos)

    def command(self, setting: Setting) -> str:
        """The eval overrides that run the setting (what `specdraft eval` applies from tuning.json)."""
        if not setting.speculative:
            return "plain decoding (no draft)"
        parts = []
        for key, value in setting.knobs.items():
            if key == "extra":
                parts += [f"extra.{k}={v}" for k, v in value.items()]
            elif value is not None:
                parts.append(f"{key}={value}".replace(" ", ""))
        return "specdraft eval --draft <export> " + " ".join(parts)


class _OursSession:
    def __init__(self, engine: OursEngine, drafter):
        self.engine, self.drafter = engine, drafter
        if engine.cfg.warmup_tokens > 0:  # kernels for this tree width, allocator: out of the timed passes
            engine.generate(drafter, engine.prompts[0].input_ids, engine.cfg.warmup_tokens)

    def run(self) -> Measurement:
        e = self.engine
        tokens = steps = verified = accepted = 0
        secs = 0.0
        outputs = {}
        for p in e.prompts:
            g = e.generate(self.drafter, p.input_ids, e.cfg.max_new_tokens)
            tokens += len(g.tokens) - 1  # the prefill's token is not a decode-step token
            secs += g.decode_time
            steps += g.base_steps
            verified += g.tree_nodes - g.base_steps  # drafted tokens verified (the root is the base's own)
            accepted += sum(g.accepted_lengths) - g.base_steps
            outputs[p.id] = list(g.tokens)
        return Measurement(tokens, secs, steps=steps, drafted=verified if self.drafter else None,
                           accepted=accepted if self.drafter else None, outputs=outputs)

    def close(self) -> None:
        self.drafter = None
