"""metrics.jsonl (always) + Weights & Biases (offline by default), written by rank 0 only."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, run_dir: Path, cfg_dict: dict, wandb_cfg, run_name: str, active: bool, resume_step: int = 0):
        self.active = active
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        if not active:
            return
        if not resume_step and self.path.exists():
            log.warning("%s exists from an earlier run in this directory; starting it afresh "
                        "(use resume=auto to continue that run instead)", self.path)
            self.path.unlink()
        if resume_step and self.path.exists():
            # Steps after the checkpoint we resume from are replayed: drop their old lines.
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self._file = self.path.open("a")
        mode = os.environ.get("WANDB_MODE", wandb_cfg.mode)
        if wandb_cfg.enabled and mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, name=run_name,
                                         dir=str(run_dir), config=cfg_dict, tags=list(wandb_cfg.tags), mode=mode,
                                         resume="allow", id=_wandb_id(run_dir))
            except Exception as exc:  # tracking must never kill a training run
                log.warning("wandb disabled for this run (%s); metrics.jsonl still has everything", exc)

    def log(self, metrics: dict, step: int) -> None:
        if not self.active:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        if not self.active:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same W&B run."""
    id_file = run_dir / ".wandb_id"
    if not id_file.exists():
        import uuid

        id_file.write_text(uuid.uuid4().hex[:12])
    return id_file.read_text().strip()
