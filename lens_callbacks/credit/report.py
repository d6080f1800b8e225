"""The reading of one disintegration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .precision import conservation_floor

__all__ = ["CreditReport", "CreditGrads", "PositionSplit"]


@dataclass(frozen=True)
class CreditGrads:
    """Parameter-space vectors kept from a disintegration (only when asked for).

    Attributes:
        names: parameter names, aligned with the lists below.
        g_full: the full gradient, taken by its own backward pass (dtype used).
        parts_sum: ``Σ_S g_S``, the sum of the parts (dtype used; float32 where that is half precision, as
            pieces formed under autocast are: ``conservation_error`` is read on this very vector).
        parts: one list per part (only with ``keep_parts=True``; memory ``m × |θ|``).
    """

    names: tuple[str, ...]
    g_full: list[torch.Tensor]
    parts_sum: list[torch.Tensor]
    parts: Optional[list[list[torch.Tensor]]] = None


@dataclass(frozen=True)
class PositionSplit:
    r"""The position split of a step: ``<piece of g_full at the positions of P, g_full> / ‖g_full‖²`` per part ``P``.

    Beside the loss-mask split (whose part ``S`` is the gradient of the terms *at* ``S``), the position split
    asks where the gradient was *computed*: every position's own pieces (the layers' weights as they were
    used at that position), the prompt, user and tool tokens of a turn included — a later turn's loss reaches
    them through attention. The shares sum to 1; ``conservation_error`` is ``|Σ_P dots_P − ‖g_full‖²| / ‖g_full‖²``.
    When it could not be read, the shares are empty and ``reason`` says why.

    Example:
        >>> PositionSplit(("user", "assistant"), (0.25, 0.75), 0.0).to_dict("credit/")["credit/position_split/projected_share/user"]
        0.25
    """

    part_names: tuple[str, ...]
    projected_share: tuple[float, ...]
    conservation_error: float
    reason: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def to_dict(self, prefix: str = "credit/", max_parts: Optional[int] = None) -> dict[str, float]:
        if not self.ok:
            return {f"{prefix}position_split/read": 0.0}
        out = {
            f"{prefix}position_split/read": 1.0,
            f"{prefix}position_split/share_sum": math.fsum(self.projected_share),
            f"{prefix}position_split/conservation_error": float(self.conservation_error),
        }
        k = len(self.part_names) if max_parts is None else min(max_parts, len(self.part_names))
        for name, v in zip(self.part_names[:k], self.projected_share[:k]):
            out[f"{prefix}position_split/projected_share/{name}"] = float(v)
        return out


@dataclass(frozen=True)
class CreditReport:
    r"""Which part of a step got the credit, and the proof that the parts add up.

    With ``g_S`` the gradient of the objective masked to part ``S`` and ``g_full`` the gradient of the
    whole objective, taken by its own independent backward pass:

    - ``projected_share[S] = <g_S, g_full> / ||g_full||²`` — additive, sums to 1, may be negative;
    - ``norm_share[S] = ||g_S|| / Σ_S' ||g_S'||`` — not additive, reported beside it;
    - ``cancellation = Σ_S ||g_S|| / ||g_full||`` (≥ 1): 1 − 1/cancellation of the per-part mass
      cancels between parts before the optimizer sees it;
    - ``conservation_error = ||Σ_S g_S − g_full|| / ||g_full||``, held against ``conservation_floor``, the most
      rounding in ``dtype`` (and ``compute_dtype``, autocast's) explains;
    - ``grad_match = ||g_full − grad|| / ||g_full||`` against the trainer's ``.grad`` when given.

    When ``g_full`` is zero or not finite the shares are NaN and ``reason`` says why. ``compute_dtype`` names
    the autocast dtype the terms were computed under (None: ``dtype`` itself); ``floor_scale`` is an engine's
    own bound on the cancellation for its conservation check (the forward-mode engine's, over positions).
    ``spans``: the one-pass engine read the parts as spans of rows (packed rollouts), position by position;
    ``spans_verified``: this reading also held one part to its own masked backward. ``position_split``: the
    same step split by the positions the gradient was computed at (:class:`PositionSplit`), when asked for.

    Example:
        >>> r = CreditReport(("a", "b"), (0.75, 0.25), (0.6, 0.4), (3.0, 2.0), 5 / 4, 1e-16, None,
        ...                  "float64", 10, 4.0, 1.5)
        >>> r.to_dict("credit/")["credit/projected_share/a"]
        0.75
    """

    part_names: tuple[str, ...]
    projected_share: tuple[float, ...]
    norm_share: tuple[float, ...]
    part_norm: tuple[float, ...]
    cancellation: float
    conservation_error: float
    grad_match: Optional[float]
    dtype: str
    n_trained: int
    full_grad_norm: float
    loss: float
    partition: str = ""
    reason: Optional[str] = None
    grads: Optional[CreditGrads] = field(default=None, repr=False, compare=False)
    engine: str = "reference"
    readings: str = "all"
    gram: Optional[tuple[tuple[float, ...], ...]] = field(default=None, repr=False)
    coverage: Optional[tuple[tuple[str, int], ...]] = None
    compute_dtype: Optional[str] = None
    floor_scale: Optional[float] = None
    spans: bool = False
    spans_verified: bool = False
    position_split: Optional[PositionSplit] = field(default=None, repr=False)

    @property
    def conservation_floor(self) -> float:
        """The largest ``conservation_error`` rounding explains for this reading
        (:func:`lens_callbacks.credit.precision.conservation_floor`): a few unit roundoffs of the coarser
        of ``dtype`` and ``compute_dtype`` (the autocast dtype the terms were computed under), times the
        cancellation (``floor_scale`` where the engine bounds it itself; ``Σ |projected_share|`` with
        projected shares alone)."""
        projected_only = self.floor_scale is None and not math.isfinite(self.cancellation)
        if self.floor_scale is not None:
            scale = self.floor_scale
        elif projected_only:
            scale = math.fsum(abs(x) for x in self.projected_share if math.isfinite(x))
        else:
            scale = self.cancellation
        return conservation_floor(self.dtype, self.compute_dtype, scale, projected_only=projected_only)

    @property
    def conservation_violated(self) -> bool:
        """Whether ``conservation_error`` exceeds its floor: the parts do not add up to ``g_full``, so the shares
        are not a split of this step (the callbacks withhold them; see :mod:`lens_callbacks.credit.guard`)."""
        e = self.conservation_error
        return self.ok and not (e <= self.conservation_floor)

    def interference(self) -> Optional[torch.Tensor]:
        """The interference matrix: ``cos(g_S, g_S') = <g_S, g_S'> / (‖g_S‖ ‖g_S'‖)``, ``[m, m]`` float64.

        Negative entries are pairs of parts that pull against each other; None when the engine made no
        Gram (``readings="projected"``, or the reference engine without ``keep_parts``). A part with a
        zero gradient has NaN cosines.
        """
        if self.gram is None:
            return None
        g = torch.tensor(self.gram, dtype=torch.float64)  # [m, m]
        n = g.diagonal().clamp(min=0).sqrt()  # [m]
        return g / (n[:, None] * n[None, :])

    def interference_summary(self) -> dict[str, float]:
        """Scalars of the interference matrix: the most negative off-diagonal cosine, the mean one, and the
        fraction of part pairs that pull against each other (negative cosine)."""
        c = self.interference()
        if c is None or c.shape[0] < 2:
            return {}
        m = c.shape[0]
        off = c[~torch.eye(m, dtype=torch.bool)]  # [m * (m - 1)]
        off = off[torch.isfinite(off)]
        if off.numel() == 0:
            return {}
        return {
            "min_cosine": float(off.min()),
            "mean_cosine": float(off.mean()),
            "negative_pair_fraction": float((off < 0).double().mean()),
        }

    @property
    def n_parts(self) -> int:
        return len(self.part_names)

    @property
    def ok(self) -> bool:
        """Whether the shares are defined (``g_full`` non-zero and finite)."""
        return self.reason is None

    @property
    def share_sum(self) -> float:
        return math.fsum(self.projected_share)

    @property
    def cancelled_fraction(self) -> float:
        """``1 − 1/cancellation``: the share of per-part gradient mass that cancels between parts."""
        c = self.cancellation
        return 1.0 - 1.0 / c if c and math.isfinite(c) else float("nan")

    def share(self, name: str) -> float:
        return self.projected_share[self.part_names.index(name)]

    def to_dict(self, prefix: str = "credit/", max_parts: Optional[int] = None) -> dict[str, float]:
        """Flat scalars for loggers. Per-part scalars for the first ``max_parts`` parts (all if None)."""
        out = {
            f"{prefix}cancellation": float(self.cancellation),
            f"{prefix}conservation_error": float(self.conservation_error),
            f"{prefix}full_grad_norm": float(self.full_grad_norm),
            f"{prefix}share_sum": float(self.share_sum),
            f"{prefix}n_parts": float(self.n_parts),
            f"{prefix}n_trained": float(self.n_trained),
            f"{prefix}undefined_fraction": 0.0 if self.ok else 1.0,  # the name the callbacks log per step
            f"{prefix}conservation_floor": float(self.conservation_floor),
        }
        if self.grad_match is not None:
            out[f"{prefix}grad_match"] = float(self.grad_match)
        out[f"{prefix}engine/{self.engine}"] = 1.0
        out[f"{prefix}readings/{self.readings}"] = 1.0
        for key, v in self.interference_summary().items():
            out[f"{prefix}interference/{key}"] = v
        k = self.n_parts if max_parts is None else min(max_parts, self.n_parts)
        for i in range(k):
            name = self.part_names[i]
            out[f"{prefix}projected_share/{name}"] = float(self.projected_share[i])
            out[f"{prefix}norm_share/{name}"] = float(self.norm_share[i])
        if self.position_split is not None:
            out.update(self.position_split.to_dict(prefix, max_parts))
        return out

    def render(self, max_rows: int = 10) -> str:
        """A readable table: the ``max_rows`` parts of largest and smallest ``|projected share|`` (the rest
        summarised in one line), then the closing checks. With the terms at hand,
        :func:`lens_callbacks.credit.readings.table.credit_table` adds each part's group, reward, advantage, trained
        length and completion."""
        from .readings.table import credit_table

        return credit_table(self, top_k=(max_rows + 1) // 2, bottom_k=max_rows // 2).render()

    def _engine_line(self) -> str:
        held = (
            "projected shares only (norms NaN)"
            if self.readings == "projected"
            else "projected and norm shares, cancellation"
        )
        if self.gram is not None:
            held += ", interference matrix"
        line = f"engine {self.engine}: {held}"
        if self.coverage:
            line += "; parameters covered: " + ", ".join(f"{k} {v:,}" for k, v in self.coverage)
        summary = self.interference_summary()
        if summary:
            line += (
                f"\ninterference: min cos {summary['min_cosine']:.3f}, mean cos {summary['mean_cosine']:.3f}, "
                f"{100 * summary['negative_pair_fraction']:.1f}% of part pairs pull against each other"
            )
        return line


def share_readings(
    dots: list[float], full_sq: float, diff_norm: float, norm_total: float, onto_sq: Optional[float] = None
) -> tuple[Optional[str], tuple[float, ...], float, float]:
    """``(reason, projected_share, conservation_error, cancellation)`` from an engine's sums.

    Args:
        dots: ``<g_S, v>`` per part, ``v`` = ``g_full`` or the vector given as ``project_onto``.
        full_sq: ``‖g_full‖²``. diff_norm: ``‖Σ_S g_S − g_full‖``. norm_total: ``Σ_S ‖g_S‖`` (NaN without norms).
        onto_sq: ``‖v‖²`` when the parts are projected onto ``v`` (None: onto ``g_full``).

    Every engine decides here when the shares are undefined, so their reasons and numbers agree.
    """
    reason: Optional[str] = None
    if not math.isfinite(full_sq):
        reason = f"the full gradient is not finite (||g_full||² = {full_sq}); shares are undefined this step."
    elif full_sq == 0.0 and onto_sq is None:
        reason = "the full gradient is zero (e.g. every advantage is 0); shares are undefined this step."
    elif onto_sq is not None and not (math.isfinite(onto_sq) and onto_sq > 0.0):
        reason = f"the vector the parts are projected onto has ||v||² = {onto_sq}; shares are undefined this step."
    nan = float("nan")
    if reason is not None:
        return reason, tuple(nan for _ in dots), nan if not math.isfinite(full_sq) else diff_norm, nan
    den = full_sq if onto_sq is None else onto_sq
    projected = tuple(d / den for d in dots)
    if full_sq == 0.0:  # a rank whose own gradient is zero still has (zero) parts of the global step
        return None, projected, diff_norm, nan
    full_norm = math.sqrt(full_sq)
    return None, projected, diff_norm / full_norm, norm_total / full_norm
