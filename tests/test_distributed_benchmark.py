"""The DDP benchmark runs on two CPU ranks at a tiny size and names the local engine it timed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("engine, ran", [("auto", "ghost"), ("reference", "reference")])
def test_distributed_benchmark_runs_and_names_its_engine(engine, ran):
    pytest.importorskip("transformers")
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "distributed_cost.py"),
        "--layers",
        "1",
        "--embd",
        "32",
        "--T",
        "8",
        "--B",
        "4",
        "--repeats",
        "1",
        "--engine",
        engine,
        "--port",
        str(_free_port()),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"engine {ran}" in out.stdout
    share_sum = float(re.search(r"share_sum ([0-9.]+)", out.stdout).group(1))
    assert abs(share_sum - 1) < 1e-6  # the global shares of both ranks' parts add up to the applied step
    ratios = re.search(
        r"global/local ([0-9.]+)\s+global/ddp_allreduce ([0-9.]+)\s+\(local\+global\)/train ([0-9.]+)", out.stdout
    )
    assert ratios and all(float(x) > 0 for x in ratios.groups())
