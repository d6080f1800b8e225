"""The one interface between a LightningModule (or any ``nn.Module``) and the instruments.

A module opts in by implementing :class:`CreditSource`::

    def credit_terms(self, batch) -> CreditTerms: ...

``credit_terms`` re-runs the forward pass on the rollout batch the module trained on this step (the
module caches it in ``training_step``; it never re-samples) and returns the per-position objective
terms whose sum is the loss it backpropagates.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["CreditTerms", "CreditSource", "is_credit_source", "CreditTermsError", "validate_terms", "cat_terms"]


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
        rollout: ``[B]`` int, the rollout id of each row (unique per row within a step); or ``[B, T]``, one
            id per position, for rows that pack several rollouts (``-1`` where no rollout: padding), with
            attention kept inside each (see :func:`~lens_callbacks.credit.inputs.partition.packed_rollouts`).
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
        micro_batch: optional ``[B]`` int, the micro-batch of the optimizer step each row came from; set by
            :func:`cat_terms` when an accumulated step's micro-batches are read as one batch (rollout ids
            that repeat across micro-batches are then told apart, see ``by_rollout``).
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
    micro_batch: Optional[torch.Tensor] = None  # [B]

    # No __post_init__ check: constructing the terms inside `training_step` (``loss =
    # self.credit_terms(batch).terms.sum()``) must never end a training run. The audit validates them
    # (:func:`validate_terms`) and turns a broken contract into a named Refusal.

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
        """Raise :class:`CreditTermsError` naming the first field that breaks the contract.

        Construction never checks (it runs inside the training step); every audit calls this before it
        reads the terms, and an audit turns the error into a :class:`~lens_callbacks.refusal.Refusal`.
        """
        t = self.terms
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise CreditTermsError(
                "terms",
                f"`terms` must be a [B, T] float tensor, got {_describe(t)}. Return one objective term per "
                "(row, position); pad rows to a common length.",
            )
        if not t.is_floating_point():
            raise CreditTermsError("terms", f"`terms` must be floating point, got dtype {t.dtype}.")
        B, T = t.shape
        tr = self.trained
        if not isinstance(tr, torch.Tensor) or tr.dim() != 2:
            raise CreditTermsError(
                "trained", f"`trained` must be a [B, T] = [{B}, {T}] bool tensor, got {_describe(tr)}."
            )
        if tuple(tr.shape) != (B, T):
            wrong = _odd_one_out(self, tuple(t.shape), tuple(tr.shape))
            numbers = {"terms_shape": str(list(t.shape)), "trained_shape": str(list(tr.shape))}
            if wrong == "terms":
                raise CreditTermsError(
                    "terms",
                    f"`terms` must have the shape of `trained` [B, T] = {list(tr.shape)} (which the other fields agree "
                    f"with), got {list(t.shape)}. Return one term per (row, position) of the batch, including the "
                    "zeros at untrained positions.",
                    numbers,
                )
            raise CreditTermsError(
                "trained",
                f"`trained` must have the shape of `terms` [B, T] = {list(t.shape)}, got {list(tr.shape)}. Build the "
                "mask on the positions the terms are on (e.g. shift it with the log-probabilities: "
                "`mask[:, 1:]` beside `logits[:, :-1]`).",
                numbers,
            )
        if tr.dtype != torch.bool:
            raise CreditTermsError("trained", f"`trained` must be bool, got dtype {tr.dtype}; use `mask.bool()`.")
        for name in ("rollout", "group"):
            v = getattr(self, name)
            packed = name == "rollout" and isinstance(v, torch.Tensor) and tuple(v.shape) == (B, T)
            if not isinstance(v, torch.Tensor) or (tuple(v.shape) != (B,) and not packed):
                shapes = f"[B] = [{B}]" + (f" (or [B, T] = [{B}, {T}] for packed rows)" if name == "rollout" else "")
                raise CreditTermsError(name, f"`{name}` must be a {shapes} int tensor, got {_describe(v)}.")
            if v.is_floating_point() or v.dtype == torch.bool:
                raise CreditTermsError(name, f"`{name}` must be an integer tensor, got dtype {v.dtype}.")
        if self.segment is not None:
            s = self.segment
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != (B, T):
                raise CreditTermsError(
                    "segment", f"`segment` must be a [B, T] = [{B}, {T}] int tensor or None, got {_describe(s)}."
                )
            if s.is_floating_point() or s.dtype == torch.bool:
                raise CreditTermsError("segment", f"`segment` must be an integer tensor, got dtype {s.dtype}.")
        if self.rewards is not None and (
            not isinstance(self.rewards, torch.Tensor) or tuple(self.rewards.shape) != (B,)
        ):
            raise CreditTermsError(
                "rewards", f"`rewards` must be a [B] = [{B}] float tensor or None, got {_describe(self.rewards)}."
            )
        mb = self.micro_batch
        if mb is not None and (
            not isinstance(mb, torch.Tensor)
            or tuple(mb.shape) != (B,)
            or mb.is_floating_point()
            or mb.dtype == torch.bool
        ):
            raise CreditTermsError(
                "micro_batch", f"`micro_batch` must be a [B] = [{B}] int tensor or None, got {_describe(mb)}."
            )
        if self.tokens is not None and (
            not isinstance(self.tokens, torch.Tensor) or tuple(self.tokens.shape) != (B, T)
        ):
            raise CreditTermsError(
                "tokens", f"`tokens` must be a [B, T] = [{B}, {T}] int tensor or None, got {_describe(self.tokens)}."
            )
        # The contract says untrained positions hold exactly 0: a non-zero there would enter g_full and no part.
        # A non-finite value there makes the loss non-finite, which the audit reports as such.
        d = t.detach()
        stray = (d != 0) & torch.isfinite(d) & ~tr.to(t.device)  # [B, T]
        if bool(stray.any()):
            n = int(stray.sum())
            pos = [tuple(p) for p in stray.nonzero()[:5].tolist()]
            raise CreditTermsError(
                "terms",
                f"`terms` must be exactly 0 at untrained positions, got {n} non-zero untrained position(s), e.g. "
                f"(row, t) = {pos}. Mask the terms: `torch.where(trained, terms, torch.zeros_like(terms))` (an "
                "unmasked KL or entropy term is the usual cause), or mark those positions trained.",
                {"untrained_nonzero": n, "first_positions": str(pos)},
            )
        self._validate_row_labels(B)

    def _validate_row_labels(self, B: int) -> None:
        """Check the optional per-row labels that the stable-name partitions read."""
        a = self.advantages
        if a is not None and (not isinstance(a, torch.Tensor) or tuple(a.shape) != (B,) or not a.is_floating_point()):
            raise CreditTermsError(
                "advantages", f"`advantages` must be a [B] = [{B}] float tensor or None, got {_describe(a)}."
            )
        s = self.source
        if s is not None:
            if (
                not isinstance(s, torch.Tensor)
                or tuple(s.shape) != (B,)
                or s.is_floating_point()
                or s.dtype == torch.bool
            ):
                raise CreditTermsError(
                    "source", f"`source` must be a [B] = [{B}] int tensor or None, got {_describe(s)}."
                )
            if s.numel() and int(s.min()) < 0:
                raise CreditTermsError("source", f"`source` ids must be >= 0, got a minimum of {int(s.min())}.")
            n = self.source_names
            if n is not None and s.numel() and int(s.max()) >= len(n):
                raise CreditTermsError(
                    "source",
                    f"`source` ids must index `source_names` ({len(n)} names), got an id of {int(s.max())}; "
                    "add the missing names or pass source_names=None.",
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


def validate_terms(terms: Any) -> CreditTerms:
    """The one check every audit makes of what ``credit_terms`` returned; returns it, or raises.

    Raises ``TypeError`` when it is not a :class:`CreditTerms` and :class:`CreditTermsError` (naming the
    field) when a field breaks the contract. Callers that must not stop training turn the error into a
    :class:`~lens_callbacks.refusal.Refusal` (condition ``credit_terms.<field>``).
    """
    if not isinstance(terms, CreditTerms):
        raise TypeError(
            f"`credit_terms` must return a CreditTerms, got {type(terms).__name__}; return "
            "CreditTerms(terms, trained, rollout, group) (see lens_callbacks.credit.inputs.terms)."
        )
    terms.validate()
    return terms


def cat_terms(parts: Sequence[CreditTerms]) -> CreditTerms:
    """The terms of several micro-batches of one step as one batch: rows stacked in order, positions padded
    to the longest (padding is untrained, its terms zero, its segment ``-1``).

    An optional field is kept when every micro-batch has it; the name tuples (``segment_names``,
    ``source_names``) must then be the same in all. Each part must already be valid (:func:`validate_terms`).
    ``micro_batch`` numbers the rows by the part they came from.
    """
    if not parts:
        raise ValueError("`parts` must hold at least one CreditTerms, got none.")
    if len(parts) == 1:
        return parts[0]
    T = max(int(p.terms.shape[1]) for p in parts)

    def pad(x: torch.Tensor, value: Any) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

    def rows(name: str, value: Any = None) -> Optional[torch.Tensor]:
        xs = [getattr(p, name) for p in parts]
        if any(x is None for x in xs):
            return None
        return torch.cat([x if value is None else pad(x, value) for x in xs])

    def names(name: str) -> Optional[tuple[str, ...]]:
        ns = {getattr(p, name) for p in parts}
        if len(ns) > 1:
            raise ValueError(f"`{name}` must be the same in every micro-batch, got {sorted(map(str, ns))!r}.")
        return ns.pop()

    texts = [p.text for p in parts]
    return CreditTerms(
        terms=rows("terms", 0.0),  # [B, T]
        trained=rows("trained", False),  # [B, T]
        rollout=_rollouts([p.rollout for p in parts], pad),  # [B] or [B, T]
        group=rows("group"),  # [B]
        segment=rows("segment", -1),
        segment_names=names("segment_names"),
        rewards=rows("rewards"),
        tokens=rows("tokens", 0),
        advantages=rows("advantages"),
        source=rows("source"),
        source_names=names("source_names"),
        text=None if any(t is None for t in texts) else tuple(x for t in texts for x in t),
        micro_batch=torch.cat(
            [
                torch.full((int(p.terms.shape[0]),), j, dtype=torch.long, device=p.rollout.device)
                for j, p in enumerate(parts)
            ]
        ),
    )


def _rollouts(xs: Sequence[torch.Tensor], pad: Any) -> torch.Tensor:
    """The micro-batches' rollout ids stacked: ``[B]``, or ``[B, T]`` (padded with -1) when any is packed."""
    if all(x.dim() == 1 for x in xs):
        return torch.cat(xs)
    if not all(x.dim() == 2 for x in xs):
        raise ValueError("`rollout` must be [B] in every micro-batch or [B, T] in every one, got both kinds.")
    return torch.cat([pad(x, -1) for x in xs])


