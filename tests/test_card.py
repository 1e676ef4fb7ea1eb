"""`specdraft card`: a shipped draft's numbers come from its files (field reports, tuning.json), speed ratios only
from a tune whose load was recorded and below the core count; the shipped cards are up to date."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.card import BEGIN, render_card


def _draft(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    (d / "export").mkdir(parents=True)
    (d / "README.md").write_text("# d\n\nintro\n\n## Results\n\nold hand-written table 1.45x\n")
    quiet = {"start": [0.5, 0, 0], "end": [0.7, 0, 0], "cores": 2, "loaded": False}
    loaded = {"start": [5.0, 0, 0], "end": [6.0, 0, 0], "cores": 2, "loaded": True}
    choice = {"label": "chain 2", "speculate": True, "speedup_vs_ar": 1.31, "interval": [1.2, 1.4]}
    engines = {"ours": {"choice": choice, "load": quiet, "dtype": "bf16", "threads": 1},
               "vllm": {"choice": {**choice, "speedup_vs_ar": 1.77}, "load": loaded},
               "llamacpp": {"choice": {**choice, "speedup_vs_ar": 1.55}}}
    (d / "export" / "tuning.json").write_text(json.dumps({"engines": engines, "command": "specdraft tune"}))
    f = d / "field" / "float32-chain4"
    f.mkdir(parents=True)
    f.joinpath("field.json").write_text(json.dumps({
        "meta": {"shape": "chain4", "dtype": "float32"}, "prompts": 3, "mean_over_sets": 1.7,
        "mean_interval": [1.6, 1.8], "sets": [{"set": "mtbench", "prompts": 3, "acceptance_length": 1.7,
                                                "interval": [1.6, 1.8], "accept_rate_per_depth": [0.4, 0.2]}]}))
    return d


def test_ratios_only_from_a_quiet_recorded_tune(tmp_path):
    d = _draft(tmp_path)
    text, notes = render_card(d)
    assert "1.31x (1.20-1.40)" in text  # quiet: shown with its interval
    assert "1.77" not in text and "1.55" not in text  # loaded / no load recorded: not shown
    assert "1.45x" not in text and "intro" in text  # the hand-written numbers are replaced, the rest kept
    assert "| mtbench | 3 | 1.700 | 1.600-1.800 |" in text
    assert any("'vllm' was tuned loaded" in n for n in notes)
    assert any("'llamacpp' records no load average" in n for n in notes)
    (d / "README.md").write_text(text)
    again, _ = render_card(d)
    assert again == text and again.count(BEGIN) == 1  # regenerating is stable


@pytest.mark.parametrize("draft", sorted(p.parent for p in Path("drafts").glob("*/README.md")))
def test_shipped_cards_are_generated_from_their_files(draft):
    text, _ = render_card(draft)
    assert (draft / "README.md").read_text() == text, f"run `specdraft card --draft {draft}`"
