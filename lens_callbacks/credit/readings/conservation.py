r"""Step conservation: does the optimizer's actual update equal ``η`` times the gradient we claim?

For plain gradient descent, ``θ_after = θ_before − η·g`` with one learning rate ``η`` per param group, so
``(θ_before − θ_after) / η`` read back from the weights is the gradient the optimizer applied. Holding it
against the summed credit parts of an audit checks the audit's claim against the step that really
happened; holding it against ``.grad`` checks that the step was a plain SGD step on that gradient.

The identity holds for plain SGD and nothing else. :func:`exact_optimizer_precondition` derives from the
configured optimizer (and the plain values the trainer adds: clipping, accumulation, a skipped step)
whether it holds, and returns a :class:`~lens_callbacks.refusal.Refusal` naming the first broken
condition otherwise. :func:`step_conservation` makes the reading.

The update is read as a difference of rounded parameters, so the check has a precision floor: with
``u`` the unit roundoff of the parameter dtype, rounding ``θ_after`` alone moves ``Δθ/η`` by up to
``u·|θ_after|/η`` per entry. When the gradient held against is the audit's summed parts, their own
rounding (the audit's ``conservation_error``, ``‖Σ g_S − g_full‖/‖g_full‖``, in the dtype they were
computed in) joins the floor. A measured error under that floor is not evidence of anything.

Each reading says what it found in one word: ``holds`` (error within the tolerance, or under a floor
finer than the tolerance), ``holds within precision`` (under a floor coarser than the tolerance: no
evidence of a violation, and none could be seen below the floor), ``violated``; a reading that cannot
be made is a Refusal (``refused``).

This module is pure torch: it never imports lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from ...refusal import Refusal
from ..precision import UNIT_ROUNDOFF

__all__ = [
    "ConservationReading",
    "STATUSES",
    "parts_precision_floor",
    "step_conservation",
    "exact_optimizer_precondition",
    "unit_roundoff",
    "UNIT_ROUNDOFF",
]


_REMEDY = (
    "step conservation holds for plain gradient descent only: use torch.optim.SGD(params, lr) with "
    "momentum=0, weight_decay=0, nesterov=False, maximize=False, no gradient clipping and "
    "accumulate_grad_batches=1 on the steps you want checked (e.g. a short audit run)."
)


#: The status words of a step-conservation reading (:attr:`ConservationReading.status`); a Refusal reads ``refused``.
STATUSES = ("holds", "holds within precision", "violated", "refused")

#: An audit ``conservation_error`` up to this many unit roundoffs of the parts' dtype is read as their rounding;
#: above it, parts that do not add up are a finding the floor must not hide.
PARTS_ROUNDING_UNITS = 8.0


def parts_precision_floor(parts_error: Optional[float], parts_dtype: Optional[torch.dtype]) -> float:
    """What the audit's own rounding adds to the floor when ``Σ g_S`` is the gradient held against.

    ``‖Σ g_S − g_full‖ = e·‖g_full‖ ≤ e/(1 − e)·‖Σ g_S‖`` for the audit's ``conservation_error`` ``e``; it
    counts only while ``e ≤ 8·u(parts_dtype)`` (rounding), so a real gap between parts and gradient still shows.

    Example:
        >>> parts_precision_floor(2e-3, torch.bfloat16) > 2e-3, parts_precision_floor(0.5, torch.bfloat16)
        (True, 0.0)
    """
    if parts_error is None or parts_dtype is None or parts_dtype not in UNIT_ROUNDOFF:
        return 0.0
    e = float(parts_error)
    if not (math.isfinite(e) and 0.0 <= e <= PARTS_ROUNDING_UNITS * UNIT_ROUNDOFF[parts_dtype]):
        return 0.0
    return e / (1.0 - e)


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u(dtype)``: the largest relative error of rounding one real number to ``dtype``.

    Example:
        >>> unit_roundoff(torch.float32) == 2**-24, unit_roundoff(torch.float64) == 2**-53
        (True, True)
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(
            f"`dtype` must be one of {[str(d).replace('torch.', '') for d in UNIT_ROUNDOFF]}, got {dtype!r}."
        )
    return UNIT_ROUNDOFF[dtype]


@dataclass(frozen=True)
class ConservationReading:
    r"""The reading of one optimizer step against the gradient it was held against.

    With ``Δθ = θ_before − θ_after``, ``η`` the learning rate of each entry's param group and ``g`` the
    gradient held against (zero for parameters that had no gradient: the optimizer must leave them):

    - ``relative_error = ||Δθ ⊘ η − g|| / ||g||``;
    - ``update_precision_floor = u · (||θ_after ⊘ η||_upd / ||g|| + 2) + parts_floor``, over the entries the optimizer
      updated (``u`` per tensor when dtypes are mixed; the ``+ 2u`` term takes the coarsest); for one group
      and a small step this is ``u·||θ_after|| / ||η·g||`` ≈
      ``u·||θ_after|| / ||Δθ||``. The ``+ 2`` covers rounding ``η`` and ``η·g`` themselves. The floor uses
      the update the gradient claims, ``η·g``, not the measured ``Δθ``: a step that never happened
      (``Δθ = 0``) must read as an error of 1, not as an unresolvable reading. ``parts_floor`` is the
      rounding of the audit's parts when ``g`` is ``Σ g_S`` (:func:`parts_precision_floor`), else 0;
    - ``update_precision_limited = relative_error <= update_precision_floor``: the measured error is within
      what rounding the parameters can produce, so it is no evidence of a violation (and the check
      resolves nothing finer than the floor);
    - ``holds = update_precision_limited or relative_error <= tolerance``;
    - ``status``: ``"holds"``, ``"holds within precision"`` (under a floor coarser than ``tolerance``) or
      ``"violated"``;
    - ``scale = <Δθ ⊘ η, g> / ||g||²``: the factor that best maps ``g`` onto the applied update (1 when they
      agree; 2 for a loss of ``2·terms.sum()``), for the words of a violation.

    Example:
        >>> r = ConservationReading(0.151, 7.9, True, "float32", "grad", 1e-3)
        >>> r.holds, r.status, r.to_dict()["conservation/holds"]
        (True, 'holds within precision', 1.0)
    """

    relative_error: float
    update_precision_floor: float
    update_precision_limited: bool
    dtype: str
    source: str
    tolerance: float
    grad_norm: float = float("nan")
    update_norm: float = float("nan")
    param_norm: float = float("nan")
    lrs: tuple[float, ...] = ()
    n_tensors: int = 0
    n_without_grad: int = 0
    step: Optional[int] = None
    parts_floor: float = 0.0
    scale: float = float("nan")

    @property
    def holds(self) -> bool:
        """Whether the step conserves: the error is under the floor or under ``tolerance``."""
        return bool(self.update_precision_limited or self.relative_error <= self.tolerance)

    @property
    def violated(self) -> bool:
        return not self.holds

    @property
    def status(self) -> str:
        """``"holds"``, ``"holds within precision"`` or ``"violated"`` (see the class docstring)."""
        if self.violated:
            return "violated"
        if self.relative_error <= self.tolerance or self.update_precision_floor <= self.tolerance:
            return "holds"
        return "holds within precision"

    def explain(self) -> str:
        """A violation in words: what was compared, the figure, the likely cause and the fix ('' if none)."""
        if not self.violated:
            return ""
        where = f" at step {self.step}" if self.step is not None else ""
        against = (
            "the credit audit's summed parts Σ g_S (the gradient of credit_terms(batch).terms.sum())"
            if self.source == "credit_parts"
            else f"the gradient `{self.source}` read before the step"
        )
        head = (
            f"step conservation violated{where}: the update the optimizer applied, (θ_before − θ_after)/η, differs "
            f"from {against} by a relative error of {self.relative_error:.3g}, above the precision floor "
            f"{self.update_precision_floor:.2g} and the tolerance {self.tolerance:.2g}."
        )
        c = self.scale
        fit = _scaled_residual(self.relative_error, c)
        # A multiple of Σ g_S: scaling removes most of the error (what is left is within 10% of it, or the floor).
        multiple = (
            math.isfinite(c) and abs(c - 1.0) > 0.05 and fit <= 0.1 * self.relative_error + self.update_precision_floor
        )
        if self.source == "credit_parts" and multiple:
            cause = (
                f" The applied update is {c:.4g} × Σ g_S: the loss the trainer backpropagated is {c:.4g} × terms.sum() "
                "(a wrong normaliser, or a loss scaled after credit_terms)."
            )
        elif self.source == "credit_parts":
            cause = (
                " The applied update is not a multiple of Σ g_S: a term of the loss is missing from `terms` (a KL, "
                "entropy or auxiliary term), or something changed `.grad` after it was read."
            )
        else:
            cause = " Something changed `.grad` or the parameters between the read and the update, or the step is not plain SGD."
        fix = (
            " Fix: build the loss as `loss = self.credit_terms(batch).terms.sum()`, with every term of the objective in "
            "`terms` at the position it comes from."
            if self.source == "credit_parts"
            else " Fix: leave `.grad` alone after backward on the steps you check."
        )
        return head + cause + fix

    def __bool__(self) -> bool:  # a reading was made (a Refusal is falsy)
        return True

    def to_dict(self, prefix: str = "conservation/") -> dict[str, float]:
        """Flat scalars for loggers (names in docs/metrics.md)."""
        return {
            f"{prefix}error": float(self.relative_error),
            f"{prefix}floor": float(self.update_precision_floor),
            f"{prefix}limited": 1.0 if self.update_precision_limited else 0.0,
            f"{prefix}holds": 1.0 if self.holds else 0.0,
            f"{prefix}violated": 1.0 if self.violated else 0.0,
            f"{prefix}refused": 0.0,
            f"{prefix}grad_norm": float(self.grad_norm),
            f"{prefix}update_norm": float(self.update_norm),
        }

    def render(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        lrs = ", ".join(f"{x:.3g}" for x in self.lrs)
        status = self.status
        if status == "holds within precision":
            verdict = (
                f"HOLDS WITHIN PRECISION: the error is under the floor ({self.dtype} parameters"
                f"{', and the audit parts rounding' if self.parts_floor else ''}), which is coarser than the tolerance "
                f"{self.tolerance:.1e}: no evidence of a violation"
            )
        elif status == "holds":
            bound = (
                ("floor", self.update_precision_floor)
                if self.update_precision_limited
                else ("tolerance", self.tolerance)
            )
            verdict = f"HOLDS (error <= {bound[0]} {bound[1]:.1e})"
        else:
            verdict = f"VIOLATED (error > floor and > tolerance {self.tolerance:.1e})"
        return "\n".join(
            [
                f"step conservation{where}: (θ_before − θ_after)/η against {self.source}",
                f"  relative_error          {self.relative_error:.3e}",
                f"  update_precision_floor  {self.update_precision_floor:.3e}"
                + (f" (audit parts {self.parts_floor:.2e})" if self.parts_floor else ""),
                f"  update_precision_limited {self.update_precision_limited}",
                f"  ||g|| {self.grad_norm:.4e}  ||Δθ|| {self.update_norm:.4e}  ||θ_after|| {self.param_norm:.4e}",
                f"  lr per group [{lrs}]  {self.n_tensors} tensors ({self.n_without_grad} without gradient)",
                f"  {verdict}",
            ]
        )


def _scaled_residual(relative_error: float, c: float) -> float:
    """``min_c ||Δθ/η − c·g|| / ||g||`` from the error at ``c = 1`` and the best ``c`` (Pythagoras)."""
    if not math.isfinite(c):
        return float("inf")
    return math.sqrt(max(relative_error**2 - (c - 1.0) ** 2, 0.0))


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return v


def trainer_preconditions(
    purpose: str, gradient_clip_val: Optional[float], accumulate_grad_batches: int, step_skipped: bool, remedy: str
) -> Optional[Refusal]:
    """The trainer's settings a reading of the applied update needs (``purpose``: e.g. "for probe credit"):
    no clipping, no accumulation, a step that was taken; the first one broken as a :class:`Refusal`, else None."""
    if gradient_clip_val is not None and gradient_clip_val != 0:
        return Refusal(
            "gradient_clip_val",
            f"`gradient_clip_val` must be None or 0 {purpose}, got {gradient_clip_val!r}: "
            "clipping rescales the gradient after it is read.",
            numbers={"gradient_clip_val": gradient_clip_val},
            remedy=remedy,
        )
    if accumulate_grad_batches != 1:
        return Refusal(
            "accumulate_grad_batches",
            f"`accumulate_grad_batches` must be 1 {purpose}, got {accumulate_grad_batches!r}: "
            "the step applies gradients of batches the reading did not see.",
            numbers={"accumulate_grad_batches": accumulate_grad_batches},
            remedy=remedy,
        )
    if step_skipped:
        return Refusal(
            "step_skipped",
            "the optimizer step was skipped (the GradScaler found inf/NaN gradients), so there is no update to read.",
            numbers={"step_skipped": 1},
            remedy="nothing to do: the next step that is taken is read as usual.",
        )
    return None


def exact_optimizer_precondition(
    optimizer: Any,
    *,
    gradient_clip_val: Optional[float] = None,
    accumulate_grad_batches: int = 1,
    step_skipped: bool = False,
) -> Union[tuple[bool, str], Refusal]:
    """Whether ``θ_after = θ_before − η·g`` holds for the step this configuration takes.

    The exact set: ``type(optimizer) is torch.optim.SGD`` with ``momentum == 0``, ``weight_decay == 0``,
    ``nesterov is False`` and ``maximize is False`` in every param group; no gradient clipping
    (``gradient_clip_val`` None or 0); ``accumulate_grad_batches == 1``; the step was not skipped (a
    16-mixed GradScaler skips steps whose gradients overflowed). Subclasses of SGD are refused: their
    ``step`` may do anything.

    Args:
        optimizer: the optimizer that takes the step (unwrapped: a ``torch.optim.Optimizer``).
        gradient_clip_val: the trainer's clipping value (None or 0: no clipping).
        accumulate_grad_batches: batches whose gradients are summed into one step.
        step_skipped: whether the step was skipped (e.g. the GradScaler found inf/NaN).

    Returns:
        ``(True, description)`` or a :class:`Refusal` naming the first broken condition and its value.

    Example:
        >>> p = [torch.nn.Parameter(torch.zeros(2))]
        >>> exact_optimizer_precondition(torch.optim.SGD(p, lr=0.1))[0]
        True
        >>> exact_optimizer_precondition(torch.optim.SGD(p, lr=0.1, momentum=0.9)).condition
        'momentum'
        >>> exact_optimizer_precondition(torch.optim.Adam(p)).condition
        'optimizer'
    """
    kind = type(optimizer)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind is not torch.optim.SGD:
        why = (
            f"a subclass of torch.optim.SGD ({name}); its step may differ from plain gradient descent"
            if isinstance(optimizer, torch.optim.SGD)
            else f"{name}, whose update is not θ − η·g"
        )
        return Refusal(
            "optimizer",
            f"`optimizer` must be torch.optim.SGD for the step to conserve, got {why}.",
            numbers={"optimizer": name},
            remedy=_REMEDY,
        )
    # nesterov first: torch only accepts it with momentum > 0, and it is the more specific break.
    checks = (("nesterov", False), ("momentum", 0.0), ("weight_decay", 0.0), ("maximize", False))
    for i, group in enumerate(optimizer.param_groups):
        for key, want in checks:
            value = _scalar(group.get(key, want))
            if value != want:
                return Refusal(
                    key,
                    f"`{key}` must be {want!r} in every param group for the step to conserve, got {value!r} "
                    f"in param group {i}.",
                    numbers={"param_group": i, key: value},
                    remedy=_REMEDY,
                )
    refused = trainer_preconditions(
        "for the step to conserve", gradient_clip_val, accumulate_grad_batches, step_skipped, _REMEDY
    )
    if refused is not None:
        return refused
    lrs = [_scalar(g["lr"]) for g in optimizer.param_groups]
    return True, f"torch.optim.SGD, {len(lrs)} param group(s), lr {lrs}, no clipping, no accumulation"


def _f64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    return t.to(torch.float64)


def step_conservation(
    theta_before: Sequence[torch.Tensor],
    theta_after: Sequence[torch.Tensor],
    lr: Union[float, Sequence[float]],
    grad: Sequence[Optional[torch.Tensor]],
    *,
    group_index: Optional[Sequence[int]] = None,
    precondition: Union[tuple[bool, str], Refusal, None] = None,
    tolerance: float = 1e-4,
    source: str = "grad",
    step: Optional[int] = None,
    parts_error: Optional[float] = None,
    parts_dtype: Optional[torch.dtype] = None,
) -> Union[ConservationReading, Refusal]:
    r"""Read one optimizer step against the gradient ``g`` it should have applied.

    ``relative_error = ||(θ_before − θ_after) ⊘ η − g|| / ||g||`` in float64, ``η`` per param group.
    Entries whose ``grad`` is None are parameters the optimizer must leave alone (frozen, or no
    gradient this step): their expected update is zero and any movement counts as error.

    Args:
        theta_before: parameter tensors before the step (copies).
        theta_after: the same tensors after the step.
        lr: one learning rate, or one per param group (see ``group_index``).
        grad: the gradient held against, one entry per tensor (None: no gradient).
        group_index: param group of each tensor (default: all in group 0).
        precondition: the result of :func:`exact_optimizer_precondition`; a Refusal is returned as is.
        tolerance: relative error under which a resolvable reading holds.
        source: what ``g`` is (``"credit_parts"``, ``"grad"``), for the report.
        step: the step index, for the report.
        parts_error: when ``grad`` is an audit's ``Σ g_S``, that audit's ``conservation_error``; with
            ``parts_dtype`` (the dtype the parts were computed in, e.g. ``torch.bfloat16`` under autocast) it
            joins the floor as :func:`parts_precision_floor`.
        parts_dtype: see ``parts_error``.

    Returns:
        A :class:`ConservationReading`, or a :class:`Refusal` when the reading cannot be made (refused
        precondition, a learning rate that is not positive and finite, a zero or non-finite gradient).

    Example:
        >>> before = [torch.tensor([1.0, 2.0], dtype=torch.float64)]
        >>> g = [torch.tensor([0.5, -0.25], dtype=torch.float64)]
        >>> after = [before[0] - 0.5 * g[0]]
        >>> r = step_conservation(before, after, 0.5, g)
        >>> r.relative_error, r.update_precision_limited
        (0.0, True)
    """
    if isinstance(precondition, Refusal):
        return precondition
    n = len(theta_before)
    if len(theta_after) != n or len(grad) != n:
        raise ValueError(
            f"`theta_before`, `theta_after` and `grad` must hold one entry per tensor, got lengths "
            f"{n}, {len(theta_after)}, {len(grad)}."
        )
    if group_index is None:
        group_index = [0] * n
    if len(group_index) != n:
        raise ValueError(f"`group_index` must hold one group per tensor ({n}), got {len(group_index)}.")
    lrs = [float(_scalar(lr))] if isinstance(lr, (int, float, torch.Tensor)) else [float(_scalar(x)) for x in lr]
    used_groups = sorted(set(int(i) for i in group_index))
    if used_groups and (used_groups[0] < 0 or used_groups[-1] >= len(lrs)):
        raise ValueError(f"`group_index` must lie in 0 .. {len(lrs) - 1} (one lr per group), got {used_groups}.")
    for i in used_groups:
        if not (math.isfinite(lrs[i]) and lrs[i] > 0):
            return Refusal(
                "lr",
                f"the learning rate must be positive and finite to read Δθ/η, got {lrs[i]!r} in param group {i}.",
                numbers={"param_group": i, "lr": lrs[i]},
                remedy="skip steps with lr = 0 (e.g. the first warm-up step).",
            )
    if n == 0:
        return Refusal("no_parameters", "the optimizer holds no parameters, so there is no update to read.")

    for t in theta_after:
        if t.dtype not in UNIT_ROUNDOFF:
            return Refusal("dtype", f"parameters must be floating point to read an update, got {t.dtype}.")
    dtypes = {t.dtype for t, g in zip(theta_after, grad) if g is not None} or {t.dtype for t in theta_after}
    dtype = max(dtypes, key=lambda d: UNIT_ROUNDOFF[d])  # the coarsest, for the report and the `+ 2u` term
    u = UNIT_ROUNDOFF[dtype]

    # Per tensor: [‖r‖², ‖g‖², ‖Δθ‖², ‖θ_after‖², u_i²‖θ_after‖²/η², <r, g>] as float64 tensors, read back with one sync.
    sums: list[torch.Tensor] = []
    n_without = 0
    for tb, ta, g, gi in zip(theta_before, theta_after, grad, group_index):
        if tuple(tb.shape) != tuple(ta.shape):
            raise ValueError(
                f"`theta_before` and `theta_after` must match in shape, got {list(tb.shape)} and {list(ta.shape)}."
            )
        eta = lrs[int(gi)]
        a = _f64(ta).reshape(-1)  # [n]
        r = _f64(tb).reshape(-1).to(a.device) - a  # [n] Δθ; exact for nearby floats
        upd = torch.dot(r, r)
        r.div_(eta)  # Δθ/η
        if g is None:
            n_without += 1
            zero = torch.zeros((), dtype=torch.float64, device=a.device)
            sums.append(torch.stack([torch.dot(r, r), zero, upd, zero, zero, zero]))
            continue
        g64 = _f64(g).to(a.device)
        if g64.numel() != r.numel() or tuple(g64.shape) != tuple(ta.shape):
            raise ValueError(
                f"`grad` entries must match their parameter's shape, got {list(g64.shape)} for {list(ta.shape)}."
            )
        g64 = g64.reshape(-1)  # [n]
        r.sub_(g64)  # Δθ/η − g
        a_sq = torch.dot(a, a)
        u_i = UNIT_ROUNDOFF[ta.dtype]  # each tensor is rounded in its own dtype
        sums.append(
            torch.stack([torch.dot(r, r), torch.dot(g64, g64), upd, a_sq, a_sq * (u_i / eta) ** 2, torch.dot(r, g64)])
        )
    dev = sums[0].device
    res_sq, g_sq, upd_sq, after_sq, par_sq, rg = (float(x) for x in torch.stack([t.to(dev) for t in sums]).sum(0).cpu())

    g_norm, res_norm, upd_norm = math.sqrt(g_sq), math.sqrt(res_sq), math.sqrt(upd_sq)
    if not (math.isfinite(g_norm) and math.isfinite(res_norm)):
        return Refusal(
            "not_finite",
            "the gradient or the update is not finite, so the relative error is undefined.",
            numbers={"grad_norm": g_norm, "update_norm": upd_norm},
        )
    if g_norm == 0.0:
        return Refusal(
            "zero_gradient",
            "the gradient held against is zero, so the relative error is undefined.",
            numbers={"grad_norm": 0.0, "update_norm": upd_norm},
        )
    error = res_norm / g_norm
    parts_floor = parts_precision_floor(parts_error, parts_dtype) if source == "credit_parts" else 0.0
    floor = math.sqrt(par_sq) / g_norm + 2.0 * u + parts_floor
    return ConservationReading(
        relative_error=error,
        update_precision_floor=floor,
        update_precision_limited=bool(error <= floor),
        dtype=str(dtype).replace("torch.", ""),
        source=source,
        tolerance=float(tolerance),
        grad_norm=g_norm,
        update_norm=upd_norm,
        param_norm=math.sqrt(after_sq),
        lrs=tuple(lrs),
        n_tensors=n,
        n_without_grad=n_without,
        step=step,
        parts_floor=parts_floor,
        scale=1.0 + rg / g_sq,  # <Δθ/η, g>/‖g‖² = 1 + <Δθ/η − g, g>/‖g‖²
    )
