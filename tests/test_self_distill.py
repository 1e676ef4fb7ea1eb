"""Self-distillation (data/self_distill.py) on a tiny random LLaMA: file format, batched == unbatched greedy,
resume after a crash, the held-out skip through derived_from, and the config checks."""

import json

import pytest
import torch
from helpers.regen_base import SHAREGPT_FIXTURE, regen_base

import data.self_distill as sd
from core.config_loader import ConfigError
from data.self_distill import build_self_distilled, sidecar, train_data_entry
from data.sharegpt import read_sharegpt

FIXTURE = SHAREGPT_FIXTURE


@pytest.fixture(scope="module")
def base():
    return regen_base()


def _build(base, tmp_path, name="sd.jsonl", **kw):
    kw = {"max_records": 5, "max_new_tokens": 8, "batch_size": 3, **kw}  # 2 batches: 3 + 2 conversations
    return build_self_distilled(base, FIXTURE, out=tmp_path / name, **kw)


def _recording(real, calls: list[int], crash_on_call: int | None = None):
    """A stand-in for sd._distill_batch that records each batch's size in `calls` and runs `real`; on call
    number `crash_on_call` it raises instead, as a build killed mid-way."""

    def distill_batch(tok, batch, *args):
        calls.append(len(batch))
        if len(calls) == crash_on_call:
            raise RuntimeError("simulated crash")
        return real(tok, batch, *args)

    return distill_batch


def _unbatched_greedy(base, messages, max_new_tokens=8) -> str:
    tok = base.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    out = base.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_jsonl_round_trips_and_matches_unbatched_greedy(base, tmp_path, capsys):
    out = _build(base, tmp_path)
    source, _ = read_sharegpt(FIXTURE, 5)
    distilled, stats = read_sharegpt(str(out))
    meta = json.loads(sidecar(out).read_text())
    assert stats.kept == meta["records"] == len(distilled) and meta["records"] + meta["skipped_empty"] == 5
    assert meta["derived_from"] == {"source": FIXTURE, "max_records": 5}
    assert meta["base_fingerprint"] == base.fingerprint and meta["generated_tokens"] > 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(set(r) == {"id", "conversations"} for r in lines)
    assert [m["from"] for m in lines[0]["conversations"]] == ["human", "gpt"]
    assert [r["id"] for r in lines] == [f"sharegpt_tiny-{i}" for i in range(5)]  # no empty answer here
    assert distilled[3][0] == {"role": "system", "content": "You are a terse assistant."}
    for conv, got in zip(source, distilled):  # left padding + batching leave greedy answers unchanged
        prompt = conv[:conv.index(next(m for m in conv if m["role"] == "user")) + 1]
        assert got[:-1] == prompt and got[-1]["role"] == "assistant"
        assert got[-1]["content"] == _unbatched_greedy(base, prompt) != conv[len(prompt)]["content"]
    assert "tok/s" in capsys.readouterr().out
    assert _build(base, tmp_path) == out and "reusing" in capsys.readouterr().out


def test_second_turn_answers_follow_the_bases_first_answer(base, tmp_path):
    out = _build(base, tmp_path, max_turns=2, max_records=3)
    distilled, _ = read_sharegpt(str(out))
    spider = distilled[2]  # the fixture's 3rd conversation has two user turns
    assert [m["role"] for m in spider] == ["user", "assistant", "user", "assistant"]
    assert spider[1]["content"] == _unbatched_greedy(base, spider[:1])
    assert spider[3]["content"] == _unbatched_greedy(base, spider[:3])
    assert len(distilled[0]) == 2


def test_resume_after_crash_generates_only_the_rest(base, tmp_path, monkeypatch):
    (tmp_path / "ref").mkdir()  # apart: a finished file beside the build would be copied, not generated
    reference = _build(base, tmp_path / "ref", "ref.jsonl").read_text()
    real, calls = sd._distill_batch, []
    monkeypatch.setattr(sd, "_distill_batch", _recording(real, calls, crash_on_call=2))  # dies after batch 1
    with pytest.raises(RuntimeError, match="simulated crash"):
        _build(base, tmp_path)
    partial = tmp_path / "sd.jsonl.partial"
    assert not (tmp_path / "sd.jsonl").exists() and len(partial.read_text().splitlines()) == 1 + 3
    with open(partial, "a") as f:
        f.write('{"id": "cut mid-li')  # a line torn by the crash is dropped on resume
    calls.clear()
    monkeypatch.setattr(sd, "_distill_batch", _recording(real, calls))
    out = _build(base, tmp_path)
    assert calls == [2] and out.read_text() == reference and not partial.exists()
    ref_meta, meta = (json.loads(sidecar(p).read_text()) for p in (tmp_path / "ref" / "ref.jsonl", out))
    assert meta == ref_meta  # counts survive the restart
    with pytest.raises(ValueError, match="other settings"):
        _build(base, tmp_path, max_new_tokens=5)


