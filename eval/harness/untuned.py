"""The first line of an eval summary whose speed column is untuned: no tuning.json choice applies on this machine
(eval/choice/apply.py: untuned_speed), so the run decoded either the shape a short probe chose
(eval/tune/untuned_probe.py, `specdraft eval`'s default) or the export's default shape (untuned_probe=false), and
its speedup says less than a tuned one would; the line names the shape, what the probe measured and the command that
tunes it for this machine. `specdraft eval` prints it first, and report.md / suite.md start with it."""

from __future__ import annotations


def untuned_line(untuned: dict | None) -> str | None:
    """From a report's extra["untuned"] ({"status", "why", "retune_command", "shape"}, and "probe" when a short probe
    chose the shape: eval/tune/untuned_probe.py), or None when tuned."""
    if not untuned:
        return None
    probe = untuned.get("probe")
    if probe:
        why = (untuned["why"] if untuned.get("status") == "untuned"
               else f"tuning.json's choice does not apply here ({untuned['why']})")
        return (f"UNTUNED SPEED: {why}; the speed column is for {probe_clause(probe)} ({untuned['shape']}); tune it "
                f"here with: {untuned['retune_command']}")
    return (f"UNTUNED SPEED: the speed column is for the export's default shape ({untuned['shape']}), not one tuned "
            f"for this machine ({untuned['why']}); tune it here with: {untuned['retune_command']}")


def probe_clause(probe: dict) -> str:
    """What the untuned-shape probe chose and measured, in one clause: "chain 2, the shape a 2-prompt x 32-token
    probe chose (chain 1 1.10x; chain 2 1.13x; ...)", speeds against own AR (probe: eval/tune/untuned_probe.py
    summarize's dict)."""
    if not probe.get("points"):  # nothing measured: say why (the family has one shape, AR failed, ...)
        return f"{probe['label']} ({probe.get('reason') or 'the shape probe measured nothing'})"
    measured = "; ".join(f"{p['label']} {p['speedup']:.2f}x" for p in probe["points"])
    verdict = "" if probe.get("beats_ar") else ", none beyond its noise over own AR"
    cached = ", cached" if probe.get("cached") else ""
    on = f" on {probe['dataset']}" if probe.get("dataset") else ""
    return (f"{probe['label']}, the shape a {probe.get('prompts')}-prompt x {probe.get('max_new_tokens')}-token "
            f"probe{on} chose ({measured}{verdict}{cached})")
