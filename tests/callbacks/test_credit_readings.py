"""CreditAuditCallback's readings beyond the primary report, on the GRPO example.

References: the reference engine run on the same batch in the same hook for each extra partition
(float64), sums of the logged per-step readings for the ledger, and an uninterrupted run for resume.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl

from lens_callbacks.callbacks import CreditAuditCallback, ExtraReadings
from lens_callbacks.credit import Partition, disintegrate
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule
from tests.callbacks.test_credit_audit import SMALL, _fit

F64 = {"dtype": "float64"}


def first_token(terms):
    """Within-row parts (first trained token vs the rest): not a union of rollouts."""
    ids = torch.full_like(terms.trained, -1, dtype=torch.long)
    first = terms.trained & (terms.trained.long().cumsum(1) == 1)
    ids[terms.trained] = 1
    ids[first] = 0
    return Partition(ids, ("first", "rest"))


class _Check(pl.Callback):
    """After the audit in the same hook: the engine's own reading of each extra partition."""

    def __init__(self, audit, names):
        self.audit, self.names, self.rows = audit, names, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        batch = pl_module.last_rollout_batch
        direct = {n: disintegrate(pl_module, batch, n, dtype="float64") for n in self.names}
        self.rows.append(
            (dict(self.audit.last_values), self.audit.last_report, direct, dict(self.audit.step_readings.last_extra))
        )


def test_extra_partitions_equal_their_own_engine_reading_and_no_positional_scalars():
    names = ["by_advantage_sign", "by_source", "by_reward"]
    audit = CreditAuditCallback(
        partition=["by_rollout", "by_advantage_sign"],
        extras=ExtraReadings(partitions=["by_source", "by_reward"]),
        dtype="float64",
    )
    check = _Check(audit, names)
    _fit([audit, check], steps=6, seed=2, module_kw=F64)
    defined = 0
    for values, report, direct, extra in check.rows:
        assert not any("rollout_" in k for k in values), sorted(k for k in values if "rollout_" in k)
        for tag in (
            "credit/concentration/effective_parts_norm",
            "credit/concentration/top1_share",
            "credit/noise/grad_sq_ema",
            "credit/by_advantage_sign/projected_share/positive",
            "credit/by_source/projected_share/carry",
            "credit/by_source/projected_share/no_carry",
        ):
            assert tag in values, tag
        # The smoothed noise scale is logged exactly when it is defined (the smoothed ‖G‖² is positive), never as NaN.
        assert ("credit/noise/b_simple_ema" in values) == (values["credit/noise/grad_sq_ema"] > 0)
        assert not [k for k, v in values.items() if "/noise/" in k and v != v]
        if not report.ok:
            continue
        defined += 1
        for n in names:
            assert extra[n].method == "derived" and extra[n].part_names == direct[n].part_names
            for a, b in zip(extra[n].projected_share, direct[n].projected_share):
                assert a == pytest.approx(b, abs=1e-12)
                assert (
                    values[f"credit/{n}/projected_share/{direct[n].part_names[extra[n].projected_share.index(a)]}"] == a
                )
        assert values["credit/by_advantage_sign/projected_share/zero"] == 0.0  # zero advantage, zero terms
        assert "credit/noise/b_simple" in values and "credit/noise/grad_sq_ema" in values
    assert defined >= 2
    assert "credit by by_advantage_sign" in audit.step_readings.render()


def test_a_partition_that_is_not_a_union_runs_the_engine():
    audit = CreditAuditCallback(
        extras=ExtraReadings(partitions=["tests.callbacks.test_credit_readings.first_token"]), dtype="float64"
    )
    check = _Check(audit, [first_token])
    _fit([audit, check], steps=2, seed=2, module_kw=F64)
    for values, report, direct, extra in check.rows:
        got = extra["tests.callbacks.test_credit_readings.first_token"]
        assert got.method == "engine" and got.part_norm is not None
        assert got.projected_share == pytest.approx(direct[first_token].projected_share, abs=1e-12, nan_ok=True)


