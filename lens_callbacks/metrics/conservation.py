"""Step-conservation readings aggregated over steps (functional form and a torchmetrics ``Metric``).

Both forms share one ``_conservation_update`` / ``_conservation_compute`` pair. The states are additive
(``dist_reduce_fx="sum"``) except the largest resolved error (``"max"``).

Only resolved readings (error above the precision floor) enter the error statistics: an error under the
floor is no evidence either way, and averaging it in would report rounding as a failure.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torchmetrics import Metric

from ..credit.readings.conservation import ConservationReading
from ..refusal import Refusal

__all__ = ["ConservationMetric", "conservation_summary"]

Reading = Union[ConservationReading, Refusal]
_STATES = ("readings", "refused", "limited", "violated", "resolved", "resolved_error_sum")


def _conservation_update(readings: Iterable[Reading]) -> dict[str, torch.Tensor]:
    """Per-batch sums of the states, plus the largest resolved error."""
    acc = {k: 0.0 for k in _STATES}
    max_err = 0.0
    for r in readings:
        acc["readings"] += 1
        if isinstance(r, Refusal):
            acc["refused"] += 1
            continue
        if not isinstance(r, ConservationReading):
            raise TypeError(f"`readings` must hold ConservationReading or Refusal, got {type(r).__name__}.")
        if r.update_precision_limited:
            acc["limited"] += 1
        else:
            acc["resolved"] += 1
            acc["resolved_error_sum"] += r.relative_error
            max_err = max(max_err, r.relative_error)
        if r.violated:
            acc["violated"] += 1
    out = {k: torch.tensor(v, dtype=torch.float64) for k, v in acc.items()}
    out["max_resolved_error"] = torch.tensor(max_err, dtype=torch.float64)
    return out


def _conservation_compute(
    readings: torch.Tensor,
    refused: torch.Tensor,
    limited: torch.Tensor,
    violated: torch.Tensor,
    resolved: torch.Tensor,
    resolved_error_sum: torch.Tensor,
    max_resolved_error: torch.Tensor,
) -> dict[str, torch.Tensor]:
    n = readings.clamp(min=1)
    made = (readings - refused).clamp(min=1)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return {
        "readings": readings,
        "refused_fraction": refused / n if readings > 0 else nan,
        "limited_fraction": limited / made if readings > refused else nan,
        "violations": violated,
        "mean_resolved_error": resolved_error_sum / resolved if resolved > 0 else nan,
        "max_resolved_error": max_resolved_error if resolved > 0 else nan,
    }


def conservation_summary(readings: Iterable[Reading]) -> dict[str, torch.Tensor]:
    """Aggregate step-conservation readings.

    Returns ``readings`` (count), ``refused_fraction``, ``limited_fraction`` (of the readings made),
    ``violations`` (count), ``mean_resolved_error`` and ``max_resolved_error`` (over readings above
    their floor; NaN when there are none).

    Example:
        >>> a = ConservationReading(2e-9, 1e-12, False, "float64", "grad", 1e-4)
        >>> b = ConservationReading(0.151, 7.9, True, "float32", "grad", 1e-4)
        >>> s = conservation_summary([a, b, Refusal("optimizer", "Adam")])
        >>> float(s["refused_fraction"]), float(s["limited_fraction"]), float(s["mean_resolved_error"])
        (0.3333333333333333, 0.5, 2e-09)
    """
    return _conservation_compute(**_conservation_update(readings))


class ConservationMetric(Metric):
    """Running aggregate of step-conservation readings (see :func:`conservation_summary`).

    Each rank reads the same replicated step under DDP, so a callback that feeds every rank the same
    readings constructs it with ``sync_on_compute=False``; fed disjoint readings, the sums reduce.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for k in _STATES:
            self.add_state(k, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("max_resolved_error", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, reading: Union[Reading, Iterable[Reading]]) -> None:  # type: ignore[override]
        batch = [reading] if isinstance(reading, (ConservationReading, Refusal)) else list(reading)
        upd = _conservation_update(batch)
        for k in _STATES:
            setattr(self, k, getattr(self, k) + upd[k].to(self.device))
        self.max_resolved_error = torch.maximum(self.max_resolved_error, upd["max_resolved_error"].to(self.device))

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return _conservation_compute(**{k: getattr(self, k) for k in (*_STATES, "max_resolved_error")})
