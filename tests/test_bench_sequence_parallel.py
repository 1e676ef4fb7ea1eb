"""bench/sequence_parallel.py runs its 1-rank and 2-rank rows end to end at a small length and records each rank's
memory and the slowest rank's speed (its measured table is in docs/lab; this checks that it runs and what it keeps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_bench_writes_a_row_per_length_and_rank_count(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "sequence_parallel.py"), "--base", "tiny-even", "--lengths",
                    "64", "--ranks", "1,2", "--steps", "1", "--out", str(out)], cwd=ROOT, check=True, timeout=900)
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"64x1", "64x2"}, rows
    for row in rows.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["peak_mib_max"] > row["step_mib_max"] > 0, row
        assert len(row["per_rank"]) == row["ranks"]
