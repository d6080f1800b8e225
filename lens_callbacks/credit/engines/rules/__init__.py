r"""Per-layer rules of the one-pass engine, as a registry.

A rule covers one family of layers. It says which modules it covers (:meth:`Rule.matches`), what its
forward hook keeps beyond the layer's input ``A`` and output gradient ``B`` (:meth:`Rule.on_forward`),
and how a parameter's per-row gradient is read from them:

- :meth:`Rule.factors`: the piece as ``Σ_t L_t ⊗ R_t`` (``Linear``: ``L = B``, ``R = A``; ``Conv1D``:
  ``L = A``, ``R = B``; ``Embedding``: ``L`` the token ids as one-hot rows, ``R = B``), which the ghost
  route reads without forming any per-row piece (:mod:`..ghost_routes`);
- :meth:`Rule.pieces`: the per-part pieces themselves, ``[c, *param.shape]`` (biases, norm weights, and a
  ``Linear`` weight on the direct route);
- :meth:`Rule.positions`: positions per row, the figure the route costs are counted from.

The engine looks rules up in :data:`RULES` (the first that matches wins); :func:`register` puts a rule
for a custom layer (a fused QKV projection, a quantised Linear) first, so a new layer type is one file
with one :class:`Rule` subclass. Modules no rule covers have their parameters read by the fallback
(one masked backward per part for those parameters only).
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Protocol

import torch
from torch import nn

__all__ = [
    "Rule",
    "Use",
    "Rows",
    "Factors",
    "RULES",
    "register",
    "unregister",
    "find_rule",
    "rule_named",
    "rule_of",
    "rows_of",
    "take",
]


class Factors(NamedTuple):
    """One use's per-row piece ``Lᵀ R`` on the selected rows: ``L`` ``[r, n, d_L]`` (or, with ``index``,
    ``[r, n]`` token ids: one-hot rows of ``d_L``), ``R`` ``[r, n, d_R]``.

    With ``runs`` (set by the engine, never by a rule), ``L`` ``[N, d_L]`` (``[N]`` ids) and ``R`` ``[N, d_R]``
    hold the batch's positions flat, and row ``k`` is positions ``runs[k][0]`` to ``runs[k][0] + runs[k][1]``:
    rollouts of unequal lengths packed in rows, read in place."""

    L: torch.Tensor
    R: torch.Tensor
    index: bool
    runs: Optional[tuple[tuple[int, int], ...]] = None


class Use(Protocol):
    """One call of a covered layer, as a rule reads it (the one-pass engine's hooks capture it).

    ``a`` is the layer's first input, detached (``[B, ..., d_in]``); ``b`` the gradient at its output
    (``[B, ..., d_out]``, None until the backward reaches it); ``weight`` and ``bias`` the layer's
    parameters of those names (None where it has none). A rule may keep more on the use in
    :meth:`Rule.on_forward` (``xhat``: a norm layer's normalised input).
    """

    module: nn.Module
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    xhat: Optional[torch.Tensor]
    capture: Any

    @property
    def a(self) -> Optional[torch.Tensor]: ...

    @property
    def b(self) -> Optional[torch.Tensor]: ...

    def normalised(self) -> torch.Tensor:
        """A norm layer's ``x̂`` (kept by :meth:`Rule.on_forward`, else formed again from ``a``)."""
        ...


class Rows(Protocol):
    """The rows one chunk of parts holds, as :meth:`Rule.pieces` reads them.

    ``rp`` ``[B]``: each row's chunk-local part (−1: not in the chunk); ``sel`` ``[r]``: the rows in the
    chunk; ``dst`` ``[r]``: their chunk-local part; ``c``: the parts in the chunk; ``in_order``: one row
    per part, in order (``by_rollout``), so a row's product is its part's piece.
    """

    rp: torch.Tensor
    sel: torch.Tensor
    dst: torch.Tensor
    c: int
    in_order: bool


def rows_of(t: torch.Tensor, B: int) -> torch.Tensor:
    """``t`` seen as ``[B, n, d]`` (every leading dimension after the batch flattened into positions)."""
    return t.reshape(B, -1, t.shape[-1])  # [B, n, d]


def take(t: torch.Tensor, sel: torch.Tensor, B: int) -> torch.Tensor:
    """Rows ``sel`` of ``t`` seen as ``[B, n, d]``; no copy when every row is selected."""
    r = rows_of(t, B)
    return r if sel.numel() == B else r[sel]


class Rule:
    """A family of layers whose parameters' per-row gradients are read from the layer's ``A`` and ``B``.

    Subclasses set :attr:`name` (the report's ``coverage`` key) and override :meth:`matches` and the
    readings their parameters need: :meth:`factors` for a 2-d weight that is ``Σ_t L_t ⊗ R_t`` per row,
    :meth:`pieces` for anything else. Each reads a :class:`Use` (the layer's input ``a``, the gradient at
    its output ``b``, its ``weight`` and ``bias``); :meth:`pieces` also the chunk's :class:`Rows`.
    A worked example (a fused QKV projection) is in docs/engines.md.
    """

    name: str = "rule"
    #: whether a parameter with a use of this rule may only be read through :meth:`factors` (an
    #: embedding: its dense per-row pieces would be ``[rows, V, d]``)
    factors_only: bool = False
    #: whether an output computed for one row and broadcast over the batch (a position embedding of
    #: shape ``[1, T, d]``) is expanded to the batch so each row's gradient is seen
    expands_broadcast: bool = False

    def matches(self, mod: nn.Module) -> bool:
        raise NotImplementedError

    def on_forward(self, use: Use, mod: nn.Module, x: torch.Tensor, capture: Any) -> None:
        """Keep on ``use`` what the forward must give beyond the input (a norm layer's ``x̂`` under
        autocast). ``capture.quiet(fn, *args)`` runs ``fn`` with the capture's hooks silent."""

    def factors(self, use: Use, param: torch.Tensor, sel: torch.Tensor, B: int) -> Optional[Factors]:
        """``param``'s per-row piece as factors on rows ``sel``, or None when it is not ``Lᵀ R``."""
        return None

    def has_factors(self, use: Use, param: torch.Tensor) -> bool:
        """Whether :meth:`factors` reads ``param`` (decided without the captured tensors)."""
        return False

    def pieces(self, use: Use, param: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Per-part pieces ``[c, *param.shape]`` of the chunk ``rows`` (``rows.sel``: ``[r]`` rows in the
        chunk, ``rows.dst``: their chunk-local part, ``rows.c``: parts, ``rows.in_order``: one row per
        part in order, ``rows.rp``: ``[B]``)."""
        raise NotImplementedError(f"rule {self.name!r} forms no per-part pieces of {tuple(param.shape)}")

    def positions(self, use: Use) -> int:
        """Positions per row of the use's output gradient."""
        b = use.b
        return int(b.numel() // (b.shape[0] * b.shape[-1])) if b is not None and b.numel() else 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


RULES: List[Rule] = []


def register(rule: Rule, *, first: bool = True) -> Rule:
    """Add ``rule`` to the registry (``first``: before the shipped rules, so it wins on a module both match)."""
    if not isinstance(rule, Rule):
        raise TypeError(
            f"`rule` must be an instance of lens_callbacks.credit.engines.rules.Rule, got {type(rule).__name__}."
        )
    if rule in RULES:
        return rule
    if first:
        RULES.insert(0, rule)
    else:
        RULES.append(rule)
    return rule


def unregister(rule: Rule) -> None:
    """Remove ``rule`` from the registry (nothing happens if it is not there)."""
    if rule in RULES:
        RULES.remove(rule)


def find_rule(mod: nn.Module) -> Optional[Rule]:
    """The first registered rule that covers ``mod``'s own parameters, or None."""
    for rule in RULES:
        if rule.matches(mod):
            return rule
    return None


def rule_named(name: str) -> Optional[Rule]:
    """The registered rule called ``name`` (the first, if several), or None."""
    for rule in RULES:
        if rule.name == name:
            return rule
    return None


def rule_of(use: Use) -> Rule:
    """A captured use's rule (``use.handler``, else the registered rule named ``use.rule``)."""
    rule = getattr(use, "handler", None)
    if rule is None:
        rule = rule_named(getattr(use, "rule", ""))
    if rule is None:
        raise ValueError(f"no registered rule for {getattr(use, 'rule', use)!r}")
    return rule


def forward_is(mod: nn.Module, cls: type) -> bool:
    """``mod`` is a ``cls`` whose forward is ``cls``'s own (a subclass with its own forward is another layer)."""
    return isinstance(mod, cls) and type(mod).forward is cls.forward


def _shipped() -> None:
    from .embedding import EmbeddingRule
    from .linear import Conv1DRule, LinearRule
    from .norms import LayerNormRule, RMSNormRule

    for rule in (LinearRule(), EmbeddingRule(), LayerNormRule(), RMSNormRule(), Conv1DRule()):
        register(rule, first=False)


_shipped()
