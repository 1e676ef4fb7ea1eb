"""Running the `specdraft` CLI in a child process, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_specdraft(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`specdraft ARGS` (python -m cli.main) in a child process with `env`; it must exit 0 within 15 minutes, or
    the assertion shows the tails of its stdout and stderr."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def smoke_cli_train(run_dir: Path, recipe: str, overrides: list[str], env: dict) -> list[dict]:
    """`specdraft train --config RECIPE --config configs/smoke.yaml run_dir=RUN_DIR OVERRIDES...`; returns the rows of
    its metrics.jsonl."""
    run_specdraft(["train", "--config", recipe, "--config", "configs/smoke.yaml", f"run_dir={run_dir}", *overrides],
                  env)
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]


def smoke_cli_eval(run_dir: Path, name: str, overrides: list[str], env: dict) -> dict:
    """`specdraft eval` of run_dir's export on the smoke eval set (configs/eval/smoke.yaml) as eval `name`, with
    key=value `overrides`; returns its report.json."""
    run_specdraft(["eval", "--draft", str(run_dir / "export"), "--config", "configs/eval/smoke.yaml", f"name={name}",
                   *overrides], env)
    return json.loads((run_dir / "eval" / name / "report.json").read_text())
