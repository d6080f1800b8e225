"""``lens-callbacks audit RUN_DIR --step N --probe FILE``: the offline probe reading against the live one.

A tool-using GRPO run (Adam, float64) is recorded while ``ProbeCreditCallback`` reads a probe of held-out
episodes (another run's trajectories); the offline audit rebuilds step N from the record, replays the
optimizer's state and takes the step again. The live reading is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lightning.pytorch import Callback, Trainer  # noqa: E402

from lens_callbacks.callbacks.probe import ProbeCreditCallback  # noqa: E402
from lens_callbacks.callbacks.records import RunRecordCallback  # noqa: E402
from lens_callbacks.commands.probe_audit import probe_audit  # noqa: E402
from lens_callbacks.examples.grpo_tools import ToolsAdditionDataModule  # noqa: E402
from lens_callbacks.examples.grpo_tools.probe import ToolsProbeModule  # noqa: E402
from lens_callbacks.io.records import RunRecord, write_trajectories  # noqa: E402

pytestmark = pytest.mark.slow

KW = dict(seed=0, optimizer="adam", lr=1e-2, dtype="float64")


class _Keep(Callback):
    def __init__(self, probe):
        self.probe, self.reports = probe, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.reports.append(self.probe.last_reports["heldout"])


def _fit(module, steps, record_dir, callbacks=()):
    Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(record_dir.parent),
        callbacks=[RunRecordCallback(str(record_dir), checkpoint_every=0), *callbacks],
    ).fit(module, ToolsAdditionDataModule(prompts_per_step=2))
    return RunRecord(record_dir)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe_audit")
    other = _fit(ToolsProbeModule(seed=7), 1, d / "other")  # another run's episodes: held out from this one
    held = other.trajectories(0)
    probe_file = write_trajectories(d / "heldout.jsonl", held)
    m = ToolsProbeModule(**KW)
    m.probe_batches = {"heldout": held}
    cb = ProbeCreditCallback(dtype="float64", split_by=[], log_table_every_n_steps=0)
    keep = _Keep(cb)
    _fit(m, 3, d / "record", [cb, keep])
    return d / "record", probe_file, keep.reports


def test_offline_probe_audit_equals_the_live_reading(live):
    record_dir, probe_file, reports = live
    for step in (1, 2):
        got = probe_audit(record_dir, step, probe_file, dtype="float64", progress=False)
        want = reports[step]
        assert got.part_names == want.part_names and got.probe == "heldout"
        for a, b in zip(got.contribution, want.contribution):
            assert a == pytest.approx(b, rel=1e-10, abs=1e-16)
        assert got.carried == pytest.approx(want.carried, rel=1e-10, abs=1e-16) and want.carried != 0.0
        assert got.loss_before == pytest.approx(want.loss_before, rel=1e-12)
        assert got.actual == pytest.approx(want.actual, rel=1e-8, abs=1e-15)
        assert got.update_match < 1e-10


def test_console_script_prints_the_probe_reading_and_refuses_a_bad_probe_file(live, capsys, tmp_path, monkeypatch):
    from lens_callbacks.cli import main

    record_dir, probe_file, _ = live
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["audit", str(record_dir), "--step", "2", "--probe", str(probe_file), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "probe 'heldout' at step 2" in out and "actual ΔL_probe" in out
    assert main(["audit", str(record_dir), "--step", "2", "--probe", str(probe_file), "--json", "--no-progress"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "probe/heldout/first_order_gap" in d
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "lens_callbacks.trajectory/1", "turns": 3}\n')
    assert main(["audit", str(record_dir), "--step", "2", "--probe", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "turns" in err


@pytest.fixture(scope="module")
def live_single_turn(tmp_path_factory):
    """The documented probe example (``GRPOProbeModule``, Adam, float64) recorded with the single-turn batch
    builder, its ``carry`` probe written as a probe file of addition prompts."""
    import torch

    from lens_callbacks.credit.inputs.trajectories import Trajectory, Turn
    from lens_callbacks.examples.grpo import AdditionDataModule
    from lens_callbacks.examples.grpo.probe import GRPOProbeModule
    from lens_callbacks.examples.grpo.task import prompt_text

    d = tmp_path_factory.mktemp("probe_single_turn")
    torch.manual_seed(0)
    m = GRPOProbeModule(n_layer=1, n_embd=16, n_head=2, n_probe=4, optimizer="adam", lr=3e-3, dtype="float64")
    pairs = m.probe_batches()["carry"].tolist()
    probe_file = write_trajectories(
        d / "carry.jsonl", [Trajectory((Turn("user", prompt_text(a, b)),), 0.0, k, k) for k, (a, b) in enumerate(pairs)]
    )
    cb = ProbeCreditCallback(dtype="float64", split_by=[], log_table_every_n_steps=0)
    keep = []

    class Keep(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            keep.append(cb.last_reports["carry"])

    Trainer(
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(d),
        callbacks=[
            RunRecordCallback(
                str(d / "record"),
                checkpoint_every=0,
                batch_builder="lens_callbacks.examples.grpo_tools.single_turn.grpo_rollout_batch",
            ),
            cb,
            Keep(),
        ],
    ).fit(m, AdditionDataModule(batch_size=2))
    return d / "record", probe_file, keep


def test_documented_probe_example_audits_offline_as_it_read_live(live_single_turn):
    record_dir, probe_file, reports = live_single_turn
    for step in (1, 2):
        got = probe_audit(record_dir, step, probe_file, dtype="float64", progress=False)
        want = reports[step]
        assert got.part_names == want.part_names and got.probe == "carry", got
        for a, b in zip(got.contribution, want.contribution):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-15)
        assert got.loss_before == pytest.approx(want.loss_before, rel=1e-12)
        assert got.actual == pytest.approx(want.actual, rel=1e-8, abs=1e-15)
        assert got.update_match < 1e-10
    from lens_callbacks.cli import main

    assert main(["audit", str(record_dir), "--step", "2", "--probe", str(probe_file), "--no-progress"]) == 0
