"""Typed config of `specdraft compare` (configs/compare.yaml): which drafts, which eval settings.

A compare run evaluates several drafts on the same prompts, side by side in ONE process: per prompt,
own AR decoding, transformers `generate` (greedy settings) and every draft run back to back, so all
methods share the same machine state and the speed ratios are measured in one run.

    drafts:    [{label, export | method, settings?, tree_nodes?, eval?, headline?, vllm?}]
      label       row name in the tables ("Medusa", "N-gram", ...); also the report directory name
      export      runs/<run>/export of a trained draft     | method: a learning-free method (ngram)
      settings    only these setting names (default: all)
      tree_nodes  use the first N nodes grown by `specdraft tree-search` (<run>/tree_search/tree_search.json)
      eval        EvalConfig overrides for this draft only (tree, extra.beam_width, extra.k, ...)
      headline    {family: NAME, draft: tree | chain}: this row is that family's tree (or chain) column in
                  the one-row-per-family headline table of docs/lab/results.md
      vllm        true: vLLM serves this draft too, in every setting of `vllm_settings` (eval/serving/compare_vllm.py);
                  the row must be the chain vLLM drafts (Medusa: top-1 per head, EAGLE-3: chain mode, N-gram:
                  k=1 with strategy=longest_match, vLLM's prompt lookup), so the acceptance must match ours
    settings:  [{name, <EvalConfig overrides>}]  e.g. dataset=mtbench, acceptance=rejection, temperature=0.7
    eval:      EvalConfig overrides shared by every setting (dtype, backend, max_new_tokens, ...)
    vllm_settings: greedy setting names where vLLM AR + every `vllm: true` row run in .venv-vllm (`make vllm`)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from core.config_loader import ConfigError, load_typed
from eval.harness.config import EvalConfig, validate_eval
from eval.harness.results_doc import SAME_BUDGET_TITLE, Targets

_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+\-]*$")  # a directory name, no spaces or slashes
_DRAFT_KEYS = {"label", "export", "method", "settings", "tree_nodes", "eval", "headline", "vllm"}
HEADLINE_DRAFTS = ("tree", "chain")
_PER_DRAFT_EVAL = {"tree", "tree_choices", "extra", "acceptance", "typical_eps", "typical_delta"}


@dataclass
class CompareConfig:
    out_dir: str = "runs/compare"  # <out_dir>/<setting>/{prompts.jsonl, <label>/report.json}, summary.json
    base_path: str = "smollm2"  # the base every row decodes with (loaded once)
    results_md: str = ""  # regenerated between its markers after every compare run; "" = <out_dir>/results.md
    results_img: str = ""  # prefix of the plots; "" = <out_dir>/img/results
    # Where `specdraft compare --update-docs` writes the same tables instead (a checked-in results document);
    # "" = this config has none, and --update-docs is an error.
    docs_md: str = ""
    docs_img: str = ""  # plot prefix that goes with docs_md
    targets: dict = field(default_factory=dict)  # results_doc.Targets: what the tables mark met or missed
    results_section: str = ""  # "" = the default markers of results_md; a name (e.g. "best") = its own part
    results_training_title: str = SAME_BUDGET_TITLE  # heading of the training table
    eval: dict = field(default_factory=dict)  # EvalConfig keys shared by every setting
    settings: list[dict] = field(default_factory=list)  # [{name, <EvalConfig keys>}]: the prompt sets and rules
    # an evaluation suite (configs/eval/suites/<name>.yaml): one more greedy setting per set, `suite-<set>`, with
    # the shared `eval` keys; its held-out ShareGPT sets skip eval.heldout_skip conversations (required then)
    suite: str = ""
    suite_prompts: int | None = None  # prompts per suite set; None = the suite file's num_prompts
    drafts: list[dict] = field(default_factory=list)  # the rows (module docstring: label, export | method, ...)
    extra_drafts: list[dict] = field(default_factory=list)  # appended to drafts: lets an overlay YAML add rows
    # (a second --config's `drafts` list would replace the first's, as lists do not merge)
    vllm_settings: list[str] = field(default_factory=list)  # greedy settings vLLM runs too ([] = no vLLM)
    vllm_timeout: float = 1800.0  # seconds per vLLM engine (a first run compiles the model)
    vllm_tolerance: float = 0.03  # max |vLLM - ours| per-position acceptance before the check fails
    vllm_enforce_eager: bool = False  # skip vLLM's torch.compile: minutes saved per engine, slower decoding
    # The field benchmark as a column (eval/field/compare.py): stored base answers (`specdraft field-refs`)
    # every draft row with an export is judged on, with its shape in the first greedy setting; "" = none
    field_refs: str = ""
    field_prompts: int | None = None  # prompts per stored set; None = all
    field_sets: list[str] = field(default_factory=list)  # the stored sets judged; [] = all
    redo: list[str] = field(default_factory=list)  # labels to run again although stored (`--redo LABEL`): their
    # new rows are timed beside freshly timed baselines, and replace the stored ones in every table


@dataclass
class DraftEntry:
    label: str
    export: Path | None
    method: str | None
    settings: list[str] | None
    tree_nodes: int | None
    eval: dict
    headline: tuple[str, str] | None = None  # (family name, "tree" | "chain")
    vllm: bool = False

    def runs_in(self, setting: str) -> bool:
        """Whether this draft is compared in `setting` (no `settings` list = every setting)."""
        return self.settings is None or setting in self.settings


def _eval_config(where: str, *layers: dict) -> EvalConfig:
    """EvalConfig defaults + each overrides dict in order, validated (clear error naming `where`)."""
    merged: dict = {}
    for layer in layers:
        for k, v in layer.items():
            merged[k] = {**merged.get(k, {}), **v} if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown eval key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
    try:
        return validate_eval(EvalConfig(**merged))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def setting_configs(cfg: CompareConfig) -> dict[str, EvalConfig]:
    """name -> EvalConfig of every setting (shared `eval` overrides, then the setting's own)."""
    if not cfg.settings:
        raise ConfigError("compare config: `settings` is empty; add at least one, e.g. {name: mtbench-greedy, "
                          "dataset: mtbench}")
    out = {}
    for i, s in enumerate(cfg.settings):
        s = dict(s)
        name = s.get("name")
        if not isinstance(name, str) or not _LABEL.match(name):
            raise ConfigError(f"settings[{i}]: needs a `name` usable as a directory (letters, digits, _.+-), "
                              f"got {name!r}")
        if name in out:
            raise ConfigError(f"settings[{i}]: duplicate setting name {name!r}")
        out[name] = _eval_config(f"settings[{i}] ({name})", cfg.eval, s)
    if cfg.suite:
        out.update(_suite_settings(cfg))
    return out


def _suite_settings(cfg: CompareConfig) -> dict[str, EvalConfig]:
    """`suite-<set>` -> EvalConfig for every set of cfg.suite, its prompts written under <out_dir>/suite/prompts/."""
    from eval.harness.eval_sets import is_heldout
    from eval.harness.suite import load_suite, write_set_prompts

    suite = load_suite(cfg.suite)
    skip = cfg.eval.get("heldout_skip")
    out = {}
    for s in suite.sets:
        if is_heldout(s.dataset) and skip is None:
            raise ConfigError(f"suite {suite.name!r}: set {s.name!r} reads held-out ShareGPT; set eval.heldout_skip "
                              "to the largest data.max_records of the compared drafts")
        path = write_set_prompts(s, Path(cfg.out_dir) / "suite", skip)  # <out_dir>/suite/prompts/<set>.jsonl
        keys = {"dataset": str(path), "num_prompts": cfg.suite_prompts or suite.num_prompts}
        out[f"suite-{s.name}"] = _eval_config(f"suite {suite.name} ({s.name})", cfg.eval, keys)
    return out


def draft_entries(cfg: CompareConfig, setting_names: list[str]) -> list[DraftEntry]:
    """Validated draft entries; exports must exist (a typo fails here, before any model is loaded)."""
    drafts = [*cfg.drafts, *cfg.extra_drafts]
    if not drafts:
        raise ConfigError("compare config: `drafts` is empty; add e.g. {label: Medusa, export: runs/x/export}")
    out, seen = [], set()
    for i, d in enumerate(drafts):
        where = f"drafts[{i}]"
        bad = sorted(set(d) - _DRAFT_KEYS)
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad}; valid: {', '.join(sorted(_DRAFT_KEYS))}")
        label = d.get("label")
        if not isinstance(label, str) or not _LABEL.match(label) or label in ("ar", "hf"):
            raise ConfigError(f"{where}: `label` must be a directory-safe name other than ar/hf, got {label!r}")
        if label in seen:
            raise ConfigError(f"{where}: duplicate label {label!r}")
        seen.add(label)
        if ("export" in d) == ("method" in d):
            raise ConfigError(f"{where} ({label}): give exactly one of `export` (a trained draft) or `method` (ngram)")
        export = Path(d["export"]) if "export" in d else None
        if export is not None and not (export / "config.json").is_file():
            raise ConfigError(f"{where} ({label}): {export}/config.json not found; train it first "
                              "(recipes/compare.sh trains every draft of configs/compare.yaml)")
        only = d.get("settings")
        if only is not None:
            unknown = sorted(set(only) - set(setting_names))
            if unknown:
                raise ConfigError(f"{where} ({label}): unknown setting(s) {unknown}; defined: {setting_names}")
        extra_eval = dict(d.get("eval") or {})
        bad = sorted(set(extra_eval) - _PER_DRAFT_EVAL)
        if bad:
            raise ConfigError(f"{where} ({label}): per-draft eval keys {bad} not allowed (they would make the "
                              f"comparison unfair); allowed: {', '.join(sorted(_PER_DRAFT_EVAL))}")
        nodes = d.get("tree_nodes")
        if nodes is not None and (not isinstance(nodes, int) or nodes < 1 or export is None):
            raise ConfigError(f"{where} ({label}): tree_nodes needs a trained export and an int >= 1, got {nodes!r}")
        out.append(DraftEntry(label, export, d.get("method"), list(only) if only else None, nodes, extra_eval,
                              _headline(d.get("headline"), f"{where} ({label})"), _flag(d, "vllm", where, label)))
    return out


