"""The gradient noise scale estimator (McCandlish et al. 2018, Appendix A).

References: (1) a synthetic problem with a known mean G and covariance Σ: over many draws the
estimates of tr(Σ) and |G|² average to the true values within 2 standard errors; (2) per draw, the
brute-force numpy value from the per-row vectors themselves (sample covariance with ddof=1); (3) on
the reference engine's own per-rollout gradients (keep_parts=True, float64).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lens_callbacks.credit import disintegrate
from lens_callbacks.credit.readings.noise import NoiseScale, NoiseScaleEMA, noise_from_report, noise_scale
from tests.credit.test_engine import TinyPolicy, make_batch


def _brute(x: np.ndarray) -> tuple[float, float]:
    """tr(Σ̂) with ddof=1 and |x̄|² − tr(Σ̂)/B from the rows x [B, d] themselves."""
    B = x.shape[0]
    tr = float(np.trace(np.atleast_2d(np.cov(x, rowvar=False, ddof=1))))
    return float(x.mean(0) @ x.mean(0)) - tr / B, tr


@pytest.mark.parametrize("B", [2, 8])
def test_unbiased_on_a_known_covariance(B):
    rng = np.random.default_rng(1234 + B)
    d = 6
    G = rng.normal(size=d) * 0.7
    A = rng.normal(size=(d, d)) * 0.5
    Sigma = A @ A.T + np.diag(rng.uniform(0.1, 0.5, size=d))
    true_tr, true_g2 = float(np.trace(Sigma)), float(G @ G)
    L = np.linalg.cholesky(Sigma)
    draws = 4000
    trs, g2s = np.empty(draws), np.empty(draws)
    for i in range(draws):
        x = G + rng.normal(size=(B, d)) @ L.T  # [B, d] per-example gradients
        g = x / B  # per-row parts of a mean loss; their sum is the batch gradient
        r = noise_scale(np.linalg.norm(g, axis=1).tolist(), float(np.linalg.norm(g.sum(0))))
        bg2, btr = _brute(x)
        assert r.grad_sq == pytest.approx(bg2, rel=1e-9, abs=1e-12)
        assert r.trace_sigma == pytest.approx(btr, rel=1e-9, abs=1e-12)
        trs[i], g2s[i] = r.trace_sigma, r.grad_sq
    for est, truth in ((trs, true_tr), (g2s, true_g2)):
        se = est.std(ddof=1) / math.sqrt(draws)
        assert abs(est.mean() - truth) < 2 * se, (est.mean(), truth, se)
    # The smoothed reading is a ratio of averages: it converges on the true B_simple.
    ema = NoiseScaleEMA(beta=0.999)
    for t, g2 in zip(trs, g2s):
        ema.update(NoiseScale(B, float(g2), float(t), float("nan")))
    pooled = trs.mean() / g2s.mean()
    assert ema.b_simple == pytest.approx(pooled, rel=0.1)
    assert pooled == pytest.approx(true_tr / true_g2, rel=0.15)


def test_scale_free_and_from_the_engine_parts():
    m = TinyPolicy()
    batch = make_batch(B=6, seed=2)
    r = disintegrate(m, batch, "by_rollout", dtype="float64", keep_parts=True)
    x = np.stack([np.concatenate([v.reshape(-1).numpy() for v in part]) for part in r.grads.parts])  # [B, |θ|]
    bg2, btr = _brute(x * x.shape[0])
    n = noise_from_report(r)
    assert n.grad_sq == pytest.approx(bg2, rel=1e-10)
    assert n.trace_sigma == pytest.approx(btr, rel=1e-10)
    assert n.b_simple == pytest.approx(btr / bg2, rel=1e-10)
    # Any common factor on the rows (a sum instead of a mean loss) leaves B_simple unchanged.
    scaled = noise_scale([3.0 * v for v in r.part_norm], 3.0 * r.full_grad_norm)
    assert scaled.b_simple == pytest.approx(n.b_simple, rel=1e-12)
    assert set(n.to_dict()) == {"credit/noise/grad_sq", "credit/noise/trace_sigma", "credit/noise/b_simple"}


def test_edges():
    with pytest.raises(ValueError, match="at least 2 rows"):
        noise_scale([1.0], 1.0)
    ema = NoiseScaleEMA(beta=0.5)
    assert math.isnan(ema.b_simple)
    ema.update(NoiseScale(2, float("nan"), 1.0, float("nan")))
    assert ema.n == 0
    ema.update(NoiseScale(2, 2.0, 4.0, 2.0))
    d = ema.to_dict()
    assert d["credit/noise/grad_sq_ema"] == 2.0 and d["credit/noise/trace_sigma_ema"] == 4.0  # bias-corrected
    ema.update(NoiseScale(2, -10.0, 4.0, -0.4))  # smoothed |G|² turns negative: no finite reading
    assert ema.grad_sq < 0 and math.isnan(ema.b_simple)
    d = ema.to_dict()
    other = NoiseScaleEMA()
    other.load_state_dict(ema.state_dict())
    assert (
        other.state_dict() == ema.state_dict()
        and other.to_dict()["credit/noise/grad_sq_ema"] == d["credit/noise/grad_sq_ema"]
    )
