r"""An accumulated optimizer step, replayed: every micro-batch's ``credit_terms`` as one batch.

With gradient accumulation (``accumulate_grad_batches = k``) one optimizer step is ``k`` forward and
backward passes, and ``.grad`` holds the sum of ``∇ loss_j / k``. A reading of the step must split all
of it, so each micro-batch is kept as it trained — the batch handed to ``training_step`` and the
module's own attributes right after it (``credit_terms`` typically reads a rollout batch that
``training_step`` cached, which the next micro-batch replaces) — and the audit replays them all:

    terms(θ) = cat_j( credit_terms_j(θ) ) / k

where ``credit_terms_j`` runs with micro-batch ``j``'s attributes restored. The parameters do not change
inside the window, so these are the very functions the step differentiated, and every engine reads them
as one batch (the one-pass engine stacks each layer's calls, :func:`~lens_callbacks.credit.engines.ghost.batch_rows`).
``grad_match`` then holds the replayed gradient against the whole step's ``.grad``: a replay that does
not reproduce the step (state changed in place rather than replaced) is caught, not shown.

Memory: the audit's pass holds the activations of all ``k`` micro-batches at once.

Pure torch; never imports lightning.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Optional

import torch
from torch import nn

from .engines.ghost import batch_rows
from .inputs.terms import CreditTerms, cat_terms, validate_terms

__all__ = ["MicroBatch", "StepReplay", "module_state", "restored"]

#: Attributes every ``nn.Module`` holds for itself (parameters, buffers, submodules, hooks, mode): never
#: part of what a micro-batch leaves behind.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


def module_state(module: nn.Module, skip: Collection[str] = ()) -> dict[str, Any]:
    """A shallow copy of ``module``'s own attributes (what ``training_step`` may have cached), without its
    parameters, buffers, submodules, hooks and the names in ``skip``."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and k not in skip}


@contextlib.contextmanager
def restored(module: nn.Module, state: Mapping[str, Any]) -> Iterator[None]:
    """``module``'s attributes set to ``state`` inside the block (only those that differ), and back after."""
    now = vars(module)
    missing = object()
    changed = {k: now.get(k, missing) for k, v in state.items() if now.get(k, missing) is not v}
    for k in changed:
        object.__setattr__(module, k, state[k])
    try:
        yield
    finally:
        for k, v in changed.items():
            if v is missing:
                module.__dict__.pop(k, None)
            else:
                object.__setattr__(module, k, v)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of an accumulated step: the batch ``training_step`` took and the module's attributes after it."""

    batch: Any
    state: Mapping[str, Any]


class StepReplay:
    """The micro-batches of one optimizer step, kept so that an audit can read all of them.

    ``add(batch)`` after each micro-batch's backward (the module's attributes are then that micro-batch's);
    ``terms_fn()`` is a ``terms_fn`` for :func:`~lens_callbacks.credit.disintegrate` that replays every one
    and stacks their terms (divided by ``scale_by``, the trainer's accumulation count, so that ``g_full``
    is in ``.grad``'s units). Rollout ids that repeat across micro-batches become parts keyed by micro-batch
    (``by_rollout``: ``mb{j}/rollout_{id}``).

    Example:
        >>> class M(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(1))
        ...     def credit_terms(self, batch):
        ...         x = self.cached                                  # [B, 1], what training_step cached
        ...         B = x.shape[0]
        ...         return CreditTerms(x * self.w, torch.ones(B, 1, dtype=torch.bool), torch.arange(B),
        ...                            torch.zeros(B, dtype=torch.long))
        >>> m, replay = M(), StepReplay(scale_by=2)
        >>> for x in (torch.tensor([[1.0]]), torch.tensor([[3.0]])):
        ...     m.cached = x                                         # each micro-batch replaces the cache
        ...     replay.add(m, None)
        >>> replay.terms_fn(m)(None).terms.tolist()                  # both micro-batches, each / 2
        [[0.5], [1.5]]
    """

    def __init__(self, scale_by: int = 1, skip: Collection[str] = ()) -> None:
        if not isinstance(scale_by, int) or isinstance(scale_by, bool) or scale_by < 1:
            raise ValueError(f"`scale_by` must be an int >= 1 (the accumulation count), got {scale_by!r}.")
        self.scale_by = scale_by
        self.skip = frozenset(skip)
        self.micro: list[MicroBatch] = []

    def __len__(self) -> int:
        return len(self.micro)

    def add(self, module: nn.Module, batch: Any) -> None:
        """Keep one micro-batch: ``batch`` and ``module``'s attributes as they are now."""
        self.micro.append(MicroBatch(batch, module_state(module, self.skip)))

    def clear(self) -> None:
        self.micro = []

    def terms_fn(
        self, module: nn.Module, fn: Optional[Callable[[Any], CreditTerms]] = None
    ) -> Callable[[Any], CreditTerms]:
        """A ``terms_fn`` (its argument ignored) that replays every kept micro-batch through ``fn``
        (``module.credit_terms``) and returns their terms as one batch, divided by ``scale_by``."""
        if not self.micro:
            raise ValueError("`StepReplay` holds no micro-batch: call add() after each micro-batch's backward.")
        micro, scale = list(self.micro), 1.0 / self.scale_by

        def replayed(_: Any = None) -> CreditTerms:
            call = fn if fn is not None else module.credit_terms
            parts: list[CreditTerms] = []
            start = 0
            for mb in micro:
                with restored(module, mb.state), batch_rows(start) as span:
                    t = validate_terms(call(mb.batch))
                    n = int(t.terms.shape[0])
                    if n > 0:
                        span.end(start + n)
                parts.append(t)
                start += n
            whole = cat_terms(parts)
            if len(parts) == 1:  # cat_terms numbers the micro-batches only when there are several
                whole = _with(
                    whole,
                    micro_batch=torch.zeros(int(whole.terms.shape[0]), dtype=torch.long, device=whole.rollout.device),
                )
            return _with(whole, terms=whole.terms * scale) if scale != 1.0 else whole

        return replayed


def _with(t: CreditTerms, **changes: Any) -> CreditTerms:
    return dataclasses.replace(t, **changes)
