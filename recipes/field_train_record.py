"""A finished training run's record for the families table: recipes/field_families_table.py collect writes it to
docs/lab/field_families/<run>/train.json (steps, tokens, CPU-minutes and the basis they rest on, the machine kind,
the load averages of each start), and the tables read the CPU count back through cpu_cost / cpu_cell."""

from __future__ import annotations

import json
import math
import platform
import re
import statistics
import subprocess
from pathlib import Path


def machine_kind() -> dict:
    """The CPU kind a run trained on: lscpu's model name, cores, and the instruction sets that set its speed."""
    model, cores, flags = platform.processor() or "unknown", 0, set()
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        model = fields.get("Model name", model)
        cores = int(fields.get("CPU(s)", 0))
        flags = set(fields.get("Flags", "").split())
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    return {"model": model, "cpus": cores, "isa": isa, "kind": f"{cores}-core {model} ({kind})"}


def _loads(log: Path, run: str) -> list[dict]:
    """The recipe's start / end lines of a run's log: time and load average."""
    out = []
    if log.is_file():
        pattern = rf"=== train {re.escape(run)} (start|end)(?: rc=(\d+))? (\S+) load ([\d.]+) ([\d.]+) ([\d.]+)"
        for m in re.finditer(pattern, log.read_text(errors="replace")):
            out.append({"event": m.group(1), "rc": int(m.group(2)) if m.group(2) else None, "utc": m.group(3),
                        "load": [float(m.group(i)) for i in (4, 5, 6)]})
    return out


def cmd_collect(a) -> int:
    run_dir = Path("runs") / a.run
    export = json.loads((run_dir / "export" / "config.json").read_text())
    cfg_text = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else ""
    import yaml

    cfg = yaml.safe_load(cfg_text) if cfg_text else {}
    tps = [json.loads(line)["tokens_per_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
           if '"tokens_per_s"' in line]
    cpu = []
    tsv = Path("runs/logs") / f"{a.run}.cpu.tsv"
    if tsv.is_file():
        for line in tsv.read_text().splitlines():
            p = line.split("\t")
            if len(p) >= 7:
                cpu.append({"start": p[0], "end": p[1], "wall_s": float(p[2]), "user_s": float(p[3]),
                            "sys_s": float(p[4]), "maxrss_kb": int(p[5]), "rc": int(p[6])})
    steps = int(export.get("trained_steps", 0))
    batch = int(cfg.get("train", {}).get("global_batch_size", 8))
    rows = _train_rows(cfg)
    epoch_tokens = export.get("train_data", {}).get("epoch_tokens")
    tokens = round(steps * batch * epoch_tokens / rows) if rows and epoch_tokens else None
    heldout = {}
    if (run_dir / "heldout.json").is_file():
        h = json.loads((run_dir / "heldout.json").read_text())
        heldout = {"top1_by_depth": [d["top1"] for d in h.get("depths", [])], "est_accept_len": h.get("est_accept_len")}
    out = {"run": a.run, "family": a.family, "label": a.label or _title(a.family),
           "export_family": export.get("family"), "steps": steps, "global_batch": batch, "train_rows": rows,
           "epoch_tokens": epoch_tokens, "tokens_seen": tokens,
           "epochs": round(steps * batch / rows, 3) if rows else None,
           "train_minutes": round(export.get("train_seconds", 0) / 60, 1),
           **cpu_cost(export, cpu),
           "wall_minutes": round(sum(c["wall_s"] for c in cpu) / 60, 1) if cpu else None,
           "invocations": cpu, "log": _loads(Path("runs/logs") / f"{a.run}.log", a.run),
           "tokens_per_s": {"median": round(statistics.median(tps), 1), "p10": round(_q(tps, 0.1), 1),
                            "p90": round(_q(tps, 0.9), 1)} if tps else None,
           "trainable_params": export.get("trainable_params"), "train_dtype": export.get("train_dtype"),
           "lr": cfg.get("train", {}).get("lr"), "threads": cfg.get("train", {}).get("num_threads"),
           "data": {k: cfg.get("data", {}).get(k) for k in ("source", "max_records", "max_length")},
           "draft": cfg.get("draft", {}), "loss": cfg.get("loss", {}),
           "heldout": heldout, "machine": machine_kind(), "command": a.command}
    dest = Path(a.reports) / a.run
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "train.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest / 'train.json'}: {steps} steps, {tokens} tokens, {out['cpu_minutes']} CPU-min, "
          f"{out['train_minutes']} train min, median {out['tokens_per_s'] and out['tokens_per_s']['median']} tok/s, "
          f"{out['machine']['kind']}")
    return 0


UPPER_BOUND = "loop wall (upper bound)"  # cpu_basis where the count is the loop's wall clock


def cpu_cost(export: dict, invocations: list[dict]) -> dict:
    """The training's CPU-minutes and what they rest on: the trainer's own count (process CPU over every start,
    export `train_cpu_seconds`), else `time`'s user + system summed over the invocations when those cover the
    training loop (their wall clock at least 95 % of its), else the loop's wall clock: an upper bound for a
    one-thread run, since a start killed with its session leaves no `time` record."""
    if export.get("train_cpu_seconds") is not None:
        return {"cpu_minutes": round(export["train_cpu_seconds"] / 60, 1), "cpu_basis": "trainer"}
    loop_min = export.get("train_seconds", 0) / 60
    if invocations and sum(c["wall_s"] for c in invocations) / 60 >= 0.95 * loop_min:
        return {"cpu_minutes": round(sum(c["user_s"] + c["sys_s"] for c in invocations) / 60, 1), "cpu_basis": "time"}
    return {"cpu_minutes": round(loop_min, 1), "cpu_basis": UPPER_BOUND} if loop_min else \
        {"cpu_minutes": None, "cpu_basis": None}


def cpu_cell(t: dict) -> str:
    """A table's CPU-min cell: the bound marked where the count is the loop's wall clock."""
    if t.get("cpu_minutes") is None:
        return "-"
    if t.get("cpu_basis") == UPPER_BOUND:
        return f"≤ {math.ceil(t['cpu_minutes'])}"  # a bound rounds up
    return f"{t['cpu_minutes']:.0f}"


def _title(name: str) -> str:
    """A run's row name: the label its family declares for it (FamilySpec.field_runs: hydra_pp -> Hydra++), else the
    family's title."""
    from models.registry import FAMILIES, field_runs

    runs = field_runs()
    return runs[name].label if name in runs else FAMILIES[name].title if name in FAMILIES else name


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _train_rows(cfg: dict) -> int | None:
    """Train conversations: the rows of the hidden-state cache the run read (its manifest)."""
    root = Path(cfg.get("data", {}).get("cache_dir") or "") / "hidden"
    best = None
    for m in sorted(root.glob("*/manifest.json")) if root.parts else []:
        man = json.loads(m.read_text())
        if man.get("aux_layers"):
            best = int(man["rows"])
    return best
