"""Concentration summaries against values worked out by hand, and their invariance to part order.

References: the hand-computed numbers below (fractions written out), and a pairwise double loop for
the Gini coefficient and a trapezoid area for the Lorenz curve.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.credit.readings.summaries import concentration, lorenz_curve


def test_fixed_shares_by_hand():
    # shares 0.6, 0.3, 0.2, -0.1 (sum 1); norms 4, 2, 1, 1
    c = concentration([0.6, 0.3, 0.2, -0.1], [4.0, 2.0, 1.0, 1.0], k=2)
    assert c.effective_parts_norm == pytest.approx(64 / 22, abs=1e-15)  # (8)² / (16 + 4 + 1 + 1)
    assert c.effective_parts_positive == pytest.approx(1.21 / 0.49, abs=1e-14)  # (1.1)² / (0.36 + 0.09 + 0.04)
    assert c.top1_share == 0.6
    assert c.topk_share == pytest.approx(0.9, abs=1e-15)
    assert c.negative_fraction == 0.25
    assert c.negative_mass == pytest.approx(0.1, abs=1e-15)
    # Gini: Σ_ij |n_i − n_j| over ordered pairs = 2·(2+3+3+1+1+0) = 20; / (2·4·8) = 20/64
    assert c.gini_norm == pytest.approx(20 / 64, abs=1e-15)
    assert c.lorenz == pytest.approx((0.0, 1 / 8, 2 / 8, 4 / 8, 1.0), abs=1e-15)
    d = c.to_dict("credit/concentration/")
    assert d["credit/concentration/top1_share"] == 0.6
    assert "top-2 share" in c.render()


def test_extremes():
    one = concentration([1.0, 0.0, 0.0], [5.0, 0.0, 0.0])
    assert one.effective_parts_norm == 1.0 and one.effective_parts_positive == 1.0
    assert one.gini_norm == pytest.approx(2 / 3, abs=1e-15)  # 1 − 1/m
    even = concentration([0.25] * 4, [1.0] * 4)
    assert even.effective_parts_norm == 4.0 and even.effective_parts_positive == 4.0 and even.gini_norm == 0.0
    assert even.topk_share == pytest.approx(0.75, abs=1e-15)  # k = 3 by default


def test_undefined_and_derived_readings():
    nan = concentration([float("nan"), float("nan")], [1.0, 1.0])
    assert all(math.isnan(v) for v in nan.to_dict().values())
    no_norms = concentration([0.7, 0.3], None)
    assert math.isnan(no_norms.effective_parts_norm) and math.isnan(no_norms.gini_norm)
    assert no_norms.top1_share == 0.7
    with pytest.raises(ValueError, match="`k` must be an int >= 1"):
        concentration([1.0], [1.0], k=0)
    with pytest.raises(ValueError, match="one norm per share"):
        concentration([0.5, 0.5], [1.0])


def _gini_pairs(v):
    return sum(abs(a - b) for a in v for b in v) / (2 * len(v) * sum(v))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-2, 2), st.floats(0.01, 10)), min_size=1, max_size=7), st.randoms())
def test_invariant_to_part_order_and_matches_pairwise_gini(rows, rnd):
    shares, norms = [r[0] for r in rows], [r[1] for r in rows]
    base = concentration(shares, norms).to_dict()
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    moved = concentration([shares[i] for i in perm], [norms[i] for i in perm]).to_dict()
    for key in base:
        assert moved[key] == pytest.approx(base[key], rel=1e-12, abs=1e-12), key
    c = concentration(shares, norms)
    assert c.gini_norm == pytest.approx(_gini_pairs(norms), rel=1e-12, abs=1e-12)
    # Area between the diagonal and the Lorenz curve is Gini/2 (trapezoids on m equal steps).
    L = lorenz_curve(norms)
    m = len(norms)
    area = sum((L[j] + L[j + 1]) / (2 * m) for j in range(m))
    assert 0.5 - area == pytest.approx(c.gini_norm / 2, abs=1e-12)


def test_permutations_exhaustive_small():
    shares, norms = [0.5, -0.2, 0.4, 0.3], [3.0, 1.0, 2.0, 0.5]
    ref = concentration(shares, norms).to_dict()
    for p in itertools.permutations(range(4)):
        got = concentration([shares[i] for i in p], [norms[i] for i in p]).to_dict()
        assert got == pytest.approx(ref, rel=1e-13, abs=1e-15)
