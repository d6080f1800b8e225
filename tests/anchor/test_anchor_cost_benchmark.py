"""benchmarks/anchor_cost.py runs on the example and prints its table with finite ratios."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_anchor_cost_benchmark_runs():
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "anchor_cost.py"), "--steps", "5", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if re.match(r"\| (4|8|16) \|", line)]
    assert len(rows) == 3
    for row in rows:
        cells = [float(c) for c in row.strip("| ").split(" | ")]
        assert all(c > 0 for c in cells)
        assert cells[5] == pytest.approx(cells[0] + 1)  # the ring holds W + 1 parameter-sized copies
    assert "per-step anchor gradient" in r.stdout
