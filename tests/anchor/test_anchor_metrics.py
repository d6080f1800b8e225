"""torchmetrics forms of the run-level anchor readings against numpy."""

import numpy as np
import pytest
import torch

from lens_callbacks.metrics.anchor import (
    GatedOnFraction,
    WeightPredictionError,
    gated_on_fraction,
    weight_prediction_error,
)


def test_weight_prediction_error_pools_over_fires_like_numpy():
    g = torch.Generator().manual_seed(0)
    fires = [[torch.randn(5, 3, generator=g) for _ in range(3)] for _ in range(4)]  # (pred, true, stale) per fire
    m = WeightPredictionError()
    num = den = 0.0
    for pred, true, stale in fires:
        m.update([pred], [true], [stale])
        num += np.sum((pred.double().numpy() - true.double().numpy()) ** 2)
        den += np.sum((stale.double().numpy() - true.double().numpy()) ** 2)
    assert float(m.compute()) == pytest.approx(np.sqrt(num / den), rel=1e-12)
    p, t, s = fires[0]
    want = np.linalg.norm(p.numpy() - t.numpy()) / np.linalg.norm(s.numpy() - t.numpy())
    assert float(weight_prediction_error(p, t, s)) == pytest.approx(want, rel=1e-6)
    assert torch.isnan(weight_prediction_error(p, t, t))  # a stale snapshot equal to the truth: undefined


def test_gated_on_fraction_is_count_weighted():
    m = GatedOnFraction()
    for on, tot in [(3, 10), (0, 10), (10, 10)]:
        m.update(on, tot)
    assert float(m.compute()) == pytest.approx(13 / 30)
    assert float(gated_on_fraction(1, 4)) == 0.25
    with pytest.raises(ValueError, match="on_numel"):
        gated_on_fraction(5, 4)
