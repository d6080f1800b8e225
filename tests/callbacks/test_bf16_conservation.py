"""bf16 with plain SGD through Lightning: step conservation never reads violated on a correct loss, and does
on a wrong normaliser.

Under ``bf16-mixed`` the check holds float32 master-weight updates against the audit's parts computed under
bfloat16 autocast; their own rounding (the audit's ``conservation_error``) is part of the floor. Under
``bf16-true`` the weights themselves are bfloat16, whose rounding sets the floor (a large learning rate keeps
it well under 1, so a violation can be resolved). The reference for "correct" and "wrong" is the module's
own loss: ``terms.sum()``, or the same terms over half the normaliser (twice the loss).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_conservation_callback import LitPolicy, Recording, _fit  # noqa: E402  (tests/callbacks is on sys.path)

from lens_callbacks import ReadingWarning
from lens_callbacks.callbacks.credit_audit import CreditAuditCallback
from lens_callbacks.credit.readings.conservation import UNIT_ROUNDOFF, ConservationReading


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


class WrongNormaliser(LitPolicy):
    """Trains on the terms over half the trained count, while ``credit_terms`` divides by all of it."""

    def training_step(self, batch, batch_idx):
        return 2.0 * self.credit_terms(batch).terms.sum()


def _run(cls, precision, lr, audit_dtype="float32"):
    audit = CreditAuditCallback(log_figure=False, log_table_every_n_steps=0, dtype=audit_dtype)
    check = Recording(log_figure=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(cls(dtype=torch.float32, lr=lr), [audit, check], max_steps=4, precision=precision)
    ours = [str(w.message) for w in caught if issubclass(w.category, ReadingWarning)]
    return audit, check.seen, ours


CASES = [("bf16-mixed", 0.05, "float32"), ("bf16-true", 2.0, "float32"), ("bf16-true", 2.0, "native")]


@pytest.mark.parametrize("precision, lr, audit_dtype", CASES)
def test_bf16_sgd_correct_loss_never_reads_violated(precision, lr, audit_dtype):
    audit, seen, ours = _run(LitPolicy, precision, lr, audit_dtype)
    assert len(seen) == 4 and ours == [], ours
    for r in seen:
        assert isinstance(r, ConservationReading) and r.source == "credit_parts", r
        assert not r.violated and r.status in ("holds", "holds within precision"), r.render()
        if audit.last_report.dtype == "bfloat16" or precision == "bf16-mixed":
            # the parts were computed in bfloat16: their rounding, not more, joins the floor
            assert 0 < r.parts_floor <= 8 * UNIT_ROUNDOFF[torch.bfloat16] * 1.01
        assert r.update_precision_floor < 0.1  # the check still resolves a wrong factor


@pytest.mark.parametrize("precision, lr, audit_dtype", CASES)
def test_bf16_sgd_wrong_normaliser_reads_violated_and_says_so_once(precision, lr, audit_dtype):
    _, seen, ours = _run(WrongNormaliser, precision, lr, audit_dtype)
    assert all(isinstance(r, ConservationReading) and r.violated for r in seen), [r.render() for r in seen]
    for r in seen:
        assert r.scale == pytest.approx(2.0, abs=0.05)  # the applied update is twice the parts
    check_words = [w for w in ours if w.startswith("ConservationCheckCallback")]
    assert len(check_words) == 1 and "wrong normaliser" in check_words[0]
    assert len([w for w in ours if "terms are not the loss" in w]) == 1  # the audit's grad_match, once
