"""The run ledger: its sums equal the per-step readings, and a restored ledger continues bit for bit."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from lens_callbacks.credit.readings.ledger import RunLedger


def _readings(n, seed=0):
    rnd = random.Random(seed)
    out = []
    for step in range(n):
        pos = rnd.uniform(-0.5, 1.5)
        zero = 0.0 if rnd.random() < 0.5 else rnd.uniform(-0.1, 0.1)
        out.append((step, {"positive": pos, "negative": 1.0 - pos - zero, "zero": zero}))
    return out


def test_sums_equal_the_per_step_readings():
    led = RunLedger()
    rs = _readings(50)
    for step, vals in rs:
        led.update("gradient", "by_advantage_sign", vals, step)
    led.update("gradient", "by_advantage_sign", {"positive": float("nan"), "negative": 1.0}, 50)  # skipped whole
    tot = led.totals("gradient", "by_advantage_sign")
    for name in ("positive", "negative", "zero"):
        assert tot[name] == pytest.approx(math.fsum(v[name] for _, v in rs), abs=1e-12)
    # Each step's shares sum to 1: the book's total counts the defined steps.
    assert math.fsum(tot.values()) == pytest.approx(50.0, abs=1e-12)
    hist = led.history("gradient", "by_advantage_sign")
    assert [s for s, _ in hist] == list(range(50)) and hist[-1][1] == tot
    assert led.to_dict()["credit/ledger/gradient/by_advantage_sign/zero"] == tot["zero"]
    assert "% of the run's credit" in led.render()


def test_any_book_and_a_resume_bitwise():
    rs = _readings(40, seed=3)
    full = RunLedger()
    for step, vals in rs:
        full.update("gradient", "by_source", vals, step)
        full.update("update", "by_source", {k: 2 * v for k, v in vals.items()}, step)
    first = RunLedger()
    for step, vals in rs[:17]:
        first.update("gradient", "by_source", vals, step)
        first.update("update", "by_source", {k: 2 * v for k, v in vals.items()}, step)
    resumed = RunLedger()
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))  # as a checkpoint stores it
    for step, vals in rs[17:]:
        resumed.update("gradient", "by_source", vals, step)
        resumed.update("update", "by_source", {k: 2 * v for k, v in vals.items()}, step)
    assert resumed.state_dict() == full.state_dict()  # float ==: bit for bit
    assert resumed.books() == [("gradient", "by_source"), ("update", "by_source")]


def test_figure_stacks_the_cumulative_values():
    pytest.importorskip("matplotlib")
    led = RunLedger()
    for step, vals in _readings(5):
        led.update("gradient", "by_advantage_sign", vals, step)
    fig = led.figure("gradient", "by_advantage_sign")
    assert fig is not None and fig.axes[0].get_title().startswith("run ledger")
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert RunLedger().figure("gradient", "none") is None
