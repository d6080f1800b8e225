"""The readings a person acts on, made from one audit: several partitions, concentration, noise, ledger.

:class:`StepReadings` takes the primary report of a step (e.g. ``by_rollout``), the partition and the
terms it was made from, and:

- for every extra partition (``by_advantage_sign``, ``by_reward``, ``by_source``, …) whose parts are
  unions of the primary parts, sums the primary shares into it (exact, no backward pass); any other
  extra partition is handed to ``run_engine`` (one more disintegration, at its engine's cost);
- summarises the primary partition's concentration (:mod:`.summaries`);
- estimates the gradient noise scale when every primary part is made of whole rows (:mod:`.noise`),
  per step and smoothed;
- adds every stable-name partition's shares to the run ledger (:mod:`.ledger`).

Pure torch; the callback is a thin adapter over it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..inputs.partition import POSITIONAL_PARTITIONS, Partition, PartitionFn
from ..inputs.terms import CreditTerms
from ..report import CreditReport
from .derived import PartitionShares, coarsening, derive_shares, rows_per_part
from .ledger import RunLedger
from .noise import NoiseScale, NoiseScaleEMA, noise_scale
from .summaries import Concentration, concentration

__all__ = ["StepReadings", "RecordingPartition", "whole_rows"]


class RecordingPartition:
    """Wraps a partition callable and keeps the terms and partition of its latest call.

    The engine calls the partition on the terms it evaluated; keeping them lets the extra partitions
    and the noise scale be read without evaluating the terms again.
    """

    def __init__(self, fn: Union[PartitionFn, Partition], name: str) -> None:
        self.fn = fn
        self.__name__ = name
        self.terms: Optional[CreditTerms] = None
        self.partition: Optional[Partition] = None

    def __call__(self, terms: CreditTerms) -> Partition:
        self.terms, self.partition = None, None
        part = self.fn if isinstance(self.fn, Partition) else self.fn(terms)
        self.terms = terms.detached()
        self.partition = part if isinstance(part, Partition) else None
        return part

    def take(self) -> tuple[Optional[CreditTerms], Optional[Partition]]:
        """The latest terms and partition, forgotten afterwards (they hold the step's tensors)."""
        out = (self.terms, self.partition)
        self.terms, self.partition = None, None
        return out


def whole_rows(partition: Partition) -> bool:
    """Whether every row's positions lie in one part (the parts are unions of whole rows)."""
    ids = partition.ids.cpu()  # [B, T]
    hi = ids.max(dim=1).values  # [B]
    lo = torch.where(ids >= 0, ids, torch.full_like(ids, partition.n_parts)).min(dim=1).values  # [B]
    has = hi >= 0
    return bool((lo[has] == hi[has]).all())


class StepReadings:
    """Readings of one audited step beyond the primary report, and their running state.

    Args:
        primary_name: the primary partition's name (``by_rollout``); positional partitions
            (``by_rollout``, ``by_group``) are not added to the ledger: their part names are batch
            positions.
        extra: ``(name, partition)`` pairs read beside the primary one.
        top_k: how many largest shares ``topk_share`` adds.
        noise_beta: the smoothing factor of the noise scale's moving averages.
        prefix: metric namespace (``credit/``).
    """

    def __init__(
        self,
        primary_name: str,
        extra: Sequence[tuple[str, Union[PartitionFn, Partition]]] = (),
        top_k: int = 3,
        noise_beta: float = 0.9,
        prefix: str = "credit/",
    ) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"`concentration_top_k` must be an int >= 1, got {top_k!r}.")
        self.primary_name = primary_name
        self.extra = list(extra)
        self.top_k = top_k
        self.prefix = prefix
        self.noise_ema = NoiseScaleEMA(noise_beta)
        self.ledger = RunLedger()
        self.last_concentration: Optional[Concentration] = None
        self.last_noise: Optional[NoiseScale] = None
        self.last_extra: dict[str, PartitionShares] = {}
        self.last_errors: dict[str, str] = {}

    def read(
        self,
        report: CreditReport,
        partition: Optional[Partition],
        terms: Optional[CreditTerms],
        step: int,
        run_engine: Optional[Callable[[str, Union[PartitionFn, Partition]], Any]] = None,
        *,
        whole: Optional[bool] = None,
        extra_shares: Optional[Mapping[str, Union[PartitionShares, str]]] = None,
    ) -> dict[str, float]:
        """All scalars of this step's extra readings; updates the ledger and the smoothed noise scale.

        ``whole`` and ``extra_shares`` stand in for ``partition``/``terms`` when the report is a global one
        (:func:`~lens_callbacks.credit.readings.distributed.global_extra_shares` made them over every rank). The smoothed
        noise readings are left out until there is a reading to smooth, rather than logged as NaN.
        """
        p = self.prefix
        out: dict[str, float] = {}
        self.last_errors = {}
        conc = concentration(report.projected_share, report.part_norm, self.top_k)
        self.last_concentration = conc
        out.update(conc.to_dict(f"{p}concentration/"))

        self.last_noise = None
        rows_whole = whole if whole is not None else partition is not None and whole_rows(partition)
        if report.ok and report.n_parts >= 2 and rows_whole:
            self.last_noise = noise_scale(report.part_norm, report.full_grad_norm)
            self.noise_ema.update(self.last_noise)
            out.update(self.last_noise.to_dict(f"{p}noise/"))
        if self.noise_ema.n:  # nothing smoothed yet: left out, not logged as NaN
            out.update(self.noise_ema.to_dict(f"{p}noise/"))

        if report.ok and self.primary_name not in POSITIONAL_PARTITIONS:
            self.ledger.update(
                "gradient", self.primary_name, dict(zip(report.part_names, report.projected_share)), step
            )

        self.last_extra = {}
        for name, fn in self.extra:
            if extra_shares is not None:
                shares = extra_shares.get(name, "not read")
                if isinstance(shares, str):
                    self.last_errors[name] = shares
                    continue
            else:
                shares = self._extra(name, fn, report, partition, terms, run_engine)
            if shares is None:
                continue
            self.last_extra[name] = shares
            out.update(shares.to_dict(f"{p}{name}/"))
            if report.ok and name not in POSITIONAL_PARTITIONS:
                self.ledger.update("gradient", name, dict(zip(shares.part_names, shares.projected_share)), step)
        out.update(self.ledger.to_dict(f"{p}ledger/"))
        return out

    def _extra(self, name, fn, report, partition, terms, run_engine) -> Optional[PartitionShares]:
        coarse: Optional[Partition] = None
        if terms is not None:
            try:
                coarse = fn if isinstance(fn, Partition) else fn(terms)
                coarse.check_covers(terms.trained)
            except (ValueError, TypeError, AttributeError) as err:
                self.last_errors[name] = f"{type(err).__name__}: {err}"
                return None
        if coarse is not None and partition is not None:
            mapping = coarsening(partition, coarse)
            if mapping is not None:
                return derive_shares(
                    report.projected_share, mapping, coarse, name, rows_per_part(coarse, terms.trained)
                )
        if run_engine is None:
            self.last_errors[name] = "not a union of the primary partition's parts, and no engine to run it"
            return None
        r = run_engine(name, fn)
        if not isinstance(r, CreditReport):
            self.last_errors[name] = str(getattr(r, "reason", r))
            return None
        rows = rows_per_part(coarse, terms.trained) if coarse is not None and terms is not None else None
        return PartitionShares(name, r.part_names, r.projected_share, r.part_norm, rows, method="engine")

    def add_to_ledger(self, book: str, partition: str, values: Mapping[str, float], step: int) -> bool:
        """Add any per-part reading (e.g. ``update`` shares of the applied step) to the ledger."""
        return self.ledger.update(book, partition, values, step)

    def render(self) -> str:
        parts = []
        if self.last_concentration is not None:
            parts.append(self.last_concentration.render())
        if self.last_noise is not None:
            parts.append(self.last_noise.render() + f"; smoothed {self.noise_ema.b_simple:.4g}")
        for shares in self.last_extra.values():
            parts.append(shares.render())
        for name, why in self.last_errors.items():
            parts.append(f"{name}: not read ({why})")
        if self.ledger.books():
            parts.append(self.ledger.render())
        return "\n\n".join(parts)

    def lorenz_figure(self):
        """The Lorenz curve of the primary part norms (``None`` without matplotlib or a reading)."""
        c = self.last_concentration
        if c is None or not all(math.isfinite(v) for v in c.lorenz):
            return None
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        m = c.n_parts
        xs = [j / m for j in range(m + 1)]
        fig, ax = plt.subplots(figsize=(4, 4))
        ax.plot(xs, c.lorenz, marker="o", ms=3, label=f"part norms (Gini {c.gini_norm:.2f})")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="equal parts")
        ax.set_xlabel("fraction of parts (quietest first)")
        ax.set_ylabel("fraction of gradient mass")
        ax.set_title(f"{self.primary_name}: effective parts {c.effective_parts_norm:.1f} of {m}")
        ax.legend(loc="upper left", fontsize=7)
        fig.tight_layout()
        return fig

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.state_dict(), "noise_ema": self.noise_ema.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "ledger" in state:
            self.ledger.load_state_dict(state["ledger"])
        if "noise_ema" in state:
            self.noise_ema.load_state_dict(state["noise_ema"])
