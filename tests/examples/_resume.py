"""Running ``resume_run.py`` in a subprocess, killing it with SIGKILL, and reading back what it wrote.

Shared by the resume tests of the examples (``test_resume.py``, ``test_resume_tools.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("resume_run.py")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def run(config: Path, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """One run to its end (resuming from ``out/ckpt/last.ckpt`` when there is one)."""
    r = subprocess.run(
        [sys.executable, str(RUNNER), str(config), str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def lines(path: Path) -> list[dict]:
    """The rows of a ``readings.jsonl`` in the order written."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            pass
    return out


def by_key(rows: list[dict]) -> dict:
    # The resumed run rewrites the steps after its checkpoint: the last line of a step is the one that counts.
    return {("step", r["step"]) if "step" in r else ("epoch", tuple(r["epoch_end_step"])): r for r in rows}


def kill_at(config: Path, out: Path, step: int, timeout: float = 300) -> None:
    """Start a run and SIGKILL it once it has written the readings of ``step`` (no cleanup runs)."""
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), str(config), str(out)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if any(r.get("step", -1) >= step for r in lines(out / "readings.jsonl")):
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended (rc {proc.returncode}) before step {step}")
            time.sleep(0.05)
        else:
            pytest.fail(f"step {step} not reached in time")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
