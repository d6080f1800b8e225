"""The one interface between a LightningModule (or any ``nn.Module``) and the instruments.

A module opts in by implementing :class:`CreditSource`::

    def credit_terms(self, batch) -> CreditTerms: ...

``credit_terms`` re-runs the forward pass on the rollout batch the module trained on this step (the
module caches it in ``training_step``; it never re-samples) and returns the per-position objective
terms whose sum is the loss it backpropagates.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Protocol, runtime_checkable

import torch

__all__ = ["CreditTerms", "CreditSource", "is_credit_source", "CreditTermsError"]


class CreditTermsError(ValueError):
    """A ``CreditTerms`` field breaks the contract; ``field`` names it, ``numbers`` holds what was found."""

    def __init__(self, field: str, message: str, numbers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.field = field
        self.numbers = dict(numbers or {})


@dataclass
class CreditTerms:
    """Per-position objective terms of one training step.

    Attributes:
        terms: ``[B, T]`` float, carrying the autograd graph. ``terms.sum()`` is the loss the module
            backpropagates. For on-policy GRPO ``terms[k, t] = -A_k * logπ(y_kt) * mask[k, t] / Z``;
            PPO ratio, clipping, KL or entropy contributions belong in ``terms`` too, at the position
            they come from. Positions that are not trained must hold exactly zero.
        trained: ``[B, T]`` bool, the positions that carry a trained token.
        rollout: ``[B]`` int, the rollout id of each row (unique per row within a step).
        group: ``[B]`` int, the prompt group of each row (GRPO: the rollouts of one prompt).
        segment: ``[B, T]`` int, the turn id of each position, ``-1`` where none; ``None`` when the
            module has no turn structure.
        segment_names: optional names of the segment ids (e.g. ``("user", "assistant")``).
        rewards: optional ``[B]`` float outcome reward per row (used by the process instrument).
        tokens: optional ``[B, T]`` int token id at each position (used by the process instrument).
        advantages: optional ``[B]`` float advantage of each row (used by ``by_advantage_sign``).
        source: optional ``[B]`` int label of each row: dataset, task type, difficulty (used by
            ``by_source``); ids index ``source_names`` when given.
        source_names: optional names of the source ids (e.g. ``("easy", "hard")``).
        text: optional ``[B]`` completion text of each row, shown (its start) in the credit table; without
            it the table decodes ``tokens`` with the module's ``tokenizer`` when it has one.
    """

    terms: torch.Tensor  # [B, T]
    trained: torch.Tensor  # [B, T] bool
    rollout: torch.Tensor  # [B]
    group: torch.Tensor  # [B]
    segment: Optional[torch.Tensor] = None  # [B, T]
    segment_names: Optional[tuple[str, ...]] = None
    rewards: Optional[torch.Tensor] = None  # [B]
    tokens: Optional[torch.Tensor] = None  # [B, T]
    advantages: Optional[torch.Tensor] = None  # [B]
    source: Optional[torch.Tensor] = None  # [B]
    source_names: Optional[tuple[str, ...]] = None
    text: Optional[tuple[str, ...]] = None  # [B]

    def __post_init__(self) -> None:
        self.validate()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.terms.shape)  # type: ignore[return-value]

    @property
    def n_trained(self) -> int:
        return int(self.trained.sum().item())

    def loss(self) -> torch.Tensor:
        """The loss these terms add up to (what the module backpropagates)."""
        return self.terms.sum()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that breaks the contract."""
        t = self.terms
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(
                f"`terms` must be a [B, T] float tensor, got {_describe(t)}. Return one objective term per "
                "(row, position); pad rows to a common length."
            )
        if not t.is_floating_point():
            raise ValueError(f"`terms` must be floating point, got dtype {t.dtype}.")
        B, T = t.shape
        tr = self.trained
        if isinstance(tr, torch.Tensor) and tr.dim() == 2 and tr.dtype == torch.bool and tuple(tr.shape) != (B, T):
            rows = self.rollout.shape[0] if isinstance(self.rollout, torch.Tensor) and self.rollout.dim() == 1 else None
            if rows is None or rows == tr.shape[0]:
                # `trained` is a well-formed mask that agrees with the rows: the computed terms are the odd one out.
                raise CreditTermsError(
                    "terms",
                    f"`terms` must have the shape of `trained` [B, T] = {list(tr.shape)}, got {list(t.shape)}. Return one "
                    "term per (row, position) of the batch, including the zeros at untrained positions.",
                    {"terms_shape": str(list(t.shape)), "trained_shape": str(list(tr.shape))},
                )
        if not isinstance(tr, torch.Tensor) or tuple(tr.shape) != (B, T):
            raise CreditTermsError("trained", f"`trained` must be a [B, T] = [{B}, {T}] bool tensor, got {_describe(tr)}.")
        if self.trained.dtype != torch.bool:
            raise ValueError(f"`trained` must be bool, got dtype {self.trained.dtype}; use `mask.bool()`.")
        for name in ("rollout", "group"):
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (B,):
                raise ValueError(f"`{name}` must be a [B] = [{B}] int tensor, got {_describe(v)}.")
            if v.is_floating_point() or v.dtype == torch.bool:
                raise ValueError(f"`{name}` must be an integer tensor, got dtype {v.dtype}.")
        if self.segment is not None:
            s = self.segment
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != (B, T):
                raise ValueError(f"`segment` must be a [B, T] = [{B}, {T}] int tensor or None, got {_describe(s)}.")
            if s.is_floating_point() or s.dtype == torch.bool:
                raise ValueError(f"`segment` must be an integer tensor, got dtype {s.dtype}.")
        if self.rewards is not None and (not isinstance(self.rewards, torch.Tensor) or tuple(self.rewards.shape) != (B,)):
            raise ValueError(f"`rewards` must be a [B] = [{B}] float tensor or None, got {_describe(self.rewards)}.")
        if self.tokens is not None and (not isinstance(self.tokens, torch.Tensor) or tuple(self.tokens.shape) != (B, T)):
            raise ValueError(f"`tokens` must be a [B, T] = [{B}, {T}] int tensor or None, got {_describe(self.tokens)}.")
        # The contract says untrained positions hold exactly 0: a non-zero there would enter g_full and no part.
        # (A value check costs one device sync per construction.)
        # A non-finite value there makes the loss non-finite, which the audit reports as such.
        d = t.detach()
        stray = (d != 0) & torch.isfinite(d) & ~self.trained.to(t.device)  # [B, T]
        if bool(stray.any()):
            n = int(stray.sum())
            pos = [tuple(p) for p in stray.nonzero()[:5].tolist()]
            raise CreditTermsError(
                "terms",
                f"`terms` must be exactly 0 at untrained positions, got {n} non-zero untrained position(s), e.g. "
                f"(row, t) = {pos}. Mask the terms: `torch.where(trained, terms, torch.zeros_like(terms))`, or mark "
                "those positions trained.",
                {"untrained_nonzero": n, "first_positions": str(pos)},
            )
        self._validate_row_labels(B)

    def _validate_row_labels(self, B: int) -> None:
        """Check the optional per-row labels that the stable-name partitions read."""
        a = self.advantages
        if a is not None and (not isinstance(a, torch.Tensor) or tuple(a.shape) != (B,) or not a.is_floating_point()):
            raise ValueError(f"`advantages` must be a [B] = [{B}] float tensor or None, got {_describe(a)}.")
        s = self.source
        if s is not None:
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != (B,) or s.is_floating_point() or s.dtype == torch.bool:
                raise ValueError(f"`source` must be a [B] = [{B}] int tensor or None, got {_describe(s)}.")
            if s.numel() and int(s.min()) < 0:
                raise ValueError(f"`source` ids must be >= 0, got a minimum of {int(s.min())}.")
            n = self.source_names
            if n is not None and s.numel() and int(s.max()) >= len(n):
                raise ValueError(
                    f"`source` ids must index `source_names` ({len(n)} names), got an id of {int(s.max())}; "
                    "add the missing names or pass source_names=None."
                )

    def detached(self) -> "CreditTerms":
        """A copy without the autograd graph (for records and logging)."""
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.detach() if isinstance(v, torch.Tensor) else v
        return CreditTerms(**kw)


@runtime_checkable
class CreditSource(Protocol):
    """What a module implements to be audited."""

    def credit_terms(self, batch: Any) -> CreditTerms: ...


def is_credit_source(module: Any) -> bool:
    return callable(getattr(module, "credit_terms", None))


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {list(v.shape)} and dtype {v.dtype}"
    return repr(v) if not hasattr(v, "__len__") else f"{type(v).__name__} {v!r}"[:120]