def _headline(value, where: str) -> tuple[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or set(value) != {"family", "draft"} or not isinstance(value["family"], str)
            or value["draft"] not in HEADLINE_DRAFTS):
        raise ConfigError(f"{where}: `headline` must be {{family: NAME, draft: tree|chain}}, got {value!r}")
    return value["family"], value["draft"]


def _flag(d: dict, key: str, where: str, label: str) -> bool:
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where} ({label}): `{key}` must be true or false, got {value!r}")
    return value


def vllm_setting_names(cfg: CompareConfig, settings: dict[str, EvalConfig]) -> list[str]:
    """The validated `vllm_settings`: known, greedy (vLLM's check compares greedy chains) settings."""
    names = list(cfg.vllm_settings or [])
    for name in names:
        if name not in settings:
            raise ConfigError(f"vllm_settings: unknown setting {name!r}; defined: {list(settings)}")
        if settings[name].temperature != 0 or settings[name].acceptance != "greedy":
            raise ConfigError(f"vllm_settings: setting {name!r} is not greedy; vLLM's acceptance check compares "
                              "greedy chains (temperature 0, acceptance greedy)")
    return names


def searched_tree(export: Path, nodes: int) -> list[list[int]]:
    """The first `nodes` nodes grown by the tree search of this run (greedy growth order, so any prefix is
    the best tree of that size found)."""
    import json

    path = export.parent / "tree_search" / "tree_search.json"
    if not path.is_file():
        raise ConfigError(f"tree_nodes={nodes}: {path} not found; run `specdraft tree-search --draft {export}`")
    grown = [n["choice"] for n in json.loads(path.read_text())["nodes"]]
    if len(grown) < nodes:
        raise ConfigError(f"tree_nodes={nodes}: the search in {path} grew only {len(grown)} nodes")
    return grown[:nodes]


