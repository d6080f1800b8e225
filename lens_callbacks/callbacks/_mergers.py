"""Callbacks that change ``.grad`` before the optimizer step (a "merger", e.g. ``AnchorProjectionCallback``).

Lightning calls ``on_before_optimizer_step`` in callback-list order, so what another callback sees in
``.grad`` depends on where it is listed. A merger exposes ``merges_grad`` (it may change ``.grad``),
``merged_at(step)`` (it did at that step), ``keep_pre_merge`` (keep a copy of ``.grad`` before merging)
and ``pre_merge_grads`` (that copy, by parameter name). With these, the readings are the same wherever
the callbacks are listed:

- the credit audit describes the gradient the module produced (before any merger) and says when the
  applied gradient differed (``credit/applied_grad_differs``);
- the conservation check refuses a merged step by name (``merged_by=<class>``) instead of holding the
  update against a gradient the optimizer did not apply.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["grad_mergers", "merger_at", "pre_merge_reference"]


def grad_mergers(trainer: Any, keep_pre_merge: bool = False) -> list[Any]:
    """The callbacks of ``trainer`` that may change ``.grad``; ``keep_pre_merge`` asks them to keep a copy."""
    out = []
    for cb in getattr(trainer, "callbacks", None) or ():
        if getattr(cb, "merges_grad", False) is True and callable(getattr(cb, "merged_at", None)):
            if keep_pre_merge:
                cb.keep_pre_merge = True
            out.append(cb)
    return out


def merger_at(mergers: list[Any], step: int) -> Optional[Any]:
    """The first of ``mergers`` that changed ``.grad`` at ``step``, or None."""
    for cb in mergers:
        if cb.merged_at(step):
            return cb
    return None


def pre_merge_reference(mergers: list[Any], named_params: Any, step: int) -> Optional[dict[str, Any]]:
    """``.grad`` as the module produced it at ``step`` (name -> tensor), when a merger already changed it.

    None when no merger has merged this step yet: then the live ``.grad`` is the module's own gradient.
    """
    cb = merger_at(mergers, step)
    if cb is None or getattr(cb, "pre_merge_grads", None) is None:
        return None
    pre = cb.pre_merge_grads
    return {n: pre.get(n, p.grad) for n, p in named_params}
