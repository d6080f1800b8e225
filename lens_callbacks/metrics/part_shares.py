r"""Epoch shares per part, keyed by part NAME, that add up when the set of parts changes between steps.

Definition (one, used everywhere): over the defined readings of an epoch ``n`` (steps whose shares are
defined), a part absent at a step counts as share 0 that step,

.. math::

    \text{epoch\_share}_S = \frac{1}{n} \sum_{\text{defined steps}} \text{share}_S(\text{step}), \qquad
    \sum_S \text{epoch\_share}_S = \frac{1}{n} \sum_{\text{steps}} \sum_S \text{share}_S = \overline{\text{share\_sum}} = 1,

the same for ``norm_share``. Keyed by position instead (part ``i`` of one step averaged with part ``i``
of another), a part present at one step of two would be divided by 1 instead of 2 and the epoch shares
would not sum to 1. Undefined and refused steps add nothing to the sums and nothing to ``n``: they are
counted once, in ``undefined_fraction`` of :class:`~lens_callbacks.metrics.credit.CreditMetric`.

Sums are float64 and additive, so the readings of several ranks merge by adding (:meth:`merge`), and the
state is plain Python (:meth:`state_dict`) so a resumed run continues the epoch where it stopped.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["PartShares"]


class PartShares:
    """Running per-part sums of projected and norm shares over defined readings, keyed by part name.

    Example:
        >>> acc = PartShares()
        >>> acc.update(("turn_0", "turn_1"), (0.5, 0.5), (0.5, 0.5))
        >>> acc.update(("turn_0", "turn_1", "turn_6"), (0.2, 0.2, 0.6), (0.3, 0.3, 0.4))
        >>> shares = acc.compute()["projected_share"]
        >>> shares, round(sum(shares.values()), 12)
        ({'turn_0': 0.35, 'turn_1': 0.35, 'turn_6': 0.3}, 1.0)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n_defined = 0
        # Insertion order is first appearance: the order parts are logged in.
        self.projected: dict[str, float] = {}
        self.norm: dict[str, float] = {}

    def update(self, names: Sequence[str], projected_share: Sequence[float], norm_share: Sequence[float]) -> None:
        """Add one defined reading (all of its parts; a part not named here counts as 0 this step)."""
        if not (len(names) == len(projected_share) == len(norm_share)):
            raise ValueError(
                f"`names`, `projected_share` and `norm_share` must have one entry per part, got "
                f"{len(names)}, {len(projected_share)} and {len(norm_share)}."
            )
        if len(set(names)) != len(names):
            raise ValueError(f"`names` must be unique, got {list(names)!r}.")
        self.n_defined += 1
        for name, p, q in zip(names, projected_share, norm_share):
            self.projected[name] = self.projected.get(name, 0.0) + float(p)
            self.norm[name] = self.norm.get(name, 0.0) + float(q)

    def compute(self) -> dict[str, dict[str, float]]:
        """``{"projected_share": {name: mean}, "norm_share": {name: mean}}``; empty dicts before any reading."""
        n = self.n_defined
        if n == 0:
            return {"projected_share": {}, "norm_share": {}}
        return {
            "projected_share": {k: v / n for k, v in self.projected.items()},
            "norm_share": {k: v / n for k, v in self.norm.items()},
        }

    def merge(self, others: Iterable[Mapping[str, Any]]) -> "PartShares":
        """A new accumulator holding this one's sums plus those of ``others`` (``state_dict``s, e.g. of other ranks)."""
        out = PartShares()
        out.load_state_dict(self.state_dict())
        for st in others:
            out.n_defined += int(st["n_defined"])
            for name, v in st["projected"].items():
                out.projected[name] = out.projected.get(name, 0.0) + float(v)
            for name, v in st["norm"].items():
                out.norm[name] = out.norm.get(name, 0.0) + float(v)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"n_defined": self.n_defined, "projected": dict(self.projected), "norm": dict(self.norm)}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        self.reset()
        if not state:
            return
        self.n_defined = int(state["n_defined"])
        self.projected = {str(k): float(v) for k, v in state["projected"].items()}
        self.norm = {str(k): float(v) for k, v in state["norm"].items()}

    def share_sum(self) -> float:
        """``Σ_S epoch_share_S`` (1 when every step's shares sum to 1); NaN before any reading."""
        if self.n_defined == 0:
            return float("nan")
        return math.fsum(self.projected.values()) / self.n_defined
