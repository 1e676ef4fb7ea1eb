"""The first line of an eval summary whose speed column is untuned: the run decoded the export's default shape
because no tuning.json choice applies on this machine (eval/tune/choice/apply.py: untuned_speed), so its speedup
says little about what the draft does here; the line names the shape and the command that tunes it for this
machine. `specdraft eval` prints it first, and report.md / suite.md start with it."""

from __future__ import annotations


def untuned_line(untuned: dict | None) -> str | None:
    """From a report's extra["untuned"] ({"status", "why", "retune_command", "shape"}), or None when tuned."""
    if not untuned:
        return None
    return (f"UNTUNED SPEED: the speed column is for the export's default shape ({untuned['shape']}), not one tuned "
            f"for this machine ({untuned['why']}); tune it here with: {untuned['retune_command']}")
