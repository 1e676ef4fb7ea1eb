"""Drafts per verification step have one name, `num_speculative_tokens` (vLLM's): in every family's eval options,
the report info, configs, tuning.json knobs and export keys. Stored files that use an older name (`chain_length`,
llama.cpp's `n_max` in tuning.json) still load, read under the new name with one note, through the one mapping
(models/export/schema.py: upgrade_keys)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.drafts import perturb

from eval.choice.record import TUNING_FORMAT, tuned_choice, tuned_num_speculative_tokens
from eval.engine.drafters.registry import build_drafter, drafter_family
from eval.harness.config import load_eval_config
from models.export import schema
from models.export.schema import RenamedKeyWarning, upgrade_keys
from models.export.specdraft import export_specdraft, load_draft, read_export_config
from models.families.eagle3.model import Eagle3Draft

ROOT = Path(__file__).resolve().parents[1]
NOTE = r"`chain_length` is now `num_speculative_tokens`"


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Each test sees the first-time note (the process notes each old key once)."""
    monkeypatch.setattr(schema, "NOTED", set())


def _eagle3(view4, **kw):
    torch.manual_seed(0)
    return perturb(Eagle3Draft(view4, **kw), 0.1).eval()


def test_an_old_key_eval_config_loads_with_one_note_and_drafts_the_same_chain(view4):
    with pytest.warns(RenamedKeyWarning, match=NOTE):
        old = load_eval_config([], ["extra.eagle3_mode=chain", "extra.chain_length=3"])
    new = load_eval_config([], ["extra.eagle3_mode=chain", "extra.num_speculative_tokens=3"])
    assert old.extra == new.extra == {"eagle3_mode": "chain", "num_speculative_tokens": 3}
    draft, export_cfg = _eagle3(view4), {"family": "eagle3"}
    (d_old, info_old), (d_new, info_new) = (build_drafter(draft, export_cfg, c) for c in (old, new))
    assert d_old.num_speculative_tokens == d_new.num_speculative_tokens == 3
    assert info_old == info_new and info_new["num_speculative_tokens"] == 3
    assert drafter_family("eagle3").num_speculative_tokens(info_old, d_old) == 3


def test_an_old_key_yaml_warns_once_per_process(tmp_path):
    cfg = tmp_path / "old.yaml"
    cfg.write_text("extra: {eagle3_mode: chain, chain_length: 2}\n")
    with pytest.warns(RenamedKeyWarning, match=NOTE) as notes:
        first = load_eval_config([str(cfg)])
        again = load_eval_config([str(cfg)])
    assert first.extra == again.extra == {"eagle3_mode": "chain", "num_speculative_tokens": 2}
    assert len([n for n in notes if issubclass(n.category, RenamedKeyWarning)]) == 1


def test_an_old_key_next_to_a_different_new_value_is_an_error():
    with pytest.raises(ValueError, match="keep only `num_speculative_tokens`"):
        upgrade_keys({"chain_length": 3, "num_speculative_tokens": 4}, "a config")
    same = {"chain_length": 3, "num_speculative_tokens": 3}
    with pytest.warns(RenamedKeyWarning):
        assert upgrade_keys(same) == {"num_speculative_tokens": 3}
    plain = {"extra": {"num_speculative_tokens": 3}, "rows": [1, 2]}
    assert upgrade_keys(plain) is plain  # nothing old: the same object back


def _old_tuning(export_dir: Path) -> None:
    """A tuning.json as `specdraft tune` wrote it before the rename: llama.cpp's knob was `n_max`, our decoder's
    EAGLE-3 chain `extra.chain_length`."""
    where = {"machine": {"device": "cpu", "cpu": "x"}, "dtype": "float32", "threads": 1, "version": "v"}
    engines = {
        "llamacpp": {**where, "choice": {"label": "n-max 3, p-min 0", "knobs": {"n_max": 3, "p_min": 0.0},
                                         "speculate": True, "speedup_vs_ar": 1.3}},
        "ours": {**where, "choice": {"label": "chain 2", "speculate": True, "speedup_vs_ar": 1.2,
                                     "knobs": {"tree_choices": None,
                                               "extra": {"eagle3_mode": "chain", "chain_length": 2}}}},
    }
    (export_dir / "tuning.json").write_text(json.dumps({"format": TUNING_FORMAT, "engines": engines}))


