"""A run of the GRPO example killed with SIGKILL at a random step and resumed from its last checkpoint.

For the credit, conservation and anchor configs (``cli_configs/grpo_{credit,conservation,anchor}.yaml``,
shrunk by ``resume_run.py``): the resumed run ends with the uninterrupted run's parameters, bit for bit,
and every reading of every step and every epoch end (written as ``float.hex``) equals the uninterrupted
run's. The kill step is drawn from a seeded generator; the process is really killed (no cleanup runs).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("resume_run.py")
MAX_STEPS = 10


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _run(config: Path, out: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(RUNNER), str(config), str(out)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            pass
    return out


def _by_key(rows: list[dict]) -> dict:
    # The resumed run rewrites the steps after its checkpoint: the last line of a step is the one that counts.
    return {("step", r["step"]) if "step" in r else ("epoch", tuple(r["epoch_end_step"])): r for r in rows}


def _kill_at(config: Path, out: Path, step: int) -> None:
    proc = subprocess.Popen([sys.executable, str(RUNNER), str(config), str(out)], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if any(r.get("step", -1) >= step for r in _lines(out / "readings.jsonl")):
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_credit", "grpo_conservation", "grpo_anchor"])
def test_sigkill_at_a_random_step_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, name):
    config = ROOT / "cli_configs" / f"{name}.yaml"
    kill_step = random.Random(f"resume-{name}").randrange(1, MAX_STEPS - 2)

    _run(config, tmp_path / "full")
    killed = tmp_path / "killed"
    _kill_at(config, killed, kill_step)
    assert (killed / "ckpt" / "last.ckpt").exists() and not (killed / "params.pt").exists()
    _run(config, killed)  # resumes from last.ckpt

    full, resumed = _lines(tmp_path / "full" / "readings.jsonl"), _lines(killed / "readings.jsonl")
    assert sum("step" in r for r in full) == MAX_STEPS
    assert any("step" in r and r["step"] <= kill_step for r in resumed)
    a, b = _by_key(full), _by_key(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key
    # The readings are real ones: the callbacks of the config were there and read something.
    last = a[("step", MAX_STEPS - 1)]["readings"]
    expect = {"grpo_credit": {"CreditAuditCallback"}, "grpo_conservation": {"CreditAuditCallback", "ConservationCheckCallback"},
              "grpo_anchor": {"AnchorProjectionCallback"}}[name]
    assert set(last) == expect and all(last[k] for k in expect)

    pa, pb = torch.load(tmp_path / "full" / "params.pt"), torch.load(killed / "params.pt")
    assert pa.keys() == pb.keys() and len(pa) > 0
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