def load_compare_config(config_paths: list[str] | None, overrides: list[str] | None = None) -> CompareConfig:
    cfg = load_typed(CompareConfig, config_paths, overrides)
    if cfg.results_section and not re.fullmatch(r"[a-z0-9_]+", cfg.results_section):
        raise ConfigError(f"results_section={cfg.results_section!r}: use lowercase letters, digits and _ (it names "
                          "the HTML-comment markers of its part of results_md), or \"\" for the default part")
    return cfg


def results_paths(cfg: CompareConfig, update_docs: bool = False) -> tuple[Path, Path]:
    """(results markdown, plot prefix) a compare run writes: under its out_dir by default, the config's docs_md /
    docs_img with --update-docs."""
    if update_docs:
        if not cfg.docs_md:
            raise ConfigError("--update-docs: this compare config names no results document (docs_md, docs_img); "
                              f"its tables are in {cfg.results_md or Path(cfg.out_dir) / 'results.md'}")
        return Path(cfg.docs_md), Path(cfg.docs_img or Path(cfg.docs_md).with_suffix("").as_posix() + "_img/results")
    out = Path(cfg.out_dir)
    return Path(cfg.results_md or out / "results.md"), Path(cfg.results_img or out / "img" / "results")


def compare_targets(cfg: CompareConfig) -> Targets:
    try:
        return Targets.from_config(cfg.targets)
    except ValueError as exc:
        raise ConfigError(f"compare config: {exc}") from exc
