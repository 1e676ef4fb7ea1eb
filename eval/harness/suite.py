"""Evaluation suites: several prompt sets decoded in one pass, one table and one plot (`specdraft eval --suite`).

A suite is one YAML under configs/eval/suites/<name>.yaml: `num_prompts` (per set) and `sets`, name -> where its
prompts come from (`dataset`: a set of the eval-set registry, eval/harness/eval_sets.py: mtbench, humaneval or
sharegpt; and the options that set takes: `categories`, the MT-bench categories to keep; `domain`, a ShareGPT domain
of eval/harness/domains.py). Each set's prompts are written as a JSONL under the suite's report
directory (`prompts/<set>.jsonl`, what `dataset=<file>.jsonl` reads), so a set can be rerun alone, and evaluated
by `evaluate` with the same base, drafter and eval settings as every other set: per set, its own AR baseline and the
usual report directory; over the sets, suite.json / suite.md / suite.png.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from core.paths import CONFIGS
from eval.harness.domains import DOMAINS
from eval.harness.eval_sets import EVAL_SETS

SUITES = CONFIGS / "eval" / "suites"
DATASETS = tuple(EVAL_SETS)


@dataclasses.dataclass(frozen=True)
class SuiteSet:
    name: str
    dataset: str
    categories: tuple[str, ...] = ()
    domain: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    num_prompts: int
    sets: tuple[SuiteSet, ...]


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITES.glob("*.yaml"))


def load_suite(name: str, only: list[str] | None = None) -> Suite:
    """The suite `name` (configs/eval/suites/<name>.yaml), restricted to the sets in `only` when given. An unknown
    suite or set is one line naming those that exist."""
    path = SUITES / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(suite_names()) or '(none)'} "
                         f"(configs/eval/suites/*.yaml)")
    raw = yaml.safe_load(path.read_text()) or {}
    sets = []
    for set_name, spec in (raw.get("sets") or {}).items():
        spec = spec or {}
        dataset = spec.get("dataset", "")
        if dataset not in DATASETS:
            raise ValueError(f"{path}: set {set_name!r} has dataset {dataset!r}; use one of {', '.join(DATASETS)}")
        domain = spec.get("domain", "")
        given = [k for k in ("categories", "domain") if spec.get(k)]
        for key in given:
            if key not in EVAL_SETS[dataset].options:
                takes = [n for n, e in EVAL_SETS.items() if key in e.options]
                raise ValueError(f"{path}: set {set_name!r}: dataset {dataset} takes no {key}; "
                                 f"{', '.join(takes)} do")
        if domain and domain not in DOMAINS:
            raise ValueError(f"{path}: set {set_name!r}: domain {domain!r}; use one of {', '.join(DOMAINS)}")
        sets.append(SuiteSet(set_name, dataset, tuple(spec.get("categories") or ()), domain))
    if not sets:
        raise ValueError(f"{path} has no sets; list them under `sets:`")
    if only:
        known = [s.name for s in sets]
        unknown = [o for o in only if o not in known]
        if unknown:
            raise ValueError(f"suite {name!r} has no set {', '.join(map(repr, unknown))}; its sets: {', '.join(known)}")
        sets = [s for s in sets if s.name in only]
    return Suite(name, int(raw.get("num_prompts", 4)), tuple(sets))


def write_set_prompts(s: SuiteSet, out_dir: Path, heldout_skip: int | None) -> Path:
    """The set's prompt candidates as a JSONL under out_dir/prompts/ (the file the set's eval reads)."""
    source = EVAL_SETS[s.dataset]
    if source.heldout and heldout_skip is None:
        raise ValueError(f"set {s.name!r} reads held-out {s.dataset}, but the draft records no training slice "
                         "to hold out; pass heldout_skip=N")
    lines = source.lines(s, heldout_skip)
    if not lines:
        raise ValueError(f"set {s.name!r} has no prompts (categories {list(s.categories)}, domain {s.domain!r})")
    path = out_dir / "prompts" / f"{s.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return path


def run_suite(suite: Suite, cfg, base, drafter, method: str, out_dir: Path, info: dict, evaluate,
              num_prompts: int | None = None) -> dict:
    """Evaluate every set of `suite` with one base and drafter (`evaluate` = eval/harness/runner.py: evaluate), each
    into out_dir/<set>/; write and return the suite summary (out_dir/suite.json, suite.md, suite.png)."""
    n = num_prompts or suite.num_prompts
    rows = []
    for s in suite.sets:
        path = write_set_prompts(s, out_dir, cfg.heldout_skip)
        set_cfg = dataclasses.replace(cfg, name=s.name, dataset=str(path), num_prompts=n, both_turns=False)
        report = evaluate(set_cfg, base, drafter, method, out_dir / s.name, {**info, "suite": suite.name,
                                                                            "suite_set": s.name})
        rows.append({"set": s.name, "dataset": s.dataset, "num_prompts": report["num_prompts"],
                     "new_tokens": report["new_tokens"], "acceptance_length": report["acceptance_length"],
                     "accept_rate_per_position": report["accept_rate_per_position"],
                     "tokens_per_second": report["tokens_per_second"],
                     "ar_tokens_per_second": report["ar_tokens_per_second"], "speedup": report["speedup"],
                     "lossless": report["lossless"]})
    summary = {"suite": suite.name, "method": method, "num_prompts_per_set": n, "sets": rows, **info}
    from eval.harness.suite_report import write_suite_report

    write_suite_report(out_dir, summary)
    return summary
