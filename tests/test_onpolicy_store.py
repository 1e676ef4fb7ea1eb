"""The lasting on-policy dataset (data/onpolicy_store.py): written by a regeneration, read back as the same
conversations, refused when it does not match its card or the base, and a build on a new machine (empty cache)
resumes from it."""

import json
import lzma

import pytest
from helpers.regen_base import SHAREGPT_FIXTURE, regen_base

import data.self_distill as sd
from data.onpolicy_store import CARD, DATA, StoreError, check_base, read_card, read_store
from data.self_distill import build_self_distilled, train_data_entry
from data.sharegpt import read_sharegpt

FIXTURE = SHAREGPT_FIXTURE
KW = dict(max_new_tokens=12, max_turns=2, batch_size=2, token_budget=100)


@pytest.fixture(scope="module")
def base():
    return regen_base()


def _counting(calls):
    real = sd._distill_batch

    def distill_batch(tok, batch, *args):
        calls.append(len(batch))
        return real(tok, batch, *args)

    return distill_batch


def test_the_store_reads_back_as_the_regenerated_conversations(base, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "store"
    out = build_self_distilled(base, FIXTURE, max_records=5, out=tmp_path / "sd.jsonl", store=store,
                               store_info={"made_with": "specdraft regenerate …"}, **KW)
    card, lines = read_store(store)
    assert card["conversations"] == 5 and card["records"] == len([x for x in lines if "a" in x])
    assert card["base_fingerprint"] == base.fingerprint and card["settings"]["token_budget"] == 100
    assert "path" not in card["settings"] and card["segments"][0]["start"] == 0
    assert card["made_with"] == "specdraft regenerate …" and (store / "README.md").is_file()
    # no user turn is stored: only the answers
    assert all(set(x) <= {"i", "a", "g", "c", "b", "s"} for x in lines)
    assert read_sharegpt(str(store))[0] == read_sharegpt(str(out))[0]
    assert train_data_entry(str(store), None)["derived_from"] == {"source": FIXTURE, "max_records": 5}


def test_a_store_that_does_not_match_its_card_is_refused(base, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "store"
    build_self_distilled(base, FIXTURE, max_records=4, out=tmp_path / "sd.jsonl", store=store, **KW)
    read_store(store)  # as written: fine
    card_text = (store / CARD).read_text()
    data = (store / DATA).read_bytes()

    # a changed data file: its sha256 is not the card's
    lines = lzma.decompress(data).decode().splitlines()
    lines[0] = lines[0].replace('"i":0', '"i":0,"g":999')
    (store / DATA).write_bytes(lzma.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(StoreError, match="does not match its card.*sha256"):
        read_store(store)
    with pytest.raises(StoreError, match="sha256"):
        read_sharegpt(str(store))

    # a card whose counts disagree with the file (sha256 right)
    (store / DATA).write_bytes(data)
    card = json.loads(card_text)
    card["records"] += 1
    (store / CARD).write_text(json.dumps(card))
    with pytest.raises(StoreError, match="records"):
        read_store(store)

    # another base's answers are not on-policy for this one
    (store / CARD).write_text(card_text)
    with pytest.raises(StoreError, match="not of this base"):
        check_base(read_card(store), "0" * 64, "data.source")


def test_a_new_machine_resumes_from_the_store(base, tmp_path, monkeypatch):
    """The cache is gone (a machine swap): the same command with more records generates only the new ones and
    gives what a build from scratch gives."""
    store = tmp_path / "store"
    build_self_distilled(base, FIXTURE, max_records=4, cache_dir=tmp_path / "old-machine", store=store, **KW)
    calls = []
    monkeypatch.setattr(sd, "_distill_batch", _counting(calls))
    grown = build_self_distilled(base, FIXTURE, max_records=6, cache_dir=tmp_path / "new-machine", store=store, **KW)
    assert sum(calls) == 2  # conversations 4 and 5 only
    assert read_card(store)["conversations"] == 6
    monkeypatch.setattr(sd, "_distill_batch", _counting([]))
    scratch = build_self_distilled(base, FIXTURE, max_records=6, cache_dir=tmp_path / "scratch", **KW)
    assert grown.read_text() == scratch.read_text()


def test_other_settings_cannot_extend_a_store(base, tmp_path):
    store = tmp_path / "store"
    build_self_distilled(base, FIXTURE, max_records=3, cache_dir=tmp_path / "a", store=store, **KW)
    with pytest.raises(StoreError, match="token_budget"):
        build_self_distilled(base, FIXTURE, max_records=4, cache_dir=tmp_path / "b", store=store,
                             **{**KW, "token_budget": 200})


def test_pack_only_copies_a_running_builds_partial_file(base, tmp_path, monkeypatch):
    """A build killed after its first batch left a partial file; pack_only puts those lines in the store
    without generating anything."""
    calls = []

    def crash_after_one(tok, batch, *args):
        calls.append(len(batch))
        if len(calls) == 2:
            raise RuntimeError("killed")
        return real(tok, batch, *args)

    real = sd._distill_batch
    monkeypatch.setattr(sd, "_distill_batch", crash_after_one)
    with pytest.raises(RuntimeError):
        build_self_distilled(base, FIXTURE, max_records=6, cache_dir=tmp_path, **KW)
    monkeypatch.setattr(sd, "_distill_batch", _counting(calls := []))
    store = tmp_path / "store"
    build_self_distilled(base, FIXTURE, max_records=6, cache_dir=tmp_path, store=store, pack_only=True, **KW)
    assert calls == [] and read_card(store)["conversations"] == 2


def test_the_cards_commands_leave_out_the_machines_out_file(monkeypatch):
    """A store's card is tracked: its commands name no file of the machine that made it (--out, a scratch path)."""
    from types import SimpleNamespace

    from cli.main import _store_commands

    monkeypatch.setattr("sys.argv", ["specdraft", "regenerate", "--source", "sharegpt", "--out", "/scratch/a.jsonl",
                                     "--max-records", "12", "--out=/scratch/b.jsonl", "--store", "datasets/x",
                                     "--pack-only"])
    got = _store_commands(SimpleNamespace(store="datasets/x"))
    assert got["made_with"] == "specdraft regenerate --source sharegpt --max-records 12 --store datasets/x"
    assert got["extend_with"].startswith("specdraft regenerate --source sharegpt --max-records N --store datasets/x")
    assert "/scratch" not in str(got)
