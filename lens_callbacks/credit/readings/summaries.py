r"""Concentration of one step's credit over the parts of a partition, from numbers the audit has.

No backward pass: everything here reads a report's ``projected_share`` ``s_i`` and ``part_norm``
``n_i`` (``i = 1 … m``). The summaries answer "does one part carry the step, or do many?":

- ``effective_parts_norm = (Σ n_i)² / Σ n_i²`` — the participation ratio of the part norms: ``m``
  when every part is as loud as every other, 1 when one part is all the gradient mass;
- ``effective_parts_positive = (Σ s_i⁺)² / Σ (s_i⁺)²`` with ``s⁺ = max(s, 0)`` — the same count over
  the parts that pushed the step forward (0 when none did);
- ``top1_share``, ``topk_share`` — the largest projected share, and the sum of the ``k`` largest;
- ``negative_fraction`` — the fraction of parts whose share is negative (they opposed the step);
- ``negative_mass = −Σ_{s_i<0} s_i`` — how much share those parts took back (``Σ s⁺ = 1 + negative_mass``);
- ``gini_norm`` — the Gini coefficient of the part norms, ``Σ_i Σ_j |n_i − n_j| / (2 m Σ n)``: 0 when all
  parts are equally loud, ``1 − 1/m`` when one part holds all the mass;
- ``lorenz`` — the Lorenz curve of the part norms (ascending cumulative fraction, ``m + 1`` points from 0
  to 1), whose area gap to the diagonal is ``gini_norm / 2``.

All of them are invariant to the order of the parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Concentration", "concentration", "lorenz_curve"]


def _pr(w: Sequence[float]) -> float:
    s = math.fsum(w)
    q = math.fsum(x * x for x in w)
    return s * s / q if q > 0 else 0.0


def lorenz_curve(values: Sequence[float]) -> tuple[float, ...]:
    """Cumulative fraction of the total held by the smallest ``j`` values, ``j = 0 … m``.

    Example:
        >>> lorenz_curve([3.0, 1.0])
        (0.0, 0.25, 1.0)
    """
    v = sorted(float(x) for x in values)
    total = math.fsum(v)
    if not v or total <= 0:
        return tuple(float("nan") for _ in range(len(v) + 1))
    return (0.0,) + tuple(math.fsum(v[: j + 1]) / total for j in range(len(v)))


def _gini(values: Sequence[float]) -> float:
    v = sorted(float(x) for x in values)
    m, total = len(v), math.fsum(v)
    if m == 0 or total <= 0:
        return float("nan")
    # Σ_i Σ_j |v_i − v_j| = 2 Σ_i (2i − m + 1) v_i over the ascending order (i from 0).
    return math.fsum((2 * i - m + 1) * x for i, x in enumerate(v)) / (m * total)


@dataclass(frozen=True)
class Concentration:
    """How concentrated one step's credit is over the parts (see the module docstring for formulas).

    Example:
        >>> c = concentration([0.5, 0.75, -0.25], [1.0, 2.0, 1.0], k=2)
        >>> c.effective_parts_norm, c.effective_parts_positive, c.top1_share, c.topk_share
        (2.6666666666666665, 1.9230769230769231, 0.75, 1.25)
        >>> c.negative_fraction, c.negative_mass, c.gini_norm, c.lorenz
        (0.3333333333333333, 0.25, 0.16666666666666666, (0.0, 0.25, 0.5, 1.0))
        >>> c.to_dict("credit/concentration/")["credit/concentration/effective_fraction_norm"]
        0.8888888888888888
    """

    n_parts: int
    k: int
    effective_parts_norm: float
    effective_parts_positive: float
    top1_share: float
    topk_share: float
    negative_fraction: float
    negative_mass: float
    gini_norm: float
    lorenz: tuple[float, ...]

    def to_dict(self, prefix: str = "credit/concentration/") -> dict[str, float]:
        """Flat scalars under stable names (``topk_share`` is the sum of the ``k`` largest shares)."""
        return {
            f"{prefix}effective_parts_norm": float(self.effective_parts_norm),
            f"{prefix}effective_parts_positive": float(self.effective_parts_positive),
            f"{prefix}effective_fraction_norm": float(self.effective_parts_norm / self.n_parts)
            if self.n_parts
            else float("nan"),
            f"{prefix}top1_share": float(self.top1_share),
            f"{prefix}topk_share": float(self.topk_share),
            f"{prefix}negative_fraction": float(self.negative_fraction),
            f"{prefix}negative_mass": float(self.negative_mass),
            f"{prefix}gini_norm": float(self.gini_norm),
        }

    def render(self) -> str:
        return "\n".join(
            [
                f"concentration over {self.n_parts} parts",
                f"effective parts (norms)           {self.effective_parts_norm:.3f} of {self.n_parts}",
                f"effective parts (positive shares) {self.effective_parts_positive:.3f}",
                f"top-1 share {self.top1_share:.4f}, top-{self.k} share {self.topk_share:.4f}",
                f"negative: {100 * self.negative_fraction:.1f}% of parts, taking back {self.negative_mass:.4f} of the step",
                f"Gini of part norms {self.gini_norm:.4f}",
            ]
        )


def concentration(
    projected_share: Sequence[float], part_norm: Optional[Sequence[float]] = None, k: int = 3
) -> Concentration:
    """Concentration summaries of one reading.

    Args:
        projected_share: one share per part (they sum to 1 on a defined reading; NaN when undefined).
        part_norm: ``‖g_S‖`` per part; ``None`` (e.g. shares derived by summing another partition's)
            makes the norm-based summaries NaN.
        k: how many of the largest shares ``topk_share`` adds (capped at the number of parts).

    Returns:
        A :class:`Concentration`; every field is NaN when a share is not finite.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"`k` must be an int >= 1, got {k!r}.")
    s = [float(x) for x in projected_share]
    m = len(s)
    if part_norm is not None and len(part_norm) != m:
        raise ValueError(f"`part_norm` must hold one norm per share ({m}), got {len(part_norm)}.")
    nan = float("nan")
    kk = min(k, m)
    if m == 0 or not all(math.isfinite(x) for x in s):
        return Concentration(m, kk, nan, nan, nan, nan, nan, nan, nan, tuple(nan for _ in range(m + 1)))
    desc = sorted(s, reverse=True)
    pos = [max(x, 0.0) for x in s]
    if part_norm is not None:
        n = [float(x) for x in part_norm]
        eff_norm, gini, lorenz = _pr(n), _gini(n), lorenz_curve(n)
    else:
        eff_norm, gini, lorenz = nan, nan, tuple(nan for _ in range(m + 1))
    return Concentration(
        n_parts=m,
        k=kk,
        effective_parts_norm=eff_norm,
        effective_parts_positive=_pr(pos),
        top1_share=desc[0],
        topk_share=math.fsum(desc[:kk]),
        negative_fraction=sum(1 for x in s if x < 0) / m,
        negative_mass=-math.fsum(x for x in s if x < 0),
        gini_norm=gini,
        lorenz=lorenz,
    )
