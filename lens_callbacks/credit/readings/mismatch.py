"""When the audited terms are not the loss the trainer backpropagated: the threshold and the words.

``grad_match = ‖g_full − .grad‖ / ‖g_full‖`` compares the gradient of ``credit_terms(batch).terms.sum()``
with the gradient the trainer applied. Rounding in the coarsest dtype either side computed in explains
up to a few unit roundoffs; above :func:`grad_match_threshold` the terms are not the loss, and every
reading of the step describes the terms rather than the step that was taken.

Pure torch; it never imports lightning.
"""

from __future__ import annotations

from typing import Optional

import torch

from .conservation import UNIT_ROUNDOFF

__all__ = ["grad_match_threshold", "terms_not_loss_words", "GRAD_MATCH_ROUNDING_UNITS"]

#: ``grad_match`` up to this many unit roundoffs of the coarsest dtype in play is rounding.
GRAD_MATCH_ROUNDING_UNITS = 16.0


def grad_match_threshold(*dtypes: Optional[torch.dtype]) -> float:
    """The largest ``grad_match`` rounding explains: ``max(1e-4, 16·u)`` for the coarsest of ``dtypes``.

    Example:
        >>> grad_match_threshold(torch.float32), grad_match_threshold(torch.float32, torch.bfloat16)
        (0.0001, 0.0625)
    """
    u = max((UNIT_ROUNDOFF.get(d, 0.0) for d in dtypes if d is not None), default=0.0)
    return max(1e-4, GRAD_MATCH_ROUNDING_UNITS * u)


def terms_not_loss_words(grad_match: float, threshold: float, step: Optional[int] = None) -> str:
    """What was compared, the figure, the likely cause and the fix, in one paragraph.

    Example:
        >>> "grad_match = 1" in terms_not_loss_words(1.0, 1e-4, step=3)
        True
    """
    where = f" at step {step}" if step is not None else ""
    return (
        f"the audited terms are not the loss{where}: grad_match = ‖g_full − .grad‖/‖g_full‖ = {grad_match:.4g}, where "
        f"g_full is the gradient of credit_terms(batch).terms.sum() and .grad the gradient the trainer applied "
        f"(rounding explains up to {threshold:.2g}). Likely cause: the loss training_step backpropagates is not "
        "terms.sum() - a factor (grad_match = 1 for 2·terms.sum(); a normaliser other than the one in the terms), "
        "or a term of the loss (KL, entropy, auxiliary) left out of `terms`. The credit readings describe the terms, "
        "not the step that was taken. Fix: build the loss as `loss = self.credit_terms(batch).terms.sum()`, with "
        "every term of the objective in `terms` at the position it comes from."
    )
