"""Probe-credit readings aggregated over steps (functional form and a torchmetrics ``Metric``).

Per probe: how many readings were made and refused, and the means of ``predicted``, ``actual``,
``first_order_gap``, ``|first_order_gap|`` and ``alignment`` over the readings made. The states are sums
(``dist_reduce_fx="sum"``); the callback reads the global step on every rank, so it computes without a
cross-rank sync.
"""

from __future__ import annotations

import math
from typing import Iterable, Union

import torch
from torchmetrics import Metric

from ..credit.readings.probe import ProbeCreditReport
from ..refusal import Refusal

__all__ = ["ProbeCreditMetric", "probe_summary"]

Reading = Union[ProbeCreditReport, Refusal]
_SUMS = ("predicted", "actual", "first_order_gap", "abs_gap", "alignment")
_STATES = ("readings", "refused", "made", *(f"{k}_sum" for k in _SUMS))


def _probe_update(readings: Iterable[Reading]) -> dict[str, torch.Tensor]:
    acc = {k: [] for k in _STATES}
    counts = {"readings": 0.0, "refused": 0.0, "made": 0.0}
    for r in readings:
        counts["readings"] += 1
        if isinstance(r, Refusal):
            counts["refused"] += 1
            continue
        if not isinstance(r, ProbeCreditReport):
            raise TypeError(f"`readings` must hold ProbeCreditReport or Refusal, got {type(r).__name__}.")
        vals = (r.predicted, r.actual, r.first_order_gap, abs(r.first_order_gap), r.alignment)
        if not all(math.isfinite(v) for v in vals):
            continue  # an undefined reading (no actual yet, a zero gradient) enters no mean
        counts["made"] += 1
        for k, v in zip(_SUMS, vals):
            acc[f"{k}_sum"].append(v)
    out = {k: torch.tensor(v, dtype=torch.float64) for k, v in counts.items()}
    for k in _SUMS:
        out[f"{k}_sum"] = torch.tensor(math.fsum(acc[f"{k}_sum"]), dtype=torch.float64)
    return out


def _probe_compute(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    made = state["made"]
    out = {
        "readings": state["readings"],
        "refused_fraction": state["refused"] / state["readings"] if state["readings"] > 0 else nan,
    }
    for k in _SUMS:
        out[f"mean_{k}"] = state[f"{k}_sum"] / made if made > 0 else nan
    return out


def probe_summary(readings: Iterable[Reading]) -> dict[str, torch.Tensor]:
    """Aggregate probe-credit readings: ``readings``, ``refused_fraction``, ``mean_predicted``,
    ``mean_actual``, ``mean_first_order_gap``, ``mean_abs_gap``, ``mean_alignment`` (NaN without readings).

    Example:
        >>> r = ProbeCreditReport("p", ("a",), (-0.5,), 0.0, -0.5, 2.0, 0.3, 1.0, 1.0, "SGD", "float64", 1, loss_after=1.4)
        >>> round(float(probe_summary([r, Refusal("optimizer", "no")])["mean_first_order_gap"]), 12)
        -0.1
    """
    return _probe_compute(_probe_update(readings))


class ProbeCreditMetric(Metric):
    """:func:`probe_summary` as a ``Metric`` (one instance per probe); ``update`` takes one reading."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("sync_on_compute", False)
        super().__init__(**kwargs)
        for k in _STATES:
            self.add_state(k, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, reading: Reading) -> None:  # type: ignore[override]
        for k, v in _probe_update([reading]).items():
            setattr(self, k, getattr(self, k) + v.to(getattr(self, k).device))

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return _probe_compute({k: getattr(self, k) for k in _STATES})
