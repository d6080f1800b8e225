"""The conservation guard: a reading whose parts do not add up is withheld by name; a healthy one never is.

The planted fault is an op whose backward is not a function of its inputs (its gradient grows by 1 % at
every backward pass, as gradients through an inductor-compiled graph taken again and again were seen to
drift): the reference engine's parts then do not add up to its own ``g_full``. Reference for the healthy
runs: the readings' own floors (:attr:`CreditReport.conservation_floor`) over 200 steps of the GRPO
example in float32 and under ``bf16-mixed``, separate and riding along.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import lightning.pytorch as pl

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.guard import Suspects, guard
from lens_callbacks.refusal import ReadingWarning

B, T = 4, 6


class _Drifting(torch.autograd.Function):
    """Identity forward; a backward that returns ``(1 + 0.01·n) · grad`` on its n-th call."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Drifting.calls += 1
        return g * (1.0 + 0.01 * _Drifting.calls)


class Policy(pl.LightningModule):
    def __init__(self, fault: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.fault = fault
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 16, (B, T), generator=g)
        self.adv = torch.randn(B, generator=g)

    def credit_terms(self, batch=None) -> CreditTerms:
        h = self.emb(self.ids)
        if self.fault and not torch.is_inference_mode_enabled():
            h = _Drifting.apply(h)
        lp = torch.log_softmax(self.head(torch.tanh(h)), -1).gather(-1, self.ids[..., None])[..., 0]  # [B, T]
        trained = torch.ones(B, T, dtype=torch.bool)
        seg = torch.arange(T)[None].expand(B, T) // 2
        return CreditTerms(
            -self.adv[:, None] * lp / (B * T), trained, torch.arange(B), torch.zeros(B, dtype=torch.long), segment=seg
        )

    def training_step(self, batch, batch_idx):
        return self.credit_terms().terms.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module, audit, steps=5, **kw):
    pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[audit],
        **kw,
    ).fit(module, torch.utils.data.DataLoader(range(steps * kw.get("accumulate_grad_batches", 1)), batch_size=None))


def test_the_planted_fault_breaks_conservation_in_the_reference_engine():
    r = disintegrate(Policy(fault=True), None, "by_segment", engine="reference")
    assert r.conservation_error > 100 * r.conservation_floor and r.conservation_violated
    ok = disintegrate(Policy(), None, "by_segment", engine="reference")
    assert not ok.conservation_violated and ok.conservation_error <= ok.conservation_floor


def test_a_violated_reading_is_withheld_warned_once_and_counted(caplog):
    audit = CreditAuditCallback(partition="by_segment", engine="reference", log_figure=False, log_table_every_n_steps=0)
    with caplog.at_level(logging.WARNING, logger="lens_callbacks"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(Policy(fault=True), audit)
    assert audit.n_audits == 5 and audit.n_refusals == 5
    assert audit.last_report is None and audit.last_withheld is not None
    # the drifting backward also moved the training step's .grad away from the audit's g_full: grad_match says so
    assert audit.last_refusal.condition == "conservation/terms_not_loss"
    words = audit.last_refusal.reason
    assert "conservation_error = " in words and "over its floor" in words and "withheld" in words
    assert audit.last_refusal.numbers["conservation_error"] == audit.last_withheld.conservation_error
    # no share of a withheld reading reaches the loggers; its figure and floor do
    assert not any("projected_share" in k or "norm_share" in k for k in audit.last_values)
    assert audit.last_values["credit/refused"] == 1.0
    assert audit.last_values["credit/conservation_error"] == pytest.approx(audit.last_withheld.conservation_error)
    assert "credit/conservation_floor" in audit.last_values
    ours = [str(w.message) for w in caught if issubclass(w.category, ReadingWarning)]
    assert len([w for w in ours if "REFUSED (conservation/terms_not_loss)" in w]) == 1, ours  # once, not per step
    summary = [r.getMessage() for r in caplog.records if "declined over" in r.getMessage()]
    assert len(summary) == 1 and "conservation/terms_not_loss: 5 (steps 0..4)" in summary[0]


def test_the_refusal_names_the_causes_it_can_tell_apart():
    bad = disintegrate(Policy(fault=True), None, "by_segment", engine="reference")
    assert guard(bad).condition == "conservation"
    r = guard(bad, Suspects(compiled=True, accumulation=2, terms_not_loss=True), step=7)
    assert r.condition == "conservation/compile+accumulation+terms_not_loss"
    for words in ("torch.compile", "gradient accumulation", "not the loss"):
        assert words in r.reason
    assert r.numbers["step"] == 7 and r.numbers["conservation_floor"] == pytest.approx(bad.conservation_floor)


def test_with_accumulation_the_cause_is_named():
    audit = CreditAuditCallback(partition="by_segment", engine="reference", log_figure=False, log_table_every_n_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(Policy(fault=True), audit, steps=2, accumulate_grad_batches=2)
    assert audit.last_refusal.condition.startswith("conservation/accumulation")


@pytest.mark.parametrize(
    "precision, capture",
    [
        ("32-true", "separate"),
        ("32-true", "training_step"),
        ("bf16-mixed", "separate"),
        ("bf16-mixed", "training_step"),
    ],
)
def test_200_healthy_steps_never_trip_the_guard(precision, capture):
    from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

    pl.seed_everything(0, verbose=False)
    module = GRPOModule(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3, dropout=0.1)
    audit = CreditAuditCallback(capture=capture, readings="shares", log_figure=False, log_table_every_n_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            max_steps=200,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[audit],
            precision=precision,
        ).fit(module, AdditionDataModule(batch_size=2, data_seed=0))
    assert audit.n_audits == 200
    conditions = {c for c in audit._once.refusals}
    assert not any(c.startswith("conservation") for c in conditions), audit._once.summary(audit.n_audits)
    assert audit.n_refusals == 0, audit._once.summary(audit.n_audits)
    if capture == "training_step":
        assert audit.n_ride_along == 200  # bf16-mixed rides too: its rounding is within the bf16 floor
