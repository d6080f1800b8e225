"""The anchor's merger listed before, between or after the audit and the conservation check.

Whatever the order: the same readings step for step, the audit's ``grad_match`` at rounding against the
gradient the module produced (reference: ``torch.autograd.grad`` of the module's own loss at the live
weights, taken in a callback listed before every merger), ``credit/applied_grad_differs`` = 1 exactly on
the steps the anchor merged, and the conservation check refusing those steps by name, never a violation.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")

from lens_callbacks.callbacks import AnchorProjectionCallback, ConservationCheckCallback, CreditAuditCallback
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule
from lens_callbacks.refusal import Refusal

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3, optimizer="sgd", lr=0.5, dtype="float64")
STEPS = 4


class _Own(pl.Callback):
    """Listed first: the module's own gradient of this step, before any merger touches .grad."""

    def __init__(self):
        self.grads = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads[trainer.global_step] = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


class _Record(pl.Callback):
    """Listed last: every reading of the step, after every other callback's hooks ran."""

    def __init__(self, audit, check, anchor):
        self.audit, self.check, self.anchor, self.rows = audit, check, anchor, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        r = self.audit.last_report
        self.rows.append(
            {
                "step": trainer.global_step - 1,
                "values": dict(self.audit.last_values),
                "grad_match": None if r is None else r.grad_match,
                "check": self.check.last_reading,
                "merged": self.anchor.merged_at(trainer.global_step - 1),
                "applied": {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()},
            }
        )


def _run(order):
    audit = CreditAuditCallback(dtype="float64", log_table_every_n_steps=0)
    check = ConservationCheckCallback(tolerance=1e-8)
    anchor = AnchorProjectionCallback(mode="signed_ema", cadence=1, delay_K=1, log_readings=False)
    own = _Own()
    by_name = {"audit": audit, "check": check, "anchor": anchor}
    rec = _Record(audit, check, anchor)
    pl.seed_everything(0, verbose=False)
    m = GRPOModule(**SMALL)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[own] + [by_name[k] for k in order] + [rec],
    )
    trainer.fit(m, AdditionDataModule(batch_size=2, data_seed=0))
    return m, own, rec


def _same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@pytest.mark.parametrize("order", [("anchor", "audit", "check"), ("audit", "anchor", "check")])
def test_readings_do_not_depend_on_the_anchor_s_place(order):
    m0, own0, base = _run(("audit", "check", "anchor"))
    m1, own1, other = _run(order)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    assert len(base.rows) == len(other.rows) == STEPS
    merged = [r["step"] for r in base.rows if r["merged"]]
    assert merged == list(range(1, STEPS))  # the anchor fires from step 1 (delay 1) and merges every step after
    for ra, rb in zip(base.rows, other.rows):
        assert ra["values"].keys() == rb["values"].keys()
        assert all(_same(ra["values"][k], rb["values"][k]) for k in ra["values"]), (ra, rb)
        assert ra["values"]["credit/applied_grad_differs"] == (1.0 if ra["step"] in merged else 0.0)
        ca, cb = ra["check"], rb["check"]
        assert type(ca) is type(cb)
        if ra["step"] in merged:
            assert isinstance(ca, Refusal) and ca.condition == "merged_by"
            assert "merged_by=AnchorProjectionCallback" in ca.reason and ca == cb
        else:
            assert not isinstance(ca, Refusal) and not ca.violated
            assert ca.relative_error == cb.relative_error
    for rows, own, m in ((base.rows, own0, m0), (other.rows, own1, m1)):
        for r in rows:
            if r["grad_match"] is None or math.isnan(r["grad_match"]):
                continue
            assert r["grad_match"] < 1e-12  # against the module's gradient, not the merged one


def test_the_merger_really_changes_the_applied_gradient():
    """Guards the test above: on merged steps the applied .grad is not the module's own gradient."""
    m, own, rec = _run(("anchor", "audit", "check"))
    for r in rec.rows:
        mine = own.grads[r["step"]]
        same = all(torch.equal(mine[n], r["applied"][n]) for n in mine)
        assert same == (not r["merged"])
    # The anchor's pre-merge copy of the last step is the module's gradient, bit for bit.
    last = rec.rows[-1]["step"]
    m_anchor = [cb for cb in m.trainer.callbacks if isinstance(cb, AnchorProjectionCallback)][0]
    assert all(torch.equal(m_anchor.pre_merge_grads[n], own.grads[last][n]) for n in m_anchor.pre_merge_grads)
    first = rec.rows[0]["check"]
    assert not isinstance(first, Refusal) and first.relative_error < 1e-8
