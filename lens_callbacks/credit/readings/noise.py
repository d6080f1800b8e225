r"""The gradient noise scale ``B_simple`` (McCandlish et al. 2018) from one audit's per-row numbers.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (arXiv 1812.06162):
with per-example gradients ``x_k`` drawn with mean ``G`` and covariance ``Σ``, the mean of a batch of
``b`` of them satisfies ``E‖G_b‖² = ‖G‖² + tr(Σ)/b``, and ``B_simple = tr(Σ)/‖G‖²`` is the batch size
above which a larger batch stops buying a proportionally larger step. Their Appendix A estimates
both terms without bias from ``‖G_b‖²`` at two batch sizes ``b_small < b_big``:

.. math::

    \widehat{‖G‖²} = \frac{b_\text{big}‖G_\text{big}‖² − b_\text{small}‖G_\text{small}‖²}{b_\text{big} − b_\text{small}},
    \qquad
    \widehat{\operatorname{tr}Σ} = \frac{‖G_\text{small}‖² − ‖G_\text{big}‖²}{1/b_\text{small} − 1/b_\text{big}}.

Here the audit already has, for the ``B`` parts of a row partition (``by_rollout``: one per row),
``‖g_k‖`` and ``‖g_full‖`` with ``g_full = Σ_k g_k``. Take ``x_k = B·g_k`` (so the batch mean of the
``x_k`` is ``g_full``; any constant factor cancels in the ratio), ``b_small = 1`` with ``‖G_small‖²``
averaged over the ``B`` rows, ``‖G_small‖² = (B²/B) Σ_k ‖g_k‖² = B Σ_k ‖g_k‖²``, and ``b_big = B``
with ``‖G_big‖² = ‖g_full‖²``. Then

.. math::

    \widehat{‖G‖²} = \frac{B‖g_\text{full}‖² − B Σ_k ‖g_k‖²}{B − 1}, \qquad
    \widehat{\operatorname{tr}Σ} = \frac{B (B Σ_k ‖g_k‖² − ‖g_\text{full}‖²)}{B − 1},

the unbiased sample covariance trace ``(1/(B−1)) Σ_k ‖x_k − x̄‖²``. Each is unbiased; their ratio is
not (a ratio of noisy terms), so the smoothed reading is the ratio of the two exponential moving
averages, as the paper recommends, not the average of per-step ratios.

The estimate treats rows as independent draws. In GRPO the rows of one group share a baseline (their
advantages sum to zero), which makes them negatively correlated; read ``B_simple`` in rollouts, and
against the number of rollouts per step (``B``) and per group (``G``) — see docs/readings.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["NoiseScale", "noise_scale", "NoiseScaleEMA"]


@dataclass(frozen=True)
class NoiseScale:
    """One step's gradient noise scale estimate (units: rows of the partition, i.e. rollouts).

    Example:
        >>> n = noise_scale([1.0, 1.0], 0.0)        # two opposite unit gradients: pure noise
        >>> n.grad_sq, n.trace_sigma, n.b_simple
        (-4.0, 8.0, -2.0)
    """

    n: int
    grad_sq: float
    trace_sigma: float
    b_simple: float

    def to_dict(self, prefix: str = "credit/noise/") -> dict[str, float]:
        return {
            f"{prefix}grad_sq": float(self.grad_sq),
            f"{prefix}trace_sigma": float(self.trace_sigma),
            f"{prefix}b_simple": float(self.b_simple),
        }

    def render(self) -> str:
        return (
            f"noise scale over {self.n} rows: B_simple = {self.b_simple:.4g} "
            f"(tr Σ = {self.trace_sigma:.4g}, |G|² = {self.grad_sq:.4g})"
        )


def noise_scale(part_norm: Sequence[float], full_grad_norm: float) -> NoiseScale:
    """Unbiased ``|G|²`` and ``tr(Σ)`` from per-row gradient norms and the full gradient's norm.

    Args:
        part_norm: ``‖g_k‖`` for each of the ``B >= 2`` rows, where ``Σ_k g_k = g_full``.
        full_grad_norm: ``‖g_full‖``, taken by its own backward pass.

    Returns:
        A :class:`NoiseScale` in the units of ``x_k = B·g_k`` (``B_simple`` is unit-free). The
        ``|G|²`` estimate may come out negative on a noisy step (it is unbiased, not positive); the
        ratio is then meaningless for that step and only the smoothed reading should be read.
    """
    B = len(part_norm)
    if B < 2:
        raise ValueError(f"`part_norm` must hold at least 2 rows (two batch sizes), got {B}.")
    small = B * math.fsum(float(x) ** 2 for x in part_norm)  # mean over rows of ‖x_k‖², x_k = B·g_k
    big = float(full_grad_norm) ** 2
    grad_sq = (B * big - small) / (B - 1)
    trace = (small - big) / (1.0 - 1.0 / B)
    b_simple = trace / grad_sq if grad_sq != 0 else float("nan")
    return NoiseScale(B, grad_sq, trace, b_simple)


class NoiseScaleEMA:
    """Exponential moving averages of ``|G|²`` and ``tr(Σ)`` and their ratio, bias-corrected.

    ``ema_x ← β·ema_x + (1 − β)·x`` with the Adam-style correction ``1 − β^n`` so the first readings
    are not pulled toward 0. ``b_simple = ema_trace / ema_grad_sq``, NaN while ``ema_grad_sq <= 0``
    (the noise swamps the signal at this batch size). Non-finite readings are skipped.

    Example:
        >>> e = NoiseScaleEMA(beta=0.5)
        >>> e.update(NoiseScale(4, 1.0, 4.0, 4.0)); e.update(NoiseScale(4, 3.0, 4.0, 4 / 3))
        >>> round(e.b_simple, 12)
        1.714285714286
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"`beta` must be in [0, 1), got {beta!r}.")
        self.beta = float(beta)
        self.grad_sq = 0.0
        self.trace_sigma = 0.0
        self.n = 0

    def update(self, reading: NoiseScale) -> None:
        if not (math.isfinite(reading.grad_sq) and math.isfinite(reading.trace_sigma)):
            return
        b = self.beta
        self.grad_sq = b * self.grad_sq + (1 - b) * reading.grad_sq
        self.trace_sigma = b * self.trace_sigma + (1 - b) * reading.trace_sigma
        self.n += 1

    @property
    def b_simple(self) -> float:
        # The bias corrections of numerator and denominator are equal and cancel in the ratio. A
        # smoothed |G|² at or below 0 means the noise swamps the signal: no finite reading.
        return self.trace_sigma / self.grad_sq if self.n and self.grad_sq > 0 else float("nan")

    def to_dict(self, prefix: str = "credit/noise/") -> dict[str, float]:
        """The smoothed readings that exist: a NaN would be a gap in every plot, so it is left out."""
        if not self.n:
            return {}
        c = 1.0 - self.beta**self.n
        out = {
            f"{prefix}grad_sq_ema": self.grad_sq / c,
            f"{prefix}trace_sigma_ema": self.trace_sigma / c,
            f"{prefix}b_simple_ema": self.b_simple,
        }
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "grad_sq": self.grad_sq, "trace_sigma": self.trace_sigma, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state.get("beta", self.beta))
        self.grad_sq = float(state.get("grad_sq", 0.0))
        self.trace_sigma = float(state.get("trace_sigma", 0.0))
        self.n = int(state.get("n", 0))


def noise_from_report(report: Any) -> Optional[NoiseScale]:
    """The estimate from a row-partition report (``by_rollout``), ``None`` when it cannot be read."""
    norms = getattr(report, "part_norm", None)
    if norms is None or len(norms) < 2 or not getattr(report, "ok", False):
        return None
    return noise_scale(norms, report.full_grad_norm)
