r"""A run ledger: cumulative credit per stable part name over the audited steps of a run.

For a partition whose part names mean the same thing at every step (``by_advantage_sign``,
``by_reward``, ``by_source``), the ledger keeps, per part ``S``,

.. math:: L_S(t) = \sum_{\text{audited, defined steps } s \le t} \text{share}_S(s)

for every book it is given: ``gradient`` (projected shares) and any other mapping name → value
(e.g. ``update`` for the shares of the update the optimizer actually applied). Each step's shares
sum to 1, so ``Σ_S L_S`` counts the defined audited steps, and ``L_S / Σ L`` is the fraction of the
run's credit part ``S`` earned. Values are Python floats added one step at a time in the order
given; the state is plain data, so a resumed run continues the sums bit for bit.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Optional

__all__ = ["RunLedger"]


class RunLedger:
    """Cumulative per-part values, by book (``gradient``, ``update``, …) and partition.

    Example:
        >>> led = RunLedger()
        >>> led.update("gradient", "by_advantage_sign", {"positive": 0.75, "negative": 0.25}, step=0)
        True
        >>> led.update("gradient", "by_advantage_sign", {"positive": 0.5, "negative": 0.5}, step=1)
        True
        >>> led.totals("gradient", "by_advantage_sign")
        {'positive': 1.25, 'negative': 0.75}
        >>> led.to_dict("credit/ledger/")["credit/ledger/gradient/by_advantage_sign/positive"]
        1.25
    """

    def __init__(self) -> None:
        # book -> partition -> part -> running sum
        self._totals: dict[str, dict[str, dict[str, float]]] = {}
        # book -> partition -> list of (step, {part: cumulative value}) for the figure
        self._history: dict[str, dict[str, list[tuple[int, dict[str, float]]]]] = {}
        self.n_updates: dict[str, dict[str, int]] = {}

    def update(self, book: str, partition: str, values: Mapping[str, float], step: int) -> bool:
        """Add one step's values; a step with a non-finite value is skipped whole. Returns whether added."""
        vals = {str(k): float(v) for k, v in values.items()}
        if not vals or not all(math.isfinite(v) for v in vals.values()):
            return False
        tot = self._totals.setdefault(book, {}).setdefault(partition, {})
        for k, v in vals.items():
            tot[k] = tot.get(k, 0.0) + v
        self.n_updates.setdefault(book, {})[partition] = self.n_updates.get(book, {}).get(partition, 0) + 1
        self._history.setdefault(book, {}).setdefault(partition, []).append((int(step), dict(tot)))
        return True

    def totals(self, book: str, partition: str) -> dict[str, float]:
        return dict(self._totals.get(book, {}).get(partition, {}))

    def books(self) -> list[tuple[str, str]]:
        return [(b, p) for b, parts in self._totals.items() for p in parts]

    def history(self, book: str, partition: str) -> list[tuple[int, dict[str, float]]]:
        return list(self._history.get(book, {}).get(partition, []))

    def to_dict(self, prefix: str = "credit/ledger/") -> dict[str, float]:
        """``<prefix><book>/<partition>/<part>``: the running sum."""
        return {
            f"{prefix}{book}/{part}/{name}": v
            for book, parts in self._totals.items()
            for part, tot in parts.items()
            for name, v in tot.items()
        }

    def render(self) -> str:
        lines = ["run ledger (cumulative share per part; each defined audited step adds 1 in total)"]
        for book, part in self.books():
            tot = self.totals(book, part)
            total = math.fsum(tot.values())
            lines.append(f"{book} / {part} ({self.n_updates[book][part]} steps)")
            w = max(len(n) for n in tot)
            for name, v in tot.items():
                frac = v / total if total else float("nan")
                lines.append(f"  {name:<{w}}  {v:>12.4f}  ({100 * frac:.1f}% of the run's credit)")
        return "\n".join(lines)

    def figure(self, book: str, partition: str, title: Optional[str] = None):
        """A stacked-area figure of the cumulative values over steps (``None`` without matplotlib)."""
        hist = self.history(book, partition)
        if not hist:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        names = list(dict.fromkeys(n for _, tot in hist for n in tot))
        steps = [s for s, _ in hist]
        ys = [[tot.get(n, 0.0) for _, tot in hist] for n in names]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        pos = [[max(v, 0.0) for v in y] for y in ys]
        neg = [[min(v, 0.0) for v in y] for y in ys]
        # Negative totals stack below zero so a part that opposed the run's steps shows as such.
        polys = ax.stackplot(steps, *pos, labels=names, alpha=0.85)
        colors = [p.get_facecolor() for p in polys]
        if any(v < 0 for y in neg for v in y):
            ax.stackplot(steps, *neg, colors=colors, alpha=0.85)
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("cumulative share")
        ax.set_title(title or f"run ledger: {book} credit by {partition}")
        ax.legend(loc="upper left", fontsize=7, ncol=max(1, len(names) // 6 + 1))
        fig.tight_layout()
        return fig

    def state_dict(self) -> dict[str, Any]:
        return {
            "totals": copy.deepcopy(self._totals),
            "history": copy.deepcopy(self._history),
            "n_updates": copy.deepcopy(self.n_updates),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._totals = copy.deepcopy(dict(state.get("totals", {})))
        self._history = {
            b: {p: [(int(s), dict(t)) for s, t in h] for p, h in parts.items()}
            for b, parts in dict(state.get("history", {})).items()
        }
        self.n_updates = copy.deepcopy(dict(state.get("n_updates", {})))
