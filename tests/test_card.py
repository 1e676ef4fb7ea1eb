"""`specdraft card`: a shipped draft's numbers come from its files (field reports, paired.json, tuning.json), the
serving settings engine by engine from each engine's own record, speed ratios only from a tune whose load was
recorded and below the core count (NOTES.md marks a loaded one); the shipped cards are up to date, and no figure in
a card's hand-written prose is missing from the draft's files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli.card import BEGIN, END, render_card, render_notes


def _draft(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    (d / "export").mkdir(parents=True)
    (d / "README.md").write_text("# d\n\nintro\n\n## Results\n\nold hand-written table 1.45x\n")
    quiet = {"start": [0.5, 0, 0], "end": [0.7, 0, 0], "cores": 2, "loaded": False}
    loaded = {"start": [5.0, 0, 0], "end": [6.0, 0, 0], "cores": 2, "loaded": True}
    choice = {"label": "chain 2", "speculate": True, "speedup_vs_ar": 1.31, "interval": [1.2, 1.4], "reason": "r"}
    engines = {"ours": {"choice": choice, "load": quiet, "dtype": "bf16", "threads": 1, "prompts": ["a"] * 4,
                        "max_new_tokens": 64, "dataset": "mtbench", "tuned": "2026-11-29 15:31 UTC",
                        "machine": {"cpu": "AMD EPYC", "cores": 2, "avx512_bf16": True},
                        "tune": {"command": "specdraft tune --engine ours --num-prompts 4", "repeats": 3}},
               "vllm": {"choice": {**choice, "speedup_vs_ar": 1.77, "reason": "r"}, "load": loaded,
                        "prompts": ["a"] * 8, "max_new_tokens": 32, "dataset": "mtbench",
                        "machine": {"cpu": "Xeon", "amx_bf16": True},
                        "tune": {"command": "specdraft tune --engine vllm --num-prompts 8", "repeats": 5}},
               "llamacpp": {"choice": {**choice, "speedup_vs_ar": 1.55}}}
    (d / "export" / "tuning.json").write_text(json.dumps({"engines": engines, "command": "specdraft tune"}))
    f = d / "field" / "float32-chain4"
    f.mkdir(parents=True)
    f.joinpath("field.json").write_text(json.dumps({
        "meta": {"shape": "chain4", "dtype": "float32", "lockstep": 64}, "prompts": 3, "mean_over_sets": 1.7,
        "mean_interval": [1.6, 1.8], "sets": [{"set": "mtbench", "prompts": 3, "acceptance_length": 1.7,
                                                "interval": [1.6, 1.8], "accept_rate_per_depth": [0.4, 0.2]}]}))
    f.joinpath("paired.json").write_text(json.dumps({
        "against": "the draft before", "prompts": 3, "mean_diff": 0.0871, "mean_interval": [0.08, 0.094],
        "sets": {"mtbench": {"diff": 0.0871, "interval": [0.08, 0.094], "prompts": 3}},
        "command": "specdraft field-paired a b"}))
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
    # per engine, from its own record: prompts x tokens, repeats, command, machine kind
    ours, vllm = text.split("### our decoder")[1].split("###")[0], text.split("### vLLM")[1].split("###")[0]
    assert "4 mtbench prompts x 64 new tokens, 3 paired repeats" in ours and "--engine ours" in ours
    assert "8 mtbench prompts x 32 new tokens, 5 paired repeats" in vllm and "--engine vllm" in vllm
    assert "AMD EPYC (2 cores, AVX512-BF16), 2026-11-29 15:31 UTC" in ours and "Xeon (AMX)" in vllm
    assert "not recorded in this engine's record" in text.split("### llama.cpp")[1]
    # the comparison line comes from paired.json
    assert "Against the draft before (`field/float32-chain4/paired.json`, paired on 3 common stored answers): " \
           "mean over sets +0.087 (+0.080..+0.094), above it beyond the interval on 1 of 1 sets" in text
    # NOTES.md from tuning.json: a loaded ratio carries its mark
    notes_md = render_notes(d)
    vllm_line = next(x for x in notes_md.splitlines() if x.startswith("- **vLLM**"))
    assert "; LOADED: load average up to 6.0 on 2 cores: every ratio here measured loaded): chain 2, 1.77x" in vllm_line
    assert "LOADED" not in next(x for x in notes_md.splitlines() if x.startswith("- **our decoder**"))
    (d / "README.md").write_text(text)
    again, _ = render_card(d)
    assert again == text and again.count(BEGIN) == 1  # regenerating is stable


@pytest.mark.parametrize("draft", sorted(p.parent for p in Path("drafts").glob("*/README.md")))
def test_shipped_cards_are_generated_from_their_files(draft):
    text, _ = render_card(draft)
    assert (draft / "README.md").read_text() == text, f"run `specdraft card --draft {draft}`"


FIGURE = re.compile(r"[+-]?\d+\.\d+")


def prose(text: str) -> str:
    """A card without its generated part: what was written by hand or by `specdraft ship`."""
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + (rest.split(END, 1)[1] if END in rest else "")
    return text


def held_figures(draft: Path) -> set[str]:
    """Every number the draft's generated files hold (its field reports and paired.json, the export's config.json
    and tuning.json choices, the run's config.yaml and heldout.json, the data store's card, the weights' size), as
    text at 1 to 4 decimals, signed and unsigned."""
    import yaml

    texts = [p.read_text() for p in (draft / "field").glob("*/*.json")]
    texts += [(draft / n).read_text() for n in ("export/config.json", "config.yaml", "heldout.json")
              if (draft / n).is_file()]
    tuning = draft / "export" / "tuning.json"
    if tuning.is_file():
        texts += [json.dumps(rec.get("choice")) for rec in json.loads(tuning.read_text())["engines"].values()]
    cfg = yaml.safe_load((draft / "config.yaml").read_text()) if (draft / "config.yaml").is_file() else {}
    store = Path(str((cfg.get("data") or {}).get("source") or "")) / "card.json"
    if store.is_file():
        texts.append(store.read_text())
    weights = draft / "export" / "model.safetensors"
    if weights.is_file():
        texts.append(str(weights.stat().st_size / 2**20))
    out = set()
    for t in texts:
        for x in re.findall(r"-?\d+(?:\.\d+)?(?:[eE]-?\d+)?", t):
            v = float(x)
            for d in range(1, 5):
                out |= {f"{v:.{d}f}", f"{v:+.{d}f}", f"{abs(v):.{d}f}"}
    return out


def unheld_figures(draft: Path) -> list[str]:
    held = held_figures(draft)
    return [x for x in FIGURE.findall(prose((draft / "README.md").read_text())) if x not in held]


def test_a_pasted_figure_in_the_prose_fails(tmp_path):
    d = _draft(tmp_path)
    (d / "config.yaml").write_text("train:\n  lr: 0.0005\n")
    text, _ = render_card(d)
    (d / "README.md").write_text(text.replace("intro", "intro, lr 0.0005, +0.087 over the draft before"))
    assert unheld_figures(d) == []  # both held: lr in config.yaml, +0.087 in paired.json (rounded)
    (d / "README.md").write_text(text.replace("intro", "intro, +0.114 over the draft before"))
    assert unheld_figures(d) == ["+0.114"]


@pytest.mark.parametrize("draft", sorted(p.parent for p in Path("drafts").glob("*/README.md")))
def test_shipped_cards_hold_no_figure_their_files_do_not(draft):
    assert unheld_figures(draft) == [], "a figure in the card's prose that no generated file holds: generate it " \
        "(paired.json: `specdraft field-paired`) or remove it"


@pytest.mark.parametrize("draft", sorted(p.parent.parent for p in Path("drafts").glob("*/export/tuning.json")))
def test_shipped_notes_are_generated_from_tuning_json(draft):
    assert (draft / "export" / "NOTES.md").read_text() == render_notes(draft), \
        f"run `specdraft card --draft {draft}`"
