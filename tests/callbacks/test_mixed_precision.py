"""``precision="bf16-mixed"``: the audit reads the autocast function that was trained; the step conserves.

Reference: the full gradient taken by a plain ``torch.autograd.grad`` on the live parameters under
``torch.autocast("cpu", bfloat16)``, compared with the trainer's ``.grad``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from test_conservation_callback import LitPolicy  # noqa: E402  (tests/callbacks is on sys.path)

from lens_callbacks.callbacks.conservation import ConservationCheckCallback
from lens_callbacks.callbacks.credit_audit import CreditAuditCallback
from lens_callbacks.credit.readings.conservation import UNIT_ROUNDOFF, ConservationReading

warnings.filterwarnings("ignore", ".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


class Spy(Callback):
    """After the audit: its grad_match beside a naive autocast reference; after the step: the check."""

    def __init__(self, audit: CreditAuditCallback, check: ConservationCheckCallback) -> None:
        self.audit, self.check = audit, check
        self.rows: list[tuple[float, float]] = []
        self.readings: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for p in pl_module.parameters() if p.requires_grad]
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pl_module.credit_terms(self.batch).terms.sum()
        g = torch.autograd.grad(loss, params)
        num = math.sqrt(sum(float(((a.double() - p.grad.double()) ** 2).sum()) for a, p in zip(g, params)))
        den = math.sqrt(sum(float((a.double() ** 2).sum()) for a in g))
        self.rows.append((self.audit.last_report.grad_match, num / den))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.readings.append(self.check.last_reading)


def _fit(precision_context: bool):
    audit = CreditAuditCallback(log_figure=False, log_table_every_n_steps=0, precision_context=precision_context)
    check = ConservationCheckCallback(log_figure=False)
    spy = Spy(audit, check)
    Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[audit, check, spy],
    ).fit(LitPolicy(dtype=torch.float32))
    return audit, spy


def test_bf16_mixed_grad_match_at_rounding_and_conservation_never_violated():
    audit, spy = _fit(precision_context=True)
    assert len(spy.rows) == 4
    for audited, reference in spy.rows:
        assert reference <= 1e-5  # the reference itself: autocast is the function that was trained
        assert audited <= 1e-5
    assert audit.last_values["credit/grad_match"] <= 1e-5
    assert len(spy.readings) == 4
    for r in spy.readings:
        assert isinstance(r, ConservationReading), r
        assert r.holds and not r.violated, r.render()
        # held against the audit's parts (computed under bfloat16 autocast) on float32 master weights: the floor
        # holds the float32 weights' rounding and the parts' own (their conservation_error, bfloat16 rounding)
        assert r.source == "credit_parts" and r.dtype == "float32"
        assert r.parts_floor > 0 and r.update_precision_floor >= 2 * UNIT_ROUNDOFF[torch.float32] + r.parts_floor
        assert r.status in ("holds", "holds within precision")


def test_bf16_mixed_outside_autocast_the_audit_reads_another_function():
    _, spy = _fit(precision_context=False)
    assert all(audited > 1e-3 for audited, _ in spy.rows), spy.rows
