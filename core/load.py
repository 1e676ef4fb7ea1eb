"""The machine's load beside a timing: every speed ratio is read with it (a ratio measured while other work shared
the cores is "loaded": it is reported, but compared with no target and copied into no card)."""

from __future__ import annotations

import os


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


class LoadWatch:
    """The load average at the start and the end of a timed span: `record()` gives {"start", "end", "cores",
    "loaded"}; loaded = the 1-minute load at either end above the core count (the timing shared the CPU)."""

    def __init__(self):
        self.start = load_average()

    def record(self) -> dict:
        end = load_average()
        n = cores()
        peaks = [x[0] for x in (self.start, end) if x]
        return {"start": self.start, "end": end, "cores": n, "loaded": bool(peaks) and max(peaks) > n}


def is_loaded(record: dict | None) -> bool | None:
    """True / False from a LoadWatch record; None when there is none (a report from before loads were recorded)."""
    if not record or "loaded" not in record:
        return None
    return bool(record["loaded"])


def describe(record: dict | None) -> str:
    if not record:
        return "load not recorded"
    peak = max(x[0] for x in (record.get("start"), record.get("end")) if x) if (record.get("start") or
                                                                                    record.get("end")) else None
    word = "LOADED" if record.get("loaded") else "quiet"
    return f"{word}: load average up to {peak} on {record.get('cores')} cores" if peak is not None else word
