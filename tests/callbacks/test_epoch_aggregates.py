"""Epoch readings of the audit and the conservation check: they add up, count each step once, and resume.

The module is a float64 linear policy whose step data is a function of the item index alone (so a run
resumed from a checkpoint sees the very batches the uninterrupted run saw); its segment ids change from
step to step, so the set of ``by_segment`` parts varies. References: per-segment gradients by a plain
``torch.autograd.grad`` loop, means over steps in Python.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lens_callbacks.callbacks import ConservationCheckCallback, CreditAuditCallback
from lens_callbacks.credit import CreditTerms
from lens_callbacks.examples.resumable import ResumableDataLoader

B, T, D = 2, 4, 3


def step_data(index: int):
    """Features ``[B, T, D]``, advantages ``[B]`` and segments ``[B, T]`` of item ``index``."""
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)  # [B, T, D]
    adv = torch.randn(B, generator=g, dtype=torch.float64)  # [B]
    seg = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])  # [B, T]
    if index % 2 == 1:
        seg[1, 3] = 6  # turn_6 only on odd items: the part set varies between steps
    return x, adv, seg


class SegmentModule(pl.LightningModule):
    """``terms[k, t] = −A_k · tanh(x_kt · w)``; ``refuse_items`` make ``credit_terms`` fail (a refused audit)."""

    def __init__(self, refuse_items=(), zero_items=(), lr=0.1):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64))
        self.refuse_items = set(refuse_items)
        self.zero_items = set(zero_items)
        self.lr = lr
        self.index = None

    def credit_terms(self, batch=None):
        i = int(self.index if batch is None else batch[0])
        if i in self.refuse_items:
            raise RuntimeError(f"no terms for item {i}")
        x, adv, seg = step_data(i)
        if i in self.zero_items:
            adv = torch.zeros_like(adv)
        terms = -adv[:, None] * torch.tanh(x @ self.w)  # [B, T]
        return CreditTerms(
            terms,
            torch.ones(B, T, dtype=torch.bool),
            torch.arange(B),
            torch.zeros(B, dtype=torch.long),
            segment=seg,
            segment_names=tuple(f"turn_{j}" for j in range(7)),
        )

    def training_step(self, batch, batch_idx):
        self.index = int(batch[0])
        x, adv, _ = step_data(self.index)
        if self.index in self.zero_items:
            adv = torch.zeros_like(adv)
        return (-adv[:, None] * torch.tanh(x @ self.w)).sum()

    def train_dataloader(self):
        return ResumableDataLoader(list(range(6)), batch_size=1, shuffle=True, data_seed=3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _trainer(callbacks, steps, **kw):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        log_every_n_steps=1,
        **kw,
    )


class _Shares(pl.Callback):
    """The naive reference: per-segment gradients of the live weights, before the optimizer step."""

    def __init__(self):
        self.rows = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        w = pl_module.w
        x, adv, seg = step_data(pl_module.index)
        with torch.enable_grad():
            terms = -adv[:, None] * torch.tanh(x @ w)
            g = torch.autograd.grad(terms.sum(), w, retain_graph=True)[0]
            shares = {
                f"turn_{s}": float(torch.autograd.grad(terms[seg == s].sum(), w, retain_graph=True)[0] @ g / (g @ g))
                for s in sorted(set(seg.flatten().tolist()))
            }
        self.rows.append(shares)


def test_epoch_shares_sum_to_one_when_the_part_set_varies():
    audit = CreditAuditCallback(partition="by_segment", dtype="float64", log_table_every_n_steps=0)
    ref = _Shares()
    _trainer([audit, ref], steps=6, enable_checkpointing=False).fit(SegmentModule())
    assert {len(r) for r in ref.rows} == {2, 3}  # turn_6 comes and goes
    want = {}
    for row in ref.rows:  # a part absent at a step counts as share 0 that step
        for name, v in row.items():
            want[name] = want.get(name, 0.0) + v / len(ref.rows)
    got = audit.last_epoch_shares
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], abs=1e-12)
        assert audit.last_epoch_values[f"credit/epoch/projected_share/{name}"] == got[name]
    assert math.fsum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert audit.last_epoch_values["credit/epoch/share_sum"] == pytest.approx(1.0, abs=1e-12)
    # The same step-0 name means the same part: turn_6 is averaged over all six steps, not the three it had.
    assert got["turn_6"] == pytest.approx(math.fsum(r.get("turn_6", 0.0) for r in ref.rows) / 6, abs=1e-12)


def test_undefined_fraction_counts_each_refused_step_once():
    refused = {0, 1, 2}  # each epoch of 6 steps: 3 refused audits, 1 zero-gradient step, 2 defined
    audit = CreditAuditCallback(partition="by_segment", dtype="float64", log_table_every_n_steps=0)
    with pytest.warns(RuntimeWarning, match="declined"):
        _trainer([audit], steps=12, enable_checkpointing=False).fit(SegmentModule(refuse_items=refused, zero_items={3}))
    assert audit.n_refusals == 6 and audit.n_audits == 12
    # Second epoch alone (the metric resets at each epoch end): 4 of 6 steps have no defined shares.
    assert audit.last_epoch_values["credit/epoch/undefined_fraction"] == 4 / 6
    assert audit.last_epoch_values["credit/epoch/share_sum"] == pytest.approx(1.0, abs=1e-12)


def test_undefined_fraction_is_exact_nine_of_twelve():
    audit = CreditAuditCallback(partition="by_segment", dtype="float64", log_table_every_n_steps=0)

    class Twelve(SegmentModule):
        def train_dataloader(self):
            return ResumableDataLoader(list(range(12)), batch_size=1, shuffle=False)

    with pytest.warns(RuntimeWarning, match="declined"):
        _trainer([audit], steps=12, enable_checkpointing=False).fit(Twelve(refuse_items=set(range(9))))
    assert audit.last_epoch_values["credit/epoch/undefined_fraction"] == 0.75


def test_resume_mid_epoch_gives_the_uninterrupted_epoch_readings(tmp_path):
    def callbacks():
        return [
            CreditAuditCallback(partition="by_segment", dtype="float64", log_table_every_n_steps=0),
            ConservationCheckCallback(tolerance=1e-8),
        ]

    full = callbacks()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=False)
    pl.seed_everything(0, verbose=False)
    m_full = SegmentModule()
    _trainer(full + [ckpt], steps=6).fit(m_full)
    mid = tmp_path / "epoch=0-step=2.ckpt"
    assert mid.exists(), sorted(p.name for p in tmp_path.iterdir())

    resumed = callbacks()
    pl.seed_everything(0, verbose=False)
    m_res = SegmentModule()
    _trainer(resumed, steps=6, enable_checkpointing=False).fit(m_res, ckpt_path=str(mid))
    assert torch.equal(m_full.w, m_res.w)
    for a, b in zip(full, resumed):
        assert a.last_epoch_values and a.last_epoch_values == b.last_epoch_values
    assert full[1].last_epoch_values["conservation/epoch/readings"] == 6.0  # not restarted at the resume
    assert full[0].last_epoch_values["credit/epoch/undefined_fraction"] == 0.0


class _Epochs(pl.Callback):
    """Listed last: the epoch readings of every lens callback, keyed by the step they were logged at."""

    def __init__(self, cbs):
        self.cbs, self.rows = cbs, {}

    def _take(self, trainer):
        for cb in self.cbs:
            if cb.last_epoch_step is not None:
                self.rows[(type(cb).__name__, cb.last_epoch_step)] = dict(cb.last_epoch_values)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._take(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._take(trainer)


def test_resume_from_the_last_batch_of_an_epoch_closes_that_epoch_once(tmp_path):
    """Lightning skips the end of an epoch whose last batch was checkpointed: the readings still come, once."""

    def callbacks():
        cbs = [
            CreditAuditCallback(partition="by_segment", dtype="float64", log_table_every_n_steps=0),
            ConservationCheckCallback(tolerance=1e-8),
        ]
        return cbs + [_Epochs(cbs)]

    full = callbacks()
    _trainer(full + [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)], steps=9).fit(
        SegmentModule()
    )
    resumed = callbacks()
    _trainer(resumed, steps=9, enable_checkpointing=False).fit(
        SegmentModule(), ckpt_path=str(tmp_path / "epoch=0-step=6.ckpt")
    )
    assert (
        sorted(full[2].rows)
        == sorted(resumed[2].rows)
        == [
            ("ConservationCheckCallback", 5),
            ("ConservationCheckCallback", 8),
            ("CreditAuditCallback", 5),
            ("CreditAuditCallback", 8),
        ]
    )
    assert full[2].rows == resumed[2].rows
    assert resumed[2].rows[("ConservationCheckCallback", 8)]["conservation/epoch/readings"] == 3.0