def test_an_old_tuning_json_loads_with_the_note_and_the_same_counts(tmp_path, view4):
    _old_tuning(tmp_path)
    with pytest.warns(RenamedKeyWarning) as notes:
        llama = tuned_choice(tmp_path, "llamacpp")
    said = {str(n.message).split(" (")[0] for n in notes}
    assert said == {"`n_max` is now `num_speculative_tokens`", "`chain_length` is now `num_speculative_tokens`"}
    assert llama["knobs"] == {"num_speculative_tokens": 3, "p_min": 0.0}
    assert tuned_num_speculative_tokens(llama["knobs"]) == 3
    ours = tuned_choice(tmp_path, "ours")
    assert ours["knobs"]["extra"] == {"eagle3_mode": "chain", "num_speculative_tokens": 2}
    from eval.choice.apply import apply_knobs

    drafter, info = build_drafter(_eagle3(view4), {"family": "eagle3"},
                                  apply_knobs(load_eval_config([]), ours["knobs"]))
    assert drafter.num_speculative_tokens == 2 and info["num_speculative_tokens"] == 2


def test_an_old_export_loads_with_the_note_and_drafts_the_same_chain(tmp_path, view4):
    """A P-EAGLE export stores its parallel chain; older ones as `chain_length`."""
    draft = _eagle3(view4, ttt_steps=3, parallel_drafting=True)
    new_dir = export_specdraft(draft, tmp_path / "new", "tiny", "fp")
    new_cfg = json.loads((new_dir / "config.json").read_text())
    assert new_cfg["num_speculative_tokens"] == 3 and "chain_length" not in new_cfg
    old_dir = export_specdraft(draft, tmp_path / "old", "tiny", "fp")
    old_cfg = {("chain_length" if k == "num_speculative_tokens" else k): v for k, v in new_cfg.items()}
    (old_dir / "config.json").write_text(json.dumps(old_cfg))
    with pytest.warns(RenamedKeyWarning, match=NOTE):
        assert read_export_config(old_dir) == new_cfg
    eval_cfg = load_eval_config([])
    built = []
    for export in (old_dir, new_dir):
        loaded, cfg = load_draft(export, view4)
        built.append(build_drafter(loaded, cfg, eval_cfg))
    (d_old, info_old), (d_new, info_new) = built
    assert d_old.parallel and d_old.num_speculative_tokens == d_new.num_speculative_tokens == 3
    assert info_old == info_new


# The one place an old name may still be written: the mapping that reads it.
MAPPING = ROOT / "models" / "export" / "schema.py"
OLD_NAMES = re.compile(r"\b(chain_length|max_chain)\b")


def _sources() -> list[Path]:
    files = [p for d in ("eval", "models", "cli", "recipes", "bench", "launch") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".sh") and p.is_file()]
    return sorted([*files, *(ROOT / "configs").rglob("*.yaml")])


def test_no_code_or_config_uses_the_old_names_outside_the_mapping():
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources() if p != MAPPING
                 for i, line in enumerate(p.read_text().splitlines(), 1) if OLD_NAMES.search(line)]
    assert not offenders, "use num_speculative_tokens (max_speculative_tokens):\n" + "\n".join(offenders)
    assert "chain_length" in schema.OLD_KEYS  # the mapping still reads the old name


# -- EAGLE-3's trained depth: draft.eagle3.ttt_steps, declared once ---------------------------------------------

def test_eagle3_training_depth_is_declared_once_and_num_heads_follows_it():
    from train.config import load_train_config

    cfg = load_train_config(["configs/eagle3.yaml"])
    assert cfg.draft.eagle3.ttt_steps == cfg.draft.num_heads == 3
    cfg = load_train_config(["configs/eagle3.yaml"], ["draft.eagle3.ttt_steps=5"])
    assert cfg.draft.eagle3.ttt_steps == cfg.draft.num_heads == 5


def test_an_eagle3_config_that_sets_num_heads_reads_it_as_ttt_steps(tmp_path, caplog):
    import logging

    from core.config_loader import ConfigError
    from train.config import load_train_config

    with caplog.at_level(logging.WARNING):
        cfg = load_train_config(["configs/eagle3.yaml"], ["draft.num_heads=5"])
    assert cfg.draft.eagle3.ttt_steps == cfg.draft.num_heads == 5
    assert "draft.num_heads -> draft.eagle3.ttt_steps" in caplog.text
    both = tmp_path / "both.yaml"
    both.write_text("draft:\n  family: eagle3\n  num_heads: 4\n  eagle3:\n    ttt_steps: 5\n")
    with pytest.raises(ConfigError, match=r"keep only draft\.eagle3\.ttt_steps"):
        load_train_config([str(both)])
    medusa = load_train_config(["configs/medusa.yaml"], ["draft.num_heads=3"])  # its own key elsewhere
    assert medusa.draft.num_heads == 3


def test_an_eagle3_export_writes_its_depth_once(view4):
    cfg = _eagle3(view4, ttt_steps=2).export_config()
    assert cfg["ttt_steps"] == 2 and "num_heads" not in cfg
    stored = read_export_config(ROOT / "drafts" / "smollm2-eagle3-store" / "export")  # older: num_heads too
    assert stored["ttt_steps"] == stored["num_heads"] == 3
