"""HFCBGenerator (data/cb_generate.py, transformers' continuous batching) on a tiny random LLaMA in fp32 on the CPU:
greedy answers token-identical to transformers `generate` (HFGenerator, the regenerate path) for prompts of
different lengths with end-of-turn ids hit mid-batch, all at once or a few rows at a time, and per-prompt limits
cut each answer at its own cap."""

import functools
from collections import Counter

import pytest
import torch

from data.cb_generate import HFCBGenerator
from data.self_distill import HFGenerator
from models.tiny import TINY_VOCAB_SIZE, tiny_model

NEW = 20  # max_new_tokens
PAD = 0


@functools.cache
def _case():
    """(model, prompts, eos, generate's answers): eos = im_end plus the base's most frequent later token, so rows
    end at different steps (by eos and by the cap)."""
    model = tiny_model("llama", seed=0, diverse=True).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 40, (9,), generator=gen).tolist()
    prompts = [torch.randint(3, TINY_VOCAB_SIZE, (k,), generator=gen).tolist() for k in lengths]
    free = HFGenerator(model, [2], PAD, NEW, 0.0)(prompts, seed=0)
    common = Counter(t for row in free for t in row[1:]).most_common(1)[0][0]
    eos = [2, common]
    return model, prompts, eos, HFGenerator(model, eos, PAD, NEW, 0.0)(prompts, seed=0)


def test_the_case_is_not_trivial():
    _, _, eos, want = _case()
    ended = [len(row) for row in want if row and row[-1] in eos]
    assert len(ended) >= 2 and len(set(ended)) >= 2, want
    assert any(len(row) == NEW and row[-1] not in eos for row in want), want


@pytest.mark.parametrize("rows", [None, 3])
def test_greedy_equals_generate_in_fp32(rows):
    """None: every prompt decoding at once; 3: three rows (and a cache for three requests), the other prompts
    waiting for a finished request's pages."""
    model, prompts, eos, want = _case()
    engine = HFCBGenerator(model, eos, NEW, 0.0, max_requests=rows)
    assert engine.name == "hf-cb" and "float32" in engine.version and "continuous" in engine.version
    assert engine(prompts, seed=0) == want


def test_limits_cut_each_prompt_at_its_own_cap():
    model, prompts, eos, want = _case()
    limits = [NEW, 1, 0, 7, NEW, 3, NEW, 12, NEW]
    got = HFCBGenerator(model, eos, NEW, 0.0)(prompts, seed=0, limits=limits)
    assert got == [row[:n] for row, n in zip(want, limits)]
    assert got[2] == [] and len(got[1]) == 1


def test_bad_limits_are_refused():
    model, prompts, eos, _ = _case()
    with pytest.raises(ValueError, match="limits"):
        HFCBGenerator(model, eos, NEW, 0.0)(prompts, seed=0, limits=[1])


def test_regenerate_cli_hf_cb_writes_what_hf_writes(tmp_path, monkeypatch, capsys):
    """`specdraft regenerate --engine hf-cb`, turn by turn (second turns after the base's own first answers):
    the same records as `--engine hf` in fp32 greedy, and its engine named in the metadata."""
    import json

    from vllm_fixtures import servable_tiny_base

    from cli.main import main

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    base_dir = servable_tiny_base(tmp_path / "base")  # a tiny base whose answers are not empty

    def regenerate(engine: str) -> list[dict]:
        out = tmp_path / f"{engine}.jsonl"
        assert main(["regenerate", "--base", str(base_dir), "--source", "tests/fixtures/sharegpt_tiny.json",
                     "--max-records", "6", "--max-new-tokens", "12", "--max-turns", "2", "--dtype", "fp32",
                     "--engine", engine, "--out", str(out)]) == 0, capsys.readouterr().err
        return [json.loads(line) for line in out.read_text().splitlines()]

    ours, theirs = regenerate("hf-cb"), regenerate("hf")
    assert ours == theirs and len(ours) == 6
    assert any(sum(m["from"] == "gpt" for m in r["conversations"]) == 2 for r in ours)  # second turns regenerated
    meta = json.loads((tmp_path / "hf-cb.jsonl.meta.json").read_text())
    assert meta["engine"] == "hf-cb" and "continuous-batching" in meta["engine_version"]
