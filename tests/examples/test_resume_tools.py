"""A run of the tool-using GRPO example killed with SIGKILL at a random step and resumed from its last checkpoint.

The example's own config (``cli_configs/grpo_tools_turns.yaml``: the audit by turn, float32) and a
conservation config built from it (float64 weights, plain SGD, dropout 0.1, the audit and the
step-conservation check), and an anchor config (the projected anchor of ``grpo_anchor.yaml``, Adam,
dropout 0.1), shrunk by ``resume_run.py`` to 10 steps of 4 per epoch, checkpointing every step. The resumed run ends with
the uninterrupted run's parameters, bit for bit, and every reading of every step and epoch end (written as
``float.hex``) equals the uninterrupted run's. The kill step is drawn from a seeded generator; the process
is really killed (no cleanup runs).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from _resume import ROOT, by_key, kill_at, lines, run  # noqa: E402

MAX_STEPS = 10  # resume_run.MAX_STEPS
SOURCE = ROOT / "cli_configs" / "grpo_tools_turns.yaml"
ANCHOR_SOURCE = ROOT / "cli_configs" / "grpo_anchor.yaml"


def _config(name: str, path: Path) -> Path:
    """The example's YAML with the lens callbacks of config ``name`` (the run record is left out)."""
    cfg = yaml.safe_load(SOURCE.read_text())
    (audit,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith(".CreditAuditCallback")]
    cfg["trainer"]["callbacks"] = [audit]
    if name == "anchor":
        # The anchor of grpo_anchor.yaml (resume_run.py shrinks its cadence so it projects within 10 steps),
        # with Adam and dropout as there: the merger changes .grad, Adam keeps state across the resume.
        anchor = yaml.safe_load(ANCHOR_SOURCE.read_text())["trainer"]["callbacks"]
        cfg["trainer"]["callbacks"] = anchor
        cfg["model"]["init_args"].update(optimizer="adam", lr=0.003, dropout=0.1)
    if name == "conservation":
        # float64 and plain SGD: the check holds the summed parts against the update taken, at rounding.
        # With dropout: its masks, at sampling and in every forward of the step, must be the step's own.
        cfg["model"]["init_args"].update(dtype="float64", optimizer="sgd", momentum=0.0, weight_decay=0.0, dropout=0.1)
        audit["init_args"]["dtype"] = "float64"
        cfg["trainer"]["callbacks"].append(
            {
                "class_path": "lens_callbacks.callbacks.ConservationCheckCallback",
                "init_args": {"every_n_steps": 1, "tolerance": 1.0e-4, "use_credit_audit": True},
            }
        )
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["credit", "conservation", "anchor"])
def test_tools_example_sigkill_at_a_random_step_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, name):
    config = _config(name, tmp_path / f"grpo_tools_{name}.yaml")
    kill_step = random.Random(f"resume-tools-{name}").randrange(1, MAX_STEPS - 2)

    run(config, tmp_path / "full", timeout=300)
    killed = tmp_path / "killed"
    kill_at(config, killed, kill_step, timeout=300)
    assert (killed / "ckpt" / "last.ckpt").exists() and not (killed / "params.pt").exists()
    run(config, killed, timeout=300)  # resumes from last.ckpt

    full, resumed = lines(tmp_path / "full" / "readings.jsonl"), lines(killed / "readings.jsonl")
    assert [r["step"] for r in full if "step" in r] == list(range(MAX_STEPS))
    # The second process started from a checkpoint, not from scratch: step 0 was written once, by the
    # killed process (the kill step is >= 1).
    steps = [r["step"] for r in resumed if "step" in r]
    assert steps.count(0) == 1 and sorted(set(steps)) == list(range(MAX_STEPS)), steps

    a, b = by_key(full), by_key(resumed)
    assert a.keys() == b.keys()
    if name != "anchor":  # the audit's epochs ended before and after the kill (the anchor keeps none)
        assert sum(k[0] == "epoch" for k in a) >= 2
    for key in a:
        assert a[key] == b[key], key

    # The readings are real ones: each callback of the config read every step (the audit by turn).
    expect = {
        "credit": {"CreditAuditCallback"},
        "conservation": {"CreditAuditCallback", "ConservationCheckCallback"},
        "anchor": {"AnchorProjectionCallback"},
    }[name]
    for s in range(MAX_STEPS):
        got = a[("step", s)]["readings"]
        assert set(got) == expect and all(got[k] for k in expect), s
        if name == "anchor":
            continue
        values = got["CreditAuditCallback"]["values"]
        assert float.fromhex(values["credit/projected_share/turn_2"]) != 0.0  # the first assistant turn
        # the audit's forward drew the training forward's dropout masks: its gradient is the trained one
        assert float.fromhex(values["credit/grad_match"]) <= {"credit": 1e-5, "conservation": 1e-12}[name], s
        if name == "conservation":
            reading = got["ConservationCheckCallback"]
            assert reading["type"] == "ConservationReading" and reading["source"] == "credit_parts"
            assert float.fromhex(reading["relative_error"]) <= float.fromhex(reading["tolerance"]), s

    if name == "anchor":  # it merged at every step after the first, and projected after the resume
        anchor = [a[("step", s)]["readings"]["AnchorProjectionCallback"] for s in range(MAX_STEPS)]
        assert all(r["merged"] == s for s, r in enumerate(anchor) if s >= 1)
        assert any(r["reading"] and r["reading"]["projected"] for r in anchor[kill_step + 1 :])

    pa, pb = torch.load(tmp_path / "full" / "params.pt"), torch.load(killed / "params.pt")
    assert pa.keys() == pb.keys() and len(pa) > 0
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
