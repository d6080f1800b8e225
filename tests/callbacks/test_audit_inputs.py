"""CreditAuditCallback on bad input: set-up errors once, refusals with their reason, text that agrees with scalars.

The module is a float64 linear policy whose step ``i`` is a function of ``i`` alone; what goes wrong at
which step is chosen per test. The text checked is the table the callback renders for the step.
"""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import pytest
import torch

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.credit import CreditTerms
from lens_callbacks.refusal import Refusal

B, T = 2, 3


class Module(pl.LightningModule):
    def __init__(self, zero_steps=(), nan_steps=(), segments=True, stray_steps=()):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.4, -0.3], dtype=torch.float64))
        self.zero_steps, self.nan_steps, self.segments, self.stray_steps = (
            set(zero_steps),
            set(nan_steps),
            segments,
            set(stray_steps),
        )

    def _terms(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(B, T, 2, generator=g, dtype=torch.float64)  # [B, T, 2]
        adv = (
            torch.zeros(B, dtype=torch.float64)
            if i in self.zero_steps
            else torch.tensor([1.0, -0.5], dtype=torch.float64)
        )
        terms = -adv[:, None] * torch.tanh(x @ self.w)  # [B, T]
        if i in self.nan_steps:
            terms = terms * torch.tensor(float("nan"), dtype=torch.float64)
        trained = torch.ones(B, T, dtype=torch.bool)
        if i in self.stray_steps:
            trained = trained.clone()
            trained[1, 2] = False  # the term there is not 0: the module breaks the contract this step
        return terms, trained

    def credit_terms(self, batch=None):
        i = int(self.trainer.global_step)
        terms, trained = self._terms(i)
        seg = torch.tensor([[0, 0, 1], [0, 1, 1]]) if self.segments else None
        return CreditTerms(terms, trained, torch.arange(B), torch.zeros(B, dtype=torch.long), segment=seg)

    def training_step(self, batch, batch_idx):
        return self._terms(int(self.trainer.global_step))[0].sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(8)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Text(pl.Callback):
    """Listed after the audit: the text it made for the step, beside its scalars."""

    def __init__(self, audit):
        self.audit, self.rows = audit, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append(
            (self.audit._last_text[1], dict(self.audit.last_values), self.audit.last_refusal, self.audit.last_report)
        )


def _fit(module, steps, partition="by_segment"):
    audit = CreditAuditCallback(partition=partition, dtype="float64", log_table_every_n_steps=0)
    text = _Text(audit)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[audit, text],
    )
    trainer.fit(module)
    return audit, text.rows


def test_segment_partition_without_segments_is_one_error_at_the_first_step():
    audit = CreditAuditCallback(partition="by_segment", dtype="float64")
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[audit],
    )
    m = Module(segments=False)
    with pytest.raises(
        ValueError, match=r"`partition` must match what credit_terms returns, got partition='by_segment'"
    ) as e:
        trainer.fit(m)
    assert trainer.global_step == 0 and audit.n_refusals == 0
    assert str(e.value).count("partition='by_rollout'") == 1, str(e.value)  # the fix is said once


def test_non_finite_loss_is_a_refusal_with_its_reason():
    with pytest.warns(RuntimeWarning, match="non-finite|not finite"):
        audit, rows = _fit(Module(nan_steps={2}), steps=3)  # the last step: a NaN step also poisons the weights
    text, values, refusal, _ = rows[2]
    assert values["credit/refused"] == 1.0 and math.isnan(values["credit/cancellation"])
    assert isinstance(refusal, Refusal) and refusal.condition == "non_finite_loss"
    assert math.isnan(refusal.numbers["loss"]) and "REFUSED (non_finite_loss)" in text
    assert rows[0][1]["credit/refused"] == 0.0 and rows[1][1]["credit/refused"] == 0.0
    assert audit.last_epoch_values["credit/epoch/undefined_fraction"] == 1 / 3  # counted once


def test_stray_terms_are_refused_naming_the_field_count_and_place():
    with pytest.warns(RuntimeWarning, match="declined"):
        _, rows = _fit(Module(stray_steps={0}), steps=1)
    text, values, refusal, _ = rows[0]
    assert refusal.condition == "credit_terms.terms" and refusal.numbers["untrained_nonzero"] == 1
    assert "(1, 2)" in refusal.reason and values["credit/refused"] == 1.0


def test_text_and_scalars_agree_on_every_step():
    with pytest.warns(RuntimeWarning):
        _, rows = _fit(Module(zero_steps={1}, nan_steps={3}), steps=4)
    assert len(rows) == 4
    for text, values, refusal, report in rows:
        if values["credit/refused"] == 1.0:
            assert text.startswith("REFUSED") and refusal is not None
            continue

        def number(label):
            return float(re.search(rf"^{label} (\S+)", text, re.M).group(1))

        for label in ("conservation_error", "cancellation"):
            printed, logged = number(label), values[f"credit/{label}"]
            assert (math.isnan(printed) and math.isnan(logged)) or printed == pytest.approx(logged, rel=1e-3), (
                label,
                text,
            )
        if not report.ok:  # an undefined reading prints its reason instead of rows of NaN
            assert "UNDEFINED" in text and not any(re.search(rf"^{name}\s", text, re.M) for name in report.part_names)
            continue
        for name in report.part_names:
            printed = float(re.search(rf"^{name}\s+(\S+)", text, re.M).group(1))
            logged = values[f"credit/projected_share/{name}"]
            assert (math.isnan(printed) and math.isnan(logged)) or printed == pytest.approx(logged, abs=1e-6)
    zero = rows[1]
    assert not zero[3].ok and "conservation_error nan" in zero[0] and math.isnan(zero[1]["credit/conservation_error"])
