r"""torchmetrics forms of the anchor projection's run-level readings.

- ``weight_prediction_error``: ``sqrt(Σ_fires ||θ̂ − θ_true||²) / sqrt(Σ_fires ||θ_stale − θ_true||²)``, the
  pooled ratio of the projected anchor's error to the stale snapshot's (``< 1``: the projection helps).
- ``gated_on_fraction``: ``Σ on / Σ total`` parameter counts whose block's gate was ON, over fires.

Each has one ``_x_update``/``_x_compute`` pair shared by the function and the ``Metric``; the states are
additive and reduced across ranks with ``sum``.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from torchmetrics import Metric

__all__ = ["weight_prediction_error", "WeightPredictionError", "gated_on_fraction", "GatedOnFraction"]

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _as_list(x: Tensors) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _weight_prediction_error_update(pred: Tensors, true: Tensors, stale: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    err = torch.zeros((), dtype=torch.float64)
    base = torch.zeros((), dtype=torch.float64)
    for p, t, s in zip(_as_list(pred), _as_list(true), _as_list(stale), strict=True):
        t64 = t.detach().double().reshape(-1)  # [d]
        err += torch.sum((p.detach().double().reshape(-1).to(t64.device) - t64) ** 2).cpu()
        base += torch.sum((s.detach().double().reshape(-1).to(t64.device) - t64) ** 2).cpu()
    return err, base


def _weight_prediction_error_compute(err_sq: torch.Tensor, stale_sq: torch.Tensor) -> torch.Tensor:
    if float(stale_sq) <= 0.0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    return torch.sqrt(err_sq / stale_sq)


def weight_prediction_error(pred: Tensors, true: Tensors, stale: Tensors) -> torch.Tensor:
    r"""``||θ̂ − θ_true|| / ||θ_stale − θ_true||`` over a list of tensors (float64).

    Example:
        >>> float(weight_prediction_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0])))
        0.5
    """
    return _weight_prediction_error_compute(*_weight_prediction_error_update(pred, true, stale))


class WeightPredictionError(Metric):
    """Run-level pooled weight-prediction error ratio (see :func:`weight_prediction_error`)."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("err_sq", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("stale_sq", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred: Tensors, true: Tensors, stale: Tensors) -> None:
        e, s = _weight_prediction_error_update(pred, true, stale)
        self.err_sq += e.to(self.err_sq.device)
        self.stale_sq += s.to(self.stale_sq.device)

    def compute(self) -> torch.Tensor:
        return _weight_prediction_error_compute(self.err_sq, self.stale_sq)


def _gated_on_fraction_update(on_numel: float, total_numel: float) -> tuple[torch.Tensor, torch.Tensor]:
    if total_numel < 0 or on_numel < 0 or on_numel > total_numel:
        raise ValueError(f"`on_numel` must be in [0, total_numel = {total_numel}], got {on_numel!r}.")
    return torch.tensor(float(on_numel), dtype=torch.float64), torch.tensor(float(total_numel), dtype=torch.float64)


def _gated_on_fraction_compute(on: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return on / total if float(total) > 0 else torch.tensor(math.nan, dtype=torch.float64)


def gated_on_fraction(on_numel: float, total_numel: float) -> torch.Tensor:
    """Share of parameters whose block's gate is ON.

    Example:
        >>> float(gated_on_fraction(3, 12))
        0.25
    """
    return _gated_on_fraction_compute(*_gated_on_fraction_update(on_numel, total_numel))


class GatedOnFraction(Metric):
    """Run-level gated-ON fraction, weighted by parameter count, over projected fires."""

    full_state_update = False
    higher_is_better = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("on", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, on_numel: float, total_numel: float) -> None:
        o, t = _gated_on_fraction_update(on_numel, total_numel)
        self.on += o.to(self.on.device)
        self.total += t.to(self.total.device)

    def compute(self) -> torch.Tensor:
        return _gated_on_fraction_compute(self.on, self.total)