def test_positional_scalars_on_request_only():
    audit = CreditAuditCallback(max_logged_parts=2, extras=ExtraReadings(log_positional_parts=True))
    _fit([audit], steps=1, seed=2)
    assert "credit/projected_share/rollout_0" in audit.last_values
    with pytest.raises(ValueError, match="`extras.partitions` must name each partition once"):
        CreditAuditCallback(extras=ExtraReadings(partitions=["by_rollout"]))
    with pytest.raises(ValueError, match="`partition` must be one of"):
        CreditAuditCallback(extras=ExtraReadings(partitions=["by_nothing"]))
    with pytest.raises(ValueError, match="`noise_ema` must be in"):
        ExtraReadings(noise_ema=1.0)


class _Values(pl.Callback):
    def __init__(self, audit):
        self.audit, self.rows = audit, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(dict(self.audit.last_values))


def test_ledger_sums_the_per_step_readings_and_resumes_bitwise(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(extras=ExtraReadings(partitions=["by_advantage_sign", "by_source"]), dtype="float64")
    straight = CreditAuditCallback(**kw)
    seen = _Values(straight)
    _fit([straight, seen], steps=4, seed=0, module_kw=F64)
    for part in ("by_advantage_sign", "by_source"):
        tot = straight.step_readings.ledger.totals("gradient", part)
        for name, value in tot.items():
            steps = [r[f"credit/{part}/projected_share/{name}"] for r in seen.rows]
            want = math.fsum(v for v in steps if math.isfinite(v))
            assert value == pytest.approx(want, abs=1e-12)
            assert seen.rows[-1][f"credit/ledger/gradient/{part}/{name}"] == value

    first = CreditAuditCallback(**kw)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=2)
    pl.seed_everything(0, verbose=False)
    pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[first, ckpt],
    ).fit(GRPOModule(**{**SMALL, **F64}), AdditionDataModule(batch_size=2, data_seed=0))
    resumed = CreditAuditCallback(**kw)
    after = _Values(resumed)
    pl.seed_everything(0, verbose=False)
    m = GRPOModule(**{**SMALL, **F64})
    pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[resumed, after],
    ).fit(m, AdditionDataModule(batch_size=2, data_seed=0), ckpt_path=str(tmp_path / "last.ckpt"))
    assert len(after.rows) == 2
    # The restored ledger is the checkpoint's, continued over steps 2 and 3: the same float additions
    # in the same order give the same bits.
    for part in ("by_advantage_sign", "by_source"):
        hist = resumed.step_readings.ledger.history("gradient", part)
        assert hist[: len(first.step_readings.ledger.history("gradient", part))] == first.step_readings.ledger.history(
            "gradient", part
        )
        for name, value in resumed.step_readings.ledger.totals("gradient", part).items():
            want = first.step_readings.ledger.totals("gradient", part)[name]
            for row in after.rows:
                v = row[f"credit/{part}/projected_share/{name}"]
                if all(math.isfinite(x) for k, x in row.items() if k.startswith(f"credit/{part}/projected_share/")):
                    want = want + v
            assert value == want  # bit for bit
    assert resumed.step_readings.noise_ema.n >= first.step_readings.noise_ema.n


def test_yaml_takes_a_list_of_partitions(tmp_path, monkeypatch):
    import sys

    from lens_callbacks.cli import cli_main

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    extra = tmp_path / "extra.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: lens_callbacks.callbacks.CreditAuditCallback\n"
        "      init_args:\n        partition: [by_rollout, by_advantage_sign]\n        extras: {partitions: [by_source]}\n"
    )
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", ["lens-callbacks"])
    cli = cli_main(["--config", str(root / "cli_configs" / "grpo_credit.yaml"), "--config", str(extra)], run=False)
    (audit,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, CreditAuditCallback)]
    assert audit.partition == "by_rollout" and audit.extra_partitions == ["by_advantage_sign", "by_source"]
