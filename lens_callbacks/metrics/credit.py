r"""Credit readings as a torchmetrics ``Metric`` and a functional form sharing one update/compute pair.

One reading is one :class:`~lens_callbacks.credit.CreditReport`'s numbers. The states are additive
sums over readings (and over ranks, ``dist_reduce_fx="sum"``), so ``compute`` gives the mean reading:

.. math::

    \overline{x} = \frac{\sum_{\text{defined readings}} x}{n_\text{defined}}, \qquad
    \text{undefined\_fraction} = \frac{n_\text{undefined}}{n_\text{readings}}.

A reading whose shares are undefined (``g_full`` zero or not finite, or a refused audit) counts in
``n_undefined`` and adds nothing to the sums, so one NaN step does not poison the epoch's mean. The
cancellation is averaged over the readings that read it (a projected-only reading has none).
Per-part shares are kept for the first ``max_parts`` parts (part ``i`` of every reading is averaged
with part ``i`` of the others: stable when the partition's part names are stable, e.g. ``by_rollout``
with a fixed batch size); ``share_sum`` always runs over all parts.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torchmetrics import Metric

__all__ = ["CreditMetric", "credit_readings", "_credit_update", "_credit_compute"]

_Vec = Union[Sequence[float], torch.Tensor]
_SUM_STATES = (
    "n_readings",
    "n_undefined",
    "cancellation_sum",
    "cancelled_fraction_sum",
    "n_cancellation",
    "conservation_error_sum",
    "full_grad_norm_sum",
    "share_sum_sum",
    "grad_match_sum",
    "n_grad_match",
)


def _credit_update(
    projected_share: _Vec,
    norm_share: _Vec,
    cancellation: float,
    conservation_error: float,
    grad_match: Optional[float] = None,
    full_grad_norm: float = float("nan"),
    max_parts: int = 16,
    defined: bool = True,
    dtype: torch.dtype = torch.float64,
    device: Optional[torch.device] = None,
) -> dict[str, torch.Tensor]:
    """State increments of one reading (every value additive except ``conservation_error_max``)."""
    ps = torch.as_tensor(projected_share, dtype=dtype, device=device).reshape(-1)  # [m]
    ns = torch.as_tensor(norm_share, dtype=dtype, device=device).reshape(-1)  # [m]
    # a reading is defined by its projected shares; the cancellation is read only with the parts' norms (NaN for
    # projected-only readings, e.g. the forward-mode engine's) and is averaged over the readings that have it
    ok = bool(defined) and bool(torch.isfinite(ps).all())
    z = torch.zeros((), dtype=dtype, device=device)
    k = min(max_parts, int(ps.numel()))
    share = torch.zeros(max_parts, dtype=dtype, device=device)  # [max_parts]
    nshare = torch.zeros(max_parts, dtype=dtype, device=device)  # [max_parts]
    seen = torch.zeros(max_parts, dtype=dtype, device=device)  # [max_parts]
    out = {name: z.clone() for name in _SUM_STATES}
    out["n_readings"] = z + 1
    out["conservation_error_max"] = z.clone()
    if not ok:
        out["n_undefined"] = z + 1
    else:
        share[:k] = ps[:k]
        nshare[:k] = ns[:k]
        seen[:k] = 1
        if math.isfinite(cancellation):
            out["cancellation_sum"] = z + cancellation
            out["cancelled_fraction_sum"] = z + (1.0 - 1.0 / cancellation)
            out["n_cancellation"] = z + 1
        out["conservation_error_sum"] = z + conservation_error
        out["conservation_error_max"] = z + conservation_error
        out["full_grad_norm_sum"] = z + full_grad_norm
        out["share_sum_sum"] = ps.sum()
        if grad_match is not None and math.isfinite(grad_match):
            out["grad_match_sum"] = z + grad_match
            out["n_grad_match"] = z + 1
    out["projected_share_sum"] = share
    out["norm_share_sum"] = nshare
    out["parts_seen"] = seen
    return out


def _credit_compute(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Means over the defined readings; NaN where nothing was defined."""
    n = state["n_readings"]
    nd = n - state["n_undefined"]
    nan = torch.full_like(n, float("nan"))

    def mean(s: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return torch.where(count > 0, s / count.clamp(min=1), nan)

    seen = state["parts_seen"]  # [max_parts]
    return {
        "cancellation": mean(state["cancellation_sum"], state["n_cancellation"]),
        "cancelled_fraction": mean(state["cancelled_fraction_sum"], state["n_cancellation"]),
        "conservation_error": mean(state["conservation_error_sum"], nd),
        "conservation_error_max": torch.where(nd > 0, state["conservation_error_max"], nan),
        "full_grad_norm": mean(state["full_grad_norm_sum"], nd),
        "share_sum": mean(state["share_sum_sum"], nd),
        "grad_match": mean(state["grad_match_sum"], state["n_grad_match"]),
        "undefined_fraction": mean(state["n_undefined"], n),
        "projected_share": torch.where(
            seen > 0, state["projected_share_sum"] / seen.clamp(min=1), torch.full_like(seen, float("nan"))
        ),
        "norm_share": torch.where(
            seen > 0, state["norm_share_sum"] / seen.clamp(min=1), torch.full_like(seen, float("nan"))
        ),
    }


def credit_readings(
    projected_share: _Vec,
    norm_share: _Vec,
    cancellation: float,
    conservation_error: float,
    grad_match: Optional[float] = None,
    full_grad_norm: float = float("nan"),
    max_parts: Optional[int] = None,
    defined: bool = True,
) -> dict[str, torch.Tensor]:
    """The readings of one disintegration (functional form of :class:`CreditMetric`).

    ``cancelled_fraction = 1 − 1/cancellation``; ``share_sum = Σ_S projected_share[S]`` (1 when the
    audit closes); per-part vectors hold the first ``max_parts`` parts (all when None).

    Example:
        >>> r = credit_readings([0.75, 0.25], [0.6, 0.4], cancellation=1.25, conservation_error=0.0)
        >>> float(r["cancelled_fraction"]), float(r["share_sum"]), r["projected_share"].tolist()
        (0.19999999999999996, 1.0, [0.75, 0.25])
    """
    m = len(projected_share) if max_parts is None else max_parts
    return _credit_compute(
        _credit_update(
            projected_share, norm_share, cancellation, conservation_error, grad_match, full_grad_norm, m, defined
        )
    )


class CreditMetric(Metric):
    """Mean credit readings over the steps (and ranks) since the last ``reset``.

    ``forward`` returns the readings of the step it is given; ``compute`` their mean (see module doc).

    Args:
        max_parts: per-part shares kept for the first ``max_parts`` parts.

    Example:
        >>> m = CreditMetric(max_parts=2)
        >>> m.update([0.75, 0.25], [0.6, 0.4], 1.25, 1e-7)
        >>> m.update([0.25, 0.75], [0.4, 0.6], 1.75, 3e-7)
        >>> out = m.compute()
        >>> float(out["cancellation"]), out["projected_share"].tolist(), float(out["conservation_error_max"])
        (1.5, [0.5, 0.5], 3e-07)
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, max_parts: int = 16, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(max_parts, int) or max_parts < 0:
            raise ValueError(f"`max_parts` must be an int >= 0, got {max_parts!r}.")
        self.max_parts = max_parts
        for name in _SUM_STATES:
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("conservation_error_max", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")
        for name in ("projected_share_sum", "norm_share_sum", "parts_seen"):
            self.add_state(name, default=torch.zeros(max_parts, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        projected_share: _Vec = (),
        norm_share: _Vec = (),
        cancellation: float = float("nan"),
        conservation_error: float = float("nan"),
        grad_match: Optional[float] = None,
        full_grad_norm: float = float("nan"),
        defined: bool = True,
    ) -> None:
        inc = _credit_update(
            projected_share,
            norm_share,
            cancellation,
            conservation_error,
            grad_match,
            full_grad_norm,
            self.max_parts,
            defined,
            dtype=self.n_readings.dtype,
            device=self.n_readings.device,
        )
        for name, v in inc.items():
            if name == "conservation_error_max":
                self.conservation_error_max = torch.maximum(self.conservation_error_max, v)
            else:
                setattr(self, name, getattr(self, name) + v)

    def update_report(self, report) -> None:
        """Update from a :class:`~lens_callbacks.credit.CreditReport` (or a refused reading: ``None``)."""
        if report is None:
            self.update(defined=False)
            return
        self.update(
            list(report.projected_share),
            list(report.norm_share),
            report.cancellation,
            report.conservation_error,
            report.grad_match,
            report.full_grad_norm,
            defined=report.ok,
        )

    def compute(self) -> dict[str, torch.Tensor]:
        return _credit_compute({name: getattr(self, name) for name in self._defaults})
