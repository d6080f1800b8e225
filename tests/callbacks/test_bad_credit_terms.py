"""The recommended loss, ``loss = self.credit_terms(batch).terms.sum()``, with each kind of bad ``credit_terms``.

Training runs to its last step whatever the terms hold; the audit names what is wrong once (a
refusal with its field, or the words of a mismatch), not once per step, and the end of fit summarises
the refusals with their counts. The reference for "what is wrong" is the construction of each bad module.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lens_callbacks import ReadingWarning
from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.callbacks.conservation import ConservationCheckCallback
from lens_callbacks.credit import CreditTerms

VOCAB, D, T, B, STEPS = 7, 6, 5, 4, 5


class Policy(LightningModule):
    """A tiny GRPO policy whose ``credit_terms`` is broken in one way (``flaw``); the loss is built as documented."""

    def __init__(self, flaw: str | None = None, loss_factor: float = 1.0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.out = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.double()
        self.flaw, self.loss_factor = flaw, loss_factor

    def credit_terms(self, batch) -> CreditTerms:
        tokens, mask, adv = batch  # [B, T+1], [B, T], [B]
        lp = torch.log_softmax(self.out(torch.tanh(self.emb(tokens[:, :-1]))), -1)  # [B, T, V]
        logp = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T]
        m = mask.to(logp.dtype)
        terms = -adv[:, None] * logp * m / m.sum()  # [B, T]
        trained = mask
        if self.flaw == "stray":  # an entropy bonus left unmasked: non-zero at untrained positions
            terms = terms + 1e-3 * (lp.exp() * lp).sum(-1)
        elif self.flaw == "short_mask":  # the mask shifted one column too far
            trained = mask[:, 1:]
        elif self.flaw == "nan":  # a log of 0, times 0: NaN at every position
            terms = terms + torch.log(torch.zeros_like(terms)) * 0 * m
        return CreditTerms(terms, trained, torch.arange(B), torch.arange(B) // 2)

    def training_step(self, batch, batch_idx):
        loss = self.credit_terms(batch).terms.sum()  # what docs/credit_audit.md recommends
        return self.loss_factor * loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(STEPS):
            tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
            mask = torch.rand(B, T, generator=g) > 0.3
            mask[:, 0] = True
            batches.append((tokens, mask, torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)))
        return torch.utils.data.DataLoader(batches, batch_size=None)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _fit(module, check=False):
    audit = CreditAuditCallback(dtype="float64", log_table_every_n_steps=0, log_figure=False)
    callbacks = [audit] + ([ConservationCheckCallback(log_figure=False)] if check else [])
    trainer = Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    ours = [w for w in caught if issubclass(w.category, ReadingWarning)]
    return trainer, callbacks, ours


@pytest.mark.parametrize(
    "flaw, condition, words",
    [
        ("stray", "credit_terms.terms", "`terms` must be exactly 0 at untrained positions"),
        (
            "short_mask",
            "credit_terms.trained",
            f"`trained` must have the shape of `terms` [B, T] = [{B}, {T}], got [{B}, {T - 1}]",
        ),
        ("nan", "non_finite_loss", "the loss of this step is not finite"),
    ],
)
def test_a_bad_credit_terms_trains_to_the_end_with_one_named_refusal(flaw, condition, words, caplog):
    with caplog.at_level(logging.WARNING, logger="lens_callbacks"):
        trainer, (audit,), ours = _fit(Policy(flaw))
    assert trainer.global_step == STEPS  # training was not ended by the terms
    assert audit.n_audits == STEPS and audit.n_refusals == STEPS
    assert audit.last_refusal.condition == condition and words in audit.last_refusal.reason
    # Said once, naming the cause, with the remedy; not once per step.
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    assert "credit audit at step 0 declined" in msg and f"REFUSED ({condition})" in msg and words in msg
    assert "not repeated" in msg
    assert "lightning" not in ours[0].filename  # it points at the callback that decided, not at Lightning's dispatcher
    # The end of fit counts them, per reason.
    summary = [r.getMessage() for r in caplog.records if "declined over" in r.getMessage()]
    assert len(summary) == 1 and f"{STEPS} reading(s) declined over {STEPS} audited steps" in summary[0]
    assert f"{condition}: {STEPS} (steps 0..{STEPS - 1})" in summary[0]


def test_terms_that_are_not_the_loss_are_said_once_in_words_by_the_audit_and_the_check():
    trainer, (audit, check), ours = _fit(Policy(loss_factor=2.0), check=True)
    assert trainer.global_step == STEPS and audit.n_refusals == 0
    # grad_match = ||g − 2g|| / ||g|| = 1: the reference is the factor the module applies.
    assert audit.last_report.grad_match == pytest.approx(1.0, abs=1e-9)
    assert check.last_reading.violated and check.last_reading.scale == pytest.approx(2.0, abs=1e-6)
    texts = [str(w.message) for w in ours]
    assert len(texts) == 2, texts  # one from each instrument, over five steps
    audit_words = next(t for t in texts if t.startswith("CreditAuditCallback"))
    for part in (
        "the audited terms are not the loss at step 0",
        "grad_match",
        "= 1",
        "Likely cause",
        "2·terms.sum()",
        "Fix: build the loss as `loss = self.credit_terms(batch).terms.sum()`",
    ):
        assert part in audit_words, (part, audit_words)
    check_words = next(t for t in texts if t.startswith("ConservationCheckCallback"))
    for part in (
        "step conservation violated at step 0",
        "relative error of 1",
        "2 × Σ g_S",
        "wrong normaliser",
        "Fix:",
    ):
        assert part in check_words, (part, check_words)


def test_a_healthy_module_warns_nothing():
    trainer, (audit, check), ours = _fit(Policy(), check=True)
    assert trainer.global_step == STEPS and ours == []
    assert audit.last_report.grad_match <= 1e-12 and check.last_reading.status == "holds"
