"""CreditMetric and credit_readings against plain numpy means over the readings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.metrics.credit import CreditMetric, _credit_compute, _credit_update, credit_readings

finite = st.floats(-3, 3, allow_nan=False, width=32)


@st.composite
def readings(draw):
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        m = draw(st.integers(1, 5))
        ps = draw(st.lists(finite, min_size=m, max_size=m))
        ns = draw(st.lists(st.floats(0, 1, width=32), min_size=m, max_size=m))
        canc = draw(st.floats(1, 5, width=32))
        cons = draw(st.floats(0, 0.0009765625, width=32))
        gm = draw(st.one_of(st.none(), st.floats(0, 0.0009765625, width=32)))
        defined = draw(st.booleans()) or len(out) == 0
        out.append((ps, ns, canc, cons, gm, 1.0 + canc, defined))
    return out


@settings(max_examples=30, deadline=None)
@given(readings(), st.integers(0, 4))
def test_metric_is_the_mean_of_the_defined_readings(rs, max_parts):
    metric = CreditMetric(max_parts=max_parts)
    for ps, ns, canc, cons, gm, fgn, defined in rs:
        metric.update(ps, ns, canc, cons, gm, fgn, defined)
    got = metric.compute()
    ok = [r for r in rs if r[6]]
    assert float(got["undefined_fraction"]) == pytest.approx(1 - len(ok) / len(rs), abs=1e-12)
    assert float(got["cancellation"]) == pytest.approx(np.mean([r[2] for r in ok]), rel=1e-12)
    assert float(got["cancelled_fraction"]) == pytest.approx(np.mean([1 - 1 / r[2] for r in ok]), rel=1e-12)
    assert float(got["conservation_error"]) == pytest.approx(np.mean([r[3] for r in ok]), rel=1e-12, abs=1e-300)
    assert float(got["conservation_error_max"]) == pytest.approx(max(r[3] for r in ok), rel=0, abs=0)
    assert float(got["share_sum"]) == pytest.approx(np.mean([math.fsum(r[0]) for r in ok]), rel=1e-9, abs=1e-12)
    gms = [r[4] for r in ok if r[4] is not None]
    if gms:
        assert float(got["grad_match"]) == pytest.approx(np.mean(gms), rel=1e-12, abs=1e-300)
    else:
        assert math.isnan(float(got["grad_match"]))
    shares = got["projected_share"].reshape(-1)  # torchmetrics squeezes a one-element vector
    for i in range(max_parts):
        vals = [r[0][i] for r in ok if len(r[0]) > i]
        if vals:
            assert float(shares[i]) == pytest.approx(np.mean(vals), rel=1e-9, abs=1e-12)
        else:
            assert math.isnan(float(shares[i]))


@settings(max_examples=20, deadline=None)
@given(readings())
def test_functional_form_equals_a_fresh_metric_and_forward_returns_the_step(rs):
    metric = CreditMetric(max_parts=5)
    for ps, ns, canc, cons, gm, fgn, defined in rs:
        step = metric(ps, ns, canc, cons, gm, fgn, defined)  # forward: this reading alone
        want = credit_readings(ps, ns, canc, cons, gm, fgn, max_parts=5, defined=defined)
        for k in want:
            torch.testing.assert_close(step[k].reshape(-1), want[k].reshape(-1), equal_nan=True)


def test_undefined_reading_adds_nothing_to_the_sums():
    inc = _credit_update([float("nan")], [float("nan")], float("nan"), float("nan"), max_parts=2)
    assert (
        float(inc["n_undefined"]) == 1 and float(inc["cancellation_sum"]) == 0 and float(inc["parts_seen"].sum()) == 0
    )
    out = _credit_compute(inc)
    assert math.isnan(float(out["cancellation"])) and float(out["undefined_fraction"]) == 1.0


def test_a_projected_only_reading_is_defined_and_its_cancellation_left_out():
    # the forward-mode engine reads projected shares only: cancellation and norm shares are NaN by design
    nan = float("nan")
    m = CreditMetric(max_parts=2)
    m.update([0.7, 0.3], [nan, nan], nan, 2e-8, full_grad_norm=3.0)
    m.update([0.25, 0.75], [0.4, 0.6], 1.5, 4e-8, full_grad_norm=5.0)
    out = m.compute()
    assert float(out["undefined_fraction"]) == 0.0
    assert float(out["share_sum"]) == pytest.approx(1.0, abs=1e-15)
    assert out["projected_share"].tolist() == pytest.approx([np.mean([0.7, 0.25]), np.mean([0.3, 0.75])], abs=1e-15)
    assert float(out["conservation_error"]) == pytest.approx(3e-8, rel=1e-12)
    assert float(out["conservation_error_max"]) == 4e-8
    assert float(out["full_grad_norm"]) == 4.0
    # the cancellation over the one reading that read it
    assert float(out["cancellation"]) == 1.5 and float(out["cancelled_fraction"]) == pytest.approx(1 - 1 / 1.5)
    one = credit_readings([0.7, 0.3], [nan, nan], cancellation=nan, conservation_error=2e-8)
    assert float(one["share_sum"]) == pytest.approx(1.0) and math.isnan(float(one["cancellation"]))


def test_update_report_and_reset():
    from lens_callbacks.credit.report import CreditReport

    r = CreditReport(("a", "b"), (0.75, 0.25), (0.6, 0.4), (3.0, 2.0), 1.25, 1e-7, 2e-7, "float32", 4, 4.0, 1.5)
    metric = CreditMetric(max_parts=2)
    metric.update_report(r)
    metric.update_report(None)  # a refused reading
    out = metric.compute()
    assert out["projected_share"].tolist() == [0.75, 0.25] and float(out["undefined_fraction"]) == 0.5
    assert float(out["full_grad_norm"]) == 4.0 and float(out["grad_match"]) == 2e-7
    metric.reset()
    assert float(metric.n_readings) == 0


def test_states_are_additive_sums_for_ranks():
    metric = CreditMetric(max_parts=3)
    red = metric._reductions
    assert all(red[n].__name__ == "dim_zero_sum" for n in metric._defaults if n != "conservation_error_max")
    assert red["conservation_error_max"].__name__ == "dim_zero_max"


def test_bad_max_parts():
    with pytest.raises(ValueError, match="`max_parts`.*-1"):
        CreditMetric(max_parts=-1)


def test_doctests():
    import doctest

    import lens_callbacks.metrics.credit as mod

    res = doctest.testmod(mod)
    assert res.attempted >= 5 and res.failed == 0