def _odd_one_out(ct: CreditTerms, terms_shape: tuple, trained_shape: tuple) -> str:
    """Which of ``terms`` and ``trained`` is wrong when their shapes differ: the one the other fields disagree with.

    The other ``[B, T]`` fields (``segment``, ``tokens``) and the ``[B]`` row labels vote; with no vote either
    way the mask is blamed, since ``terms`` is what the module backpropagates and the mask describes it.
    """
    votes = {"terms": 0, "trained": 0}  # votes *against* each field
    for other in (ct.segment, ct.tokens):
        if isinstance(other, torch.Tensor) and other.dim() == 2:
            shape = tuple(other.shape)
            if shape == trained_shape and shape != terms_shape:
                votes["terms"] += 1
            elif shape == terms_shape and shape != trained_shape:
                votes["trained"] += 1
    for label in (ct.rollout, ct.group):
        if isinstance(label, torch.Tensor) and label.dim() == 1 and terms_shape[0] != trained_shape[0]:
            rows = label.shape[0]
            if rows == trained_shape[0]:
                votes["terms"] += 1
            elif rows == terms_shape[0]:
                votes["trained"] += 1
    return "terms" if votes["terms"] > votes["trained"] else "trained"


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {list(v.shape)} and dtype {v.dtype}"
    return repr(v) if not hasattr(v, "__len__") else f"{type(v).__name__} {v!r}"[:120]
