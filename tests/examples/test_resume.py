"""A run of the GRPO example killed with SIGKILL at a random step and resumed from its last checkpoint.

For the credit, conservation and anchor configs (``cli_configs/grpo_{credit,conservation,anchor}.yaml``,
shrunk by ``resume_run.py``): the resumed run ends with the uninterrupted run's parameters, bit for bit,
and every reading of every step and every epoch end (written as ``float.hex``) equals the uninterrupted
run's. The kill step is drawn from a seeded generator; the process is really killed (no cleanup runs).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from _resume import ROOT, by_key, kill_at, lines, run  # noqa: E402

MAX_STEPS = 10


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_credit", "grpo_conservation", "grpo_anchor"])
def test_sigkill_at_a_random_step_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, name):
    config = ROOT / "cli_configs" / f"{name}.yaml"
    kill_step = random.Random(f"resume-{name}").randrange(1, MAX_STEPS - 2)

    run(config, tmp_path / "full")
    killed = tmp_path / "killed"
    kill_at(config, killed, kill_step)
    assert (killed / "ckpt" / "last.ckpt").exists() and not (killed / "params.pt").exists()
    run(config, killed)  # resumes from last.ckpt

    full, resumed = lines(tmp_path / "full" / "readings.jsonl"), lines(killed / "readings.jsonl")
    assert sum("step" in r for r in full) == MAX_STEPS
    assert any("step" in r and r["step"] <= kill_step for r in resumed)
    a, b = by_key(full), by_key(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key
    # The readings are real ones: the callbacks of the config were there and read something.
    last = a[("step", MAX_STEPS - 1)]["readings"]
    expect = {
        "grpo_credit": {"CreditAuditCallback"},
        "grpo_conservation": {"CreditAuditCallback", "ConservationCheckCallback"},
        "grpo_anchor": {"AnchorProjectionCallback"},
    }[name]
    assert set(last) == expect and all(last[k] for k in expect)

    pa, pb = torch.load(tmp_path / "full" / "params.pt"), torch.load(killed / "params.pt")
    assert pa.keys() == pb.keys() and len(pa) > 0
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
