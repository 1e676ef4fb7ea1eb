"""Every YAML under configs/ loads against its typed schema (unknown keys and bad values fail), and every family
is complete: a model, a drafter with typed options, a recipe that trains it, a docs page.

Which schema a file follows is decided by where it lives; a YAML that fits none of the rules below fails, so a
new config cannot slip past unchecked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eval.engine.drafters.options import parse_options
from eval.engine.drafters.registry import DRAFTERS
from eval.harness.compare_config import compare_targets, load_compare_config, setting_configs
from eval.harness.config import load_eval_config
from eval.harness.suite import load_suite
from eval.harness.tree_search import load_tree_search_config
from models.registry import DRAFT_MODELS, FAMILIES
from train.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# Training overlays are checked stacked on a recipe (alone they name no family); a recipe names draft.family.
RECIPE_FOR_OVERLAYS = "configs/medusa.yaml"
# Overlays that say in their comment what they need beside them.
OVERLAY_NEEDS = {"deepspeed/zero3.yaml": ["draft.share_lm_head=true"]}


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def kind_of(path: Path) -> str:
    rel = path.relative_to(CONFIGS).as_posix()
    if rel == "eval/tree_search.yaml":
        return "tree-search"
    if rel.startswith("eval/suites/"):
        return "suite"
    if rel.startswith("eval/"):
        return "eval"
    if rel.startswith("compare"):
        return "compare"
    if rel.startswith("deepspeed/") or "family" not in (_yaml(path).get("draft") or {}):
        return "train-overlay"
    return "train-recipe"


ALL = sorted(CONFIGS.rglob("*.yaml"))


def test_configs_exist():
    assert len(ALL) >= 25 and all(p.suffix == ".yaml" for p in ALL)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_every_config_loads_against_its_schema(path):
    kind, rel = kind_of(path), str(path.relative_to(ROOT))
    if kind == "train-recipe":
        cfg = load_train_config([rel])
        assert cfg.draft.family in DRAFT_MODELS
    elif kind == "train-overlay":
        load_train_config([RECIPE_FOR_OVERLAYS, rel], OVERLAY_NEEDS.get(path.relative_to(CONFIGS).as_posix()))
    elif kind == "tree-search":
        load_tree_search_config([rel])
    elif kind == "suite":  # eval/harness/suite.py: known datasets, domains with sharegpt
        assert load_suite(path.stem).sets
    elif kind == "eval":
        cfg = load_eval_config([rel])
        if cfg.extra:  # eval configs with drafter options are the N-gram's (no export names another family)
            parse_options(DRAFTERS["ngram"].options, "ngram", cfg.extra)
    else:
        stack = [rel] if "drafts" in _yaml(path) or "settings" in _yaml(path) else ["configs/compare.yaml", rel]
        cfg = load_compare_config(stack)
        setting_configs(cfg)
        compare_targets(cfg)
        _check_compare_rows(cfg)


def _check_compare_rows(cfg):
    """Each row's drafter options must be some family's (a method row: that family's exactly)."""
    for d in [*cfg.drafts, *cfg.extra_drafts]:
        extra = (d.get("eval") or {}).get("extra") or {}
        if d.get("method"):
            parse_options(DRAFTERS[d["method"]].options, d["method"], extra)
            continue
        fits = []
        for family, spec in DRAFTERS.items():
            try:
                parse_options(spec.options, family, extra)
                fits.append(family)
            except ValueError:
                pass
        assert fits, f"row {d.get('label')}: extra {extra} is no family's options"


def test_a_typo_in_a_config_is_caught(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1e-3\n  epoch: 2\n")
    with pytest.raises(Exception, match="epoch"):
        load_train_config([RECIPE_FOR_OVERLAYS, str(bad)])
    bad.write_text("extra: {kk: 3}\n")
    with pytest.raises(ValueError, match="kk"):
        parse_options(DRAFTERS["ngram"].options, "ngram", load_eval_config([str(bad)]).extra)


# ---- every family is complete ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_has_a_model_a_drafter_a_recipe_and_a_docs_page(name):
    facts = FAMILIES[name]
    assert name in DRAFTERS, f"{name}: no drafter module eval/engine/drafters/{name}.py"
    assert (ROOT / "docs" / "families" / f"{name}.md").is_file(), f"{name}: no docs/families/{name}.md"
    if facts.trainable:
        assert DRAFT_MODELS[name].facts is facts
        recipe = CONFIGS / f"{name}.yaml"
        assert recipe.is_file(), f"{name}: no recipe configs/{name}.yaml"
        assert load_train_config([str(recipe.relative_to(ROOT))]).draft.family == name
    else:  # a learning-free family builds from the base: (base, extra), no export
        assert name not in DRAFT_MODELS
    assert callable(DRAFTERS[name].build)
    assert facts.title in (ROOT / "README.md").read_text(), f"{name}: README's family table lacks {facts.title}"


def test_registries_agree():
    assert set(DRAFT_MODELS) == {n for n, f in FAMILIES.items() if f.trainable}
    assert set(DRAFTERS) == set(FAMILIES)