def test_a_slice_is_copied_from_a_longer_file_with_the_same_settings(base, tmp_path, monkeypatch):
    (tmp_path / "fresh").mkdir()
    fresh = _build(base, tmp_path / "fresh", "mid.jsonl", skip=1, max_records=3)  # generated from scratch
    assert [json.loads(x)["id"] for x in fresh.read_text().splitlines()] == [f"sharegpt_tiny-{i}" for i in (1, 2, 3)]
    assert json.loads(sidecar(fresh).read_text())["derived_from"] == {"source": FIXTURE, "max_records": 4, "skip": 1}
    real, calls = sd._distill_batch, []
    monkeypatch.setattr(sd, "_distill_batch", _recording(real, calls, crash_on_call=2))  # dies after batch 1
    with pytest.raises(RuntimeError):
        _build(base, tmp_path, "long.jsonl")  # a longer build, killed after conversations 0..2
    calls.clear()
    monkeypatch.setattr(sd, "_distill_batch", _recording(real, calls))
    # conversations 1..2 come from the partial, 3 is generated: the same file as generated from scratch
    sliced = _build(base, tmp_path, "mid.jsonl", skip=1, max_records=3)
    assert calls == [1] and sliced.read_text() == fresh.read_text()
    long = _build(base, tmp_path, "long.jsonl")  # finishes the longer build; then a finished file serves slices
    calls.clear()
    assert _build(base, tmp_path, "tail.jsonl", skip=3, max_records=2).read_text() == "".join(
        line + "\n" for line in long.read_text().splitlines()[3:])
    assert calls == []
    _build(base, tmp_path, "other.jsonl", skip=3, max_records=2, max_new_tokens=5)  # other settings: generated
    assert calls == [2]


def test_derived_from_makes_eval_skip_the_distilled_prompts(base, tmp_path):
    from eval.harness.config import load_eval_config
    from eval.harness.runner import resolve_heldout_skip

    out = _build(base, tmp_path)
    meta = json.loads(sidecar(out).read_text())
    meta["derived_from"] = {"source": "sharegpt", "max_records": 800}  # as if built from the packaged data
    sidecar(out).write_text(json.dumps(meta))
    entry = train_data_entry(str(out), None)
    assert entry == {"source": str(out), "max_records": None,
                     "derived_from": {"source": "sharegpt", "max_records": 800}}
    cfg = load_eval_config(["configs/eval/sharegpt.yaml"])
    assert resolve_heldout_skip(cfg, {"train_data": entry}).heldout_skip == 800
    with pytest.raises(ValueError, match="would evaluate on conversations"):
        resolve_heldout_skip(load_eval_config(["configs/eval/sharegpt.yaml"], ["heldout_skip=10"]),
                             {"train_data": entry})
    assert "derived_from" not in train_data_entry(FIXTURE, 4)  # a plain file: unchanged behaviour


def test_config_validation():
    from train.config import load_train_config

    ok = load_train_config(["configs/smoke.yaml"], ["data.self_distill=true", "data.max_records=20"])
    assert ok.data.self_distill and ok.data.self_distill_max_new_tokens == 256
    for overrides, key in ((["data.self_distill=true"], "data.max_records"),
                           (["data.self_distill_max_new_tokens=0"], "data.self_distill_max_new_tokens"),
                           (["data.self_distill_temperature=-1"], "data.self_distill_temperature")):
        with pytest.raises(ConfigError, match=key):
            load_train_config(["configs/smoke.yaml"], overrides)


def test_loop_trains_on_the_distilled_file(base, tmp_path, monkeypatch):
    """The loop's hook: self_distill swaps the source for the cached file and records derived_from."""
    from train.config import load_train_config
    from train.run_inputs import training_source

    overrides = ["data.self_distill=true", "data.max_records=3", "data.self_distill_max_new_tokens=8",
                 f"data.cache_dir={tmp_path}"]
    cfg = load_train_config(["configs/smoke.yaml"], overrides)
    source, max_records = training_source(cfg, base)
    assert source.startswith(str(tmp_path / "selfdistill")) and max_records is None
    assert train_data_entry(source, max_records)["derived_from"] == {"source": FIXTURE, "max_records": 3}
    cfg.data.self_distill = False
    assert training_source(cfg, base) == (FIXTURE, 3)


def test_an_engine_generates_turn_by_turn_and_cut_answers_are_counted(base, tmp_path):
    """Any Generator drives the build: turn j of a batch goes out in one call after every turn-(j-1) answer came
    back, the engine is part of the file's key, and answers cut at max_new_tokens are kept and counted."""
    calls = []

    class Scripted:
        name, version = "scripted", "1"

        def __call__(self, prompts, seed):
            calls.append((len(prompts), seed))
            return [[7, 8, 9] for _ in prompts]  # 3 tokens, no end of turn: cut at max_new_tokens=3

    out = build_self_distilled(base, "tests/fixtures/sharegpt_tiny.json", max_records=3, max_new_tokens=3,
                               max_turns=2, batch_size=3, out=tmp_path / "s.jsonl", engine=Scripted())
    meta = json.loads(sidecar(out).read_text())
    records = [json.loads(line) for line in out.read_text().splitlines()]
    two_turns = sum(1 for r in records if sum(m["from"] == "gpt" for m in r["conversations"]) == 2)
    assert calls[0] == (3, 0) and [c[1] for c in calls] == list(range(len(calls)))  # one call per turn, seed+turn
    assert meta["engine"] == "scripted" and meta["cut_answers"] == 3 + two_turns
    hf = build_self_distilled(base, "tests/fixtures/sharegpt_tiny.json", max_records=3, max_new_tokens=3,
                              max_turns=2, batch_size=3, cache_dir=tmp_path)
    assert json.loads(sidecar(hf).read_text())["key"] != meta["key"]  # another engine, another file


def test_resume_reads_records_whose_text_holds_unicode_line_separators(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 / U+0085 raw; a resumed build must not split a record there."""
    partial = tmp_path / "x.jsonl.partial"
    rec = {"id": "a", "generated_tokens": 2, "conversations": [{"from": "human", "value": "one\u2028two\x85three"}]}
    partial.write_text(json.dumps({"selfdistill_key": "K"}) + "\n" + json.dumps(rec, ensure_ascii=False) + "\n",
                       encoding="utf-8")
    assert sd._resume(partial, "K") == (1, {}, 2)
    text, records, cut, _ = sd._finalize(partial)
    assert records == 1 and json.loads(text)["conversations"][0]["value"] == "one\u2028two\x85three"
