r"""The check every credit reading passes before anyone sees it: its parts add up, or it is withheld.

A report whose ``conservation_error`` is over its floor (:attr:`CreditReport.conservation_floor`, what
rounding in its dtype explains) does not split the step it names: ``Σ_S g_S`` is not ``g_full``. Its shares
would be wrong numbers that look like right ones, so :func:`guard` turns it into a
:class:`~lens_callbacks.refusal.Refusal` that names the figure, the floor and the likely causes the caller
can tell apart (:class:`Suspects`): a compiled module, gradient accumulation, terms that are not the loss.

Pure torch; never imports lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..refusal import Refusal
from .report import CreditReport

__all__ = ["Suspects", "guard", "non_finite", "CONSERVATION"]

#: The condition a withheld reading is refused under (``conservation`` or ``conservation/<causes>``).
CONSERVATION = "conservation"


@dataclass(frozen=True)
class Suspects:
    """What the caller knows of the step that could make its parts not add up.

    Attributes:
        compiled: the module (or a submodule) is ``torch.compile``'d.
        accumulation: the optimizer step's micro-batch count (``accumulate_grad_batches``).
        terms_not_loss: ``grad_match`` is over what rounding explains (the audited terms are not the loss).
    """

    compiled: bool = False
    accumulation: int = 1
    terms_not_loss: bool = False

    def causes(self) -> tuple[str, ...]:
        out = []
        if self.compiled:
            out.append("compile")
        if self.accumulation > 1:
            out.append("accumulation")
        if self.terms_not_loss:
            out.append("terms_not_loss")
        return tuple(out)


_WORDS = {
    "compile": "the module is torch.compile'd: the audit runs it eagerly, but a compiled function called from "
    "credit_terms outside any module can still run compiled (a custom op, torch.compile on a function)",
    "accumulation": "gradient accumulation: a micro-batch's credit_terms read state that a later micro-batch "
    "changed in place, so the replay is not the step",
    "terms_not_loss": "the audited terms are not the loss (grad_match is over its threshold)",
}
_UNKNOWN = (
    "none the callback can tell: a layer or op the engine misreads (a parameter shared in a way its rules do "
    "not cover, an in-place change of an activation)"
)


def guard(report: CreditReport, suspects: Suspects = Suspects(), step: Optional[int] = None) -> Optional[Refusal]:
    """None when ``report``'s parts add up to its ``g_full`` within the floor; else the Refusal that withholds it.

    Example:
        >>> ok = CreditReport(("a", "b"), (0.5, 0.5), (0.5, 0.5), (1.0, 1.0), 1.0, 1e-9, None, "float32", 4, 2.0, 1.0)
        >>> guard(ok) is None
        True
        >>> bad = CreditReport(("a", "b"), (0.5, 0.5), (0.5, 0.5), (1.0, 1.0), 1.0, 0.17, None, "float32", 4, 2.0, 1.0)
        >>> r = guard(bad, Suspects(compiled=True), step=3)
        >>> r.condition, r.numbers["conservation_error"]
        ('conservation/compile', 0.17)
    """
    if not report.conservation_violated:
        return None
    causes = suspects.causes()
    e, floor = report.conservation_error, report.conservation_floor
    where = report.dtype if report.compute_dtype is None else f"{report.dtype} under {report.compute_dtype} autocast"
    numbers: dict = {"conservation_error": e, "conservation_floor": floor, "engine": report.engine}
    if step is not None:
        numbers = {"step": step, **numbers}
    likely = "; ".join(_WORDS[c] for c in causes) if causes else _UNKNOWN
    return Refusal(
        CONSERVATION + ("/" + "+".join(causes) if causes else ""),
        f"conservation_error = {e:.3g} is over its floor {floor:.2g} (what rounding in {where} explains, engine "
        f"{report.engine}): the parts do not add up to g_full, so these shares are not a split of this step and "
        f"are withheld. Likely cause: {likely}.",
        numbers=numbers,
        remedy="audit this step with engine='reference' and dtype='float64' to see whether the parts add up there; "
        "if they do not, report it with the module and the training mode (compile, accumulation, checkpointing)",
    )


def non_finite(report: CreditReport, step: Optional[int] = None) -> Optional[Refusal]:
    """A Refusal when the step's loss or full gradient is not finite (credit is undefined and the step itself is
    likely corrupt), else None.

    Example:
        >>> r = CreditReport(("a",), (float("nan"),), (float("nan"),), (1.0,), 1.0, 0.0, None, "float32", 1, float("nan"), 1.0)
        >>> non_finite(r, step=2).condition
        'non_finite_gradient'
    """
    if math.isfinite(report.loss) and math.isfinite(report.full_grad_norm):
        return None
    what = "loss" if not math.isfinite(report.loss) else "full gradient"
    numbers: dict = {"loss": report.loss, "full_grad_norm": report.full_grad_norm}
    if step is not None:
        numbers = {"step": step, **numbers}
    return Refusal(
        "non_finite_loss" if what == "loss" else "non_finite_gradient",
        f"the {what} of this step is not finite (loss = {report.loss!r}, ||g_full|| = {report.full_grad_norm!r}); "
        "credit is undefined and the optimizer step is likely corrupt.",
        numbers=numbers,
        remedy="find where the loss becomes non-finite (log of 0, an overflow, a division by a zero count); "
        "torch.autograd.set_detect_anomaly(True) names the operation.",
    )
