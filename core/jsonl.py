"""Append-only JSONL files that a killed run resumes from (compare's rows, the field benchmark's rows and partial
answers): one finished record per line, flushed as each ends."""

from __future__ import annotations

import json
from pathlib import Path


def read_finished_rows(path: Path, repair: bool = True) -> list[dict]:
    """The finished records of `path`, in the order written ([] when it does not exist); a damaged line is skipped
    (its record is redone). A last line cut by a kill mid-write is ignored, and with `repair` (the writer itself,
    about to append) also dropped from the file, so the next append starts on a fresh line; a reader of another
    process's file passes repair=False."""
    path = Path(path)
    rows: list[dict] = []
    if not path.is_file():
        return rows
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        if repair:
            path.write_text(text)
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
