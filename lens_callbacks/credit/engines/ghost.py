r"""The one-pass engine for row-separable partitions: one forward, one backward, per-layer pieces.

Rows of a causal-LM batch do not interact, so when every part is a union of whole rows
(``by_rollout``, ``by_group``) a part's gradient is the sum of its rows' gradients, and each layer's
share of it is a function of what the layer saw in the forward (its input ``A``) and what flowed back
into its output (``B``) on those rows:

- ``nn.Linear``: ``g_S(W) = Σ_{k∈S} B_kᵀ A_k``, bias ``Σ_{k∈S} Σ_t B_kt``;
- transformers' ``Conv1D``: ``g_S(W) = Σ_{k∈S} A_kᵀ B_k``;
- ``nn.Embedding``: ``g_S(E)[v] = Σ_{(k,t)∈S, id_kt = v} B_kt`` (``padding_idx`` rows stay zero), never
  formed as a ``[V, d]`` piece per row: its dots are gathers, its norms token-equality Grams and its sum
  one ``index_add`` (:mod:`.ghost_routes`);
- ``nn.LayerNorm`` / RMSNorm variants: ``g_S(w) = Σ_{k∈S} Σ_t B_kt ∘ x̂_kt``, bias ``Σ B_kt``, with ``x̂``
  the layer's own normalised input (recomputed by the layer's own arithmetic with the weight set to one).

A parameter used by several layers (GPT-2's ``wte`` is also the LM head) gets the SUM of its uses' pieces,
so the cross terms of a tied weight are exact (for a tied embedding / head, the pair Gram of the two uses
is a gather of the head's output gradient at the row's tokens). Every dot and squared norm is summed in
float64 from products in the pieces' dtype (:mod:`.reductions`). Each parameter's per-part pieces are assembled one
parameter at a time, in chunks of parts under a memory budget, and reduced at once to ``<g_S, g_full>``,
the Gram ``<g_S, g_S'>`` and ``Σ_S g_S``: no ``m × |θ|`` buffer ever exists. A ``Linear``/``Conv1D``
weight may instead be read by the ghost identities, without any per-row piece, where that costs less
(:mod:`.ghost_routes`). In a separate pass each parameter is reduced inside the backward, as soon as its
gradient exists, and the captured tensors are let go layer by layer.

Every trainable parameter is covered exactly. A parameter is handled by the hooks only when the number
of its uses the hooks saw equals the number of edges into it in the autograd graph of the loss; any
other parameter (a bare ``nn.Parameter`` in a custom op, a layer with no rule) is the fallback: one
``torch.autograd.grad`` per part for those parameters only. ``report.coverage`` counts what each path
covered. A layer called once per chunk of rows (a forward in micro-batches) sees fewer rows than the
batch in each call; under :func:`batch_rows` its calls are stacked into one call on the whole batch.
``g_full`` comes from the single backward by autograd; ``conservation_error`` compares the
parts' sum, assembled from the pieces (another arithmetic path), with it.

Contract: no module may mix rows. Batch-norm layers in training mode are detected and refused; a
cross-row term in the loss is not detectable from the graph's shape (``Σ_S g_S`` still equals
``g_full``), which is why ``verify_part`` exists: it re-derives one part by its own masked backward.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from ..graph import graph_nodes
from ..inputs.partition import Partition, PartitionFn, apply_partition, position_parts, resolve_partition
from ..inputs.terms import CreditTerms, cat_terms, validate_terms
from ..primitives import (
    compute_dtype_now,
    dots_onto,
    evaluate_terms,
    grad_match_to,
    partition_label,
    precision_watch,
    preserved_rng,
)
from ..report import CreditGrads, CreditReport, PositionSplit, share_readings
from . import READINGS
from .ghost_routes import (
    ROUTES,
    choose_route,
    direct_param,
    fine_products,
    ghost_eligible,
    ghost_param,
    row_dot,
    sparse_only,
    use_factors,
    widened,
)
from .reductions import AlongSums, along_sums, diff_sq64, dots64, gram64, row_sq64, row_sum, sq64
from .rules import Rule, find_rule

__all__ = [
    "disintegrate_ghost",
    "RowCapture",
    "NotRowSeparable",
    "RowInteraction",
    "SpansInteract",
    "PartRows",
    "row_parts",
    "row_interacting_modules",
    "rule_for",
    "batch_rows",
    "RowSpan",
]

# Elements of one chunk of per-part pieces when no budget is given: at least 16 Mi elements, and never
# less than the parameter count (so a real policy gets one parameter-sized buffer per chunk).
_MIN_BUDGET = 1 << 24


#: How riding along says that a partition splits a row (the callback then reads the step by forward mode).
SPLITS_ROWS = "the partition puts positions of one row in different parts"


class NotRowSeparable(ValueError):
    """The partition splits a row, so parts are not unions of rows."""


class RowInteraction(ValueError):
    """A module mixes rows of the batch, so a row's gradient is not its own."""


class SpansInteract(RowInteraction):
    """Attention crosses the spans packed into one row, so a span's gradient is not its positions' pieces."""


# ---- the rules -------------------------------------------------------------------------------------


def rule_for(mod: nn.Module) -> Optional[str]:
    """The name of the rule that covers ``mod``'s own parameters, or None (its parameters go to the fallback)."""
    rule = find_rule(mod)
    return None if rule is None else rule.name


def row_interacting_modules(module: nn.Module) -> list[str]:
    """Names of submodules that mix rows of the batch in the current mode (batch-norm in training mode)."""
    out = []
    for name, mod in module.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and (mod.training or not mod.track_running_stats):
            out.append(name or type(mod).__name__)
    return out


class _Use:
    """One call of a covered layer: its parameters, its input, and the gradient at its output."""

    __slots__ = (
        "rule",
        "handler",
        "module",
        "weight",
        "bias",
        "a",
        "xhat",
        "b",
        "sealed",
        "capture",
        "version",
        "edge",
        "span",
        "calls",
        "rows_ok",
        "__weakref__",
    )

    def __init__(
        self,
        rule: Rule,
        module: nn.Module,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        a: torch.Tensor,
    ):
        self.handler = rule  # the registered rule that reads this use
        self.rule = rule.name
        self.module = module
        self.weight = weight
        self.bias = bias
        self.a = a
        self.xhat: Optional[torch.Tensor] = None
        self.b: Optional[torch.Tensor] = None
        self.sealed = False
        self.capture: Optional["RowCapture"] = None
        self.version = a._version  # the input's in-place version when the layer read it
        self.edge: Any = None  # the output's place in the graph (a backward to it forms no weight gradient)
        self.span: Optional[tuple[int, Optional[int]]] = None  # the batch's rows this call held (see `batch_rows`)
        self.calls = 1  # the layer calls (graph edges into its parameters) this use stands for
        self.rows_ok = True  # False: its leading dimensions are not the rows the engine reads (fallback)

    def normalised(self) -> torch.Tensor:
        """A norm layer's ``x̂``: kept from the forward under autocast, else recomputed from the input now.

        Recomputing holds no activation-sized tensor per norm layer through the backward (the input is
        the tensor autograd keeps for the layer's own backward anyway)."""
        if self.xhat is None:  # kept until this use's parameters are all read (the weight's chunks share it)
            if self.a._version != self.version:
                raise RowInteraction(
                    f"the input of {type(self.module).__name__} was modified in place after the layer read it, so "
                    "its normalised input cannot be formed again; use engine='reference'."
                )
            self.xhat = self.capture.quiet(self.handler.normalised, self.module, self.a)
        return self.xhat

    def weak_grad_hook(self) -> Callable[[torch.Tensor], None]:
        """:meth:`grad_hook` through a weak reference, for a tensor of the graph: the graph holds the hook, and a
        strong one would close a cycle through autograd's C++ nodes (``self.edge`` holds the output's node),
        which Python's collector cannot see: every use, its input included, would outlive the reading."""
        ref = weakref.ref(self)

        def hook(g: torch.Tensor) -> None:
            use = ref()
            if use is not None:
                use.grad_hook(g)

        return hook

    def grad_hook(self, g: torch.Tensor) -> None:
        # Later backward passes over the same graph (the fallback's, a check's) must not add to B.
        if self.sealed:
            return None
        # Accumulate: a tensor hook fires once per backward, but be exact if it ever fires twice.
        g = g.detach()
        self.b = g if self.b is None else self.b + g
        return None


class _StackedUse(_Use):
    """The calls of one layer on consecutive spans of the batch's rows, read as one call on the whole batch.

    Rows do not interact, so a row's piece is a function of that row's input and output gradient alone,
    whichever call computed it. The inputs are stacked once the forward is over; the output gradients,
    which exist only once the backward has passed the layer, are stacked the first time they are read
    (when the layer's parameters are reduced, after every call's gradient has arrived)."""

    __slots__ = ("children", "_b", "_rows")

    def __init__(self, children: Sequence[_Use], rows: Sequence[int]) -> None:
        u0 = children[0]
        super().__init__(u0.handler, u0.module, u0.weight, u0.bias, torch.cat([u.a for u in children]))  # [ΣB, ...]
        self.children = list(children)
        self._rows = list(rows)
        self.capture = u0.capture
        self.calls = sum(u.calls for u in children)
        if all(u.xhat is not None for u in children):
            self.xhat = torch.cat([u.xhat for u in children])
        for u in children:
            u.a = u.xhat = None  # their inputs now live in the stacked one

    @property  # type: ignore[override]
    def b(self) -> Optional[torch.Tensor]:
        if self._b is not None:
            return self._b
        bs = [u.b for u in self.children]
        like = next((x for x in bs if x is not None), None)
        if like is None:
            return None
        # a call whose rows the backward never reached adds zero rows
        self._b = torch.cat(
            [x if x is not None else like.new_zeros((n,) + tuple(like.shape[1:])) for x, n in zip(bs, self._rows)]
        )
        for u in self.children:
            u.b = None
        return self._b

    @b.setter
    def b(self, value: Optional[torch.Tensor]) -> None:
        self._b = value


def _unstackable(groups: Sequence[Sequence[_Use]], rows: Sequence[int], what: str) -> Optional[str]:
    """Why the covered layers' calls in ``groups`` (one group per chunk of ``rows[k]`` rows, ``what`` names
    the chunks) cannot be read as one batch's calls, or None."""
    if any(len(g) != len(groups[0]) for g in groups):
        return (
            f"the covered layers ran {[len(g) for g in groups]} times in {what}; stacking needs the same layers in each"
        )
    for us in zip(*groups):
        u0 = us[0]
        name = type(u0.module).__name__
        if any(u.module is not u0.module or u.weight is not u0.weight or u.bias is not u0.bias for u in us):
            return f"the covered layers ran in different orders in {what}"
        if any(u.a is None or u.a._version != u.version for u in us):
            return f"the input of {name} was modified in place after the layer read it"
        if any(int(u.a.shape[0]) != n for u, n in zip(us, rows)) or len({tuple(u.a.shape[1:]) for u in us}) != 1:
            return (
                f"{name} saw inputs of shapes {[list(u.a.shape) for u in us]} in {what}; stacking their rows needs "
                "each chunk's rows in front and one shape past them"
            )
        bs = [u.b for u in us if u.b is not None]
        if len({tuple(b.shape[1:]) for b in bs}) > 1:
            return f"{name}'s output gradients have shapes {[None if u.b is None else list(u.b.shape) for u in us]} in {what}"
    return None


def stack_spans(uses: Sequence[_Use], B: int) -> tuple[list[_Use], Optional[str]]:
    """``uses`` with the calls made under :func:`batch_rows` stacked into one use per layer, and why they
    could not be (None: stacked, or nothing to stack). Unstacked calls hold fewer rows than the batch, so
    the engine reads their parameters by its exact fallback."""
    if any(u.span is not None and u.span[1] is None for u in uses):
        return list(uses), "a `batch_rows` span was left open (call `span.end(stop)` inside its block)"
    spans = sorted({u.span for u in uses if u.span is not None})
    if not spans:
        return list(uses), None
    if any(u.span is None for u in uses):
        return list(uses), "some covered layers ran outside `batch_rows` while others ran inside it"
    if spans[0][0] != 0 or spans[-1][1] != B or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return list(uses), f"the `batch_rows` spans {spans} do not tile the batch's {B} rows in order"
    groups = [[u for u in uses if u.span == sp] for sp in spans]
    rows = [b - a for a, b in spans]
    why = _unstackable(groups, rows, f"the `batch_rows` spans {spans}")
    if why is not None:
        return list(uses), why
    return [_StackedUse(us, rows) for us in zip(*groups)], None


_INSTALLED: list["RowCapture"] = []


class RowSpan:
    """The rows a :func:`batch_rows` block holds; :meth:`end` closes an open one once its row count is known."""

    __slots__ = ("start", "stop")

    def __init__(self, start: int, stop: Optional[int]) -> None:
        self.start, self.stop = start, stop

    def end(self, stop: int) -> None:
        """Close an open span at ``stop`` (its calls held rows ``start:stop``)."""
        if not isinstance(stop, int) or stop <= self.start:
            raise ValueError(f"`stop` must be an int > start = {self.start}, got {stop!r}.")
        if self.stop is not None and self.stop != stop:
            raise ValueError(f"this span was opened as rows {self.start}:{self.stop}, got end({stop}).")
        self.stop = stop


@contextlib.contextmanager
def batch_rows(start: int, stop: Optional[int] = None) -> Iterator[RowSpan]:
    """Say that the covered layers called inside hold rows ``start:stop`` of the batch the terms stack.

    For a ``credit_terms`` that runs the model once per chunk of rows (a trainer's micro-batches) and
    stacks the chunks' terms in order: the one-pass engine then reads each layer's calls as one call on
    the whole batch instead of reading the layer's parameters by its fallback (one backward per part).
    With ``stop=None`` the span is open until ``span.end(stop)`` is called inside the block, once the
    chunk's rows are known (a position embedding broadcast over an open span's rows is then read by the
    fallback). Outside an audit it does nothing."""
    if not (isinstance(start, int) and (stop is None or isinstance(stop, int))) or not (
        0 <= start and (stop is None or start < stop)
    ):
        raise ValueError(f"`batch_rows` needs 0 <= start < stop, got start={start!r}, stop={stop!r}.")
    span = RowSpan(start, stop)
    before = [(c, c.span, len(c.uses), c._last) for c in _INSTALLED]
    for c, *_ in before:
        c.span = (start, stop)
        if stop is None:
            c._last = 0  # no row count is known for an open span: nothing broadcast is expanded on a guess
    try:
        yield span
    finally:
        for c, sp, n0, _ in before:
            c.span = sp
            if stop is None and span.stop is not None:
                for u in c.uses[n0:]:
                    if u.span == (start, None):
                        u.span = (start, span.stop)


#: Captures of uses made outside a module call, installed with every :class:`RowCapture`: ``ext(capture)``
#: starts one and returns a handle whose ``remove()`` ends it; it records its uses with
#: :meth:`RowCapture.record` while ``capture.active``. The TRL adapter adds one for TRL's fused LM head.
CAPTURE_EXTENSIONS: list[Callable[["RowCapture"], Any]] = []


class RowCapture:
    """Forward hooks on every covered layer of ``root``; each call records a :class:`_Use`.

    The forward hook saves the layer's input (detached: the same storage autograd keeps anyway) and
    registers a hook on the layer's output that saves the gradient flowing into it. Hooks change no
    value and no gradient; only a position embedding called with one row for the whole batch is
    expanded to the batch (same values, same reduction in backward) so each row's gradient can be seen.
    Capture happens only while ``active`` is true and only for outputs that require grad.
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.uses: list[_Use] = []
        self.handles: list[Any] = []
        self.active = False
        self.batch = 0
        self.span: Optional[tuple[int, Optional[int]]] = None  # set by `batch_rows` (stop None: open)
        self._last = 0  # the leading size of the last covered layer's call
        self._inner = False

    def rows(self) -> int:
        """Rows of the call now being recorded: its `batch_rows` span, else the batch's leading size.

        A span is taken only where the last covered layer called held as many rows (0 otherwise): a
        span that misstates its rows then leaves a broadcast layer unexpanded, which the engine reads by
        its exact fallback, instead of changing the shape of the model's forward."""
        if self.span is None:
            return self.batch
        a, b = self.span
        n = self._last if b is None else b - a  # an open span: the rows of the calls made in it so far
        return n if n == self._last else 0

    def install(self) -> "RowCapture":
        _INSTALLED.append(self)
        for mod in self.root.modules():
            rule = find_rule(mod)
            if rule is not None:
                self.handles.append(mod.register_forward_hook(self._make_hook(rule)))
        for ext in CAPTURE_EXTENSIONS:
            self.handles.append(ext(self))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.active = False
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def clear(self) -> None:
        self.uses = []
        self.batch = 0
        self._last = 0

    def __enter__(self) -> "RowCapture":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _make_hook(self, rule: Rule) -> Callable[..., Any]:
        def hook(mod: nn.Module, inputs: tuple, out: Any) -> Any:
            if not self.active or self._inner or not inputs:
                return None
            x = inputs[0]
            if not isinstance(out, torch.Tensor) or not isinstance(x, torch.Tensor) or out.dim() < 2 or x.dim() < 1:
                return None
            lead = int(out.shape[0])
            if lead > 1 and self.batch == 0:
                self.batch = lead  # seen on a frozen layer too (a frozen token embedding before a trained one)
            rows, self._last = self.rows(), lead
            if not out.requires_grad:
                return None
            w = getattr(mod, "weight", None)
            b = getattr(mod, "bias", None)
            b = b if isinstance(b, torch.Tensor) else None
            if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in (w, b)):
                return None  # a frozen layer (a LoRA base layer): nothing of it to attribute
            ret = None
            if rule.expands_broadcast and rows > 1 and int(x.shape[0]) == 1 and lead in (1, rows):
                # A position embedding of shape [1, T, d] broadcast over the batch: expand it so the
                # gradient reaching it is still per row ([B, T, d]); backward sums it as broadcasting would.
                # (`lead == rows`: another capture's hook on the layer expanded it already.)
                if lead == 1:
                    out = out.expand(rows, *out.shape[1:])
                    ret = out
                x = x.expand(rows, *x.shape[1:])
            self.record(rule, mod, w, b, x, out)
            return ret

        return hook

    def record(
        self,
        rule: Rule,
        mod: nn.Module,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        x: torch.Tensor,
        out: Optional[torch.Tensor] = None,
    ) -> _Use:
        """Record one use of ``mod``'s parameters read from input ``x`` (``[B, ...]``).

        With ``out``, the gradient at ``out`` is this use's ``B``. Without it the caller supplies ``B``
        through :meth:`_Use.grad_hook` (a layer computed outside its module, such as a fused head whose
        output gradient is formed inside another function's backward) and sets ``use.edge``."""
        use = _Use(rule, mod, weight, bias, x.detach())
        use.span = self.span
        rule.on_forward(use, mod, x, self)
        if out is not None:
            out.register_hook(use.weak_grad_hook())
            use.edge = torch.autograd.graph.get_gradient_edge(out)
        self.uses.append(use)
        return use

    def quiet(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with this capture's hooks silent (a rule re-running a layer's own forward)."""
        self._inner = True
        try:
            return fn(*args)
        finally:
            self._inner = False


def row_parts(part: Partition) -> Optional[torch.Tensor]:
    """``[B]`` part id of each row (``-1``: no trained position), or None when a row spans two parts."""
    ids = part.ids  # [B, T]
    B = ids.shape[0]
    if ids.numel() == 0:
        return torch.full((B,), -1, dtype=torch.long, device=ids.device)
    hi = ids.max(dim=1).values  # [B]
    big = torch.full_like(ids, int(hi.max()) + 1)
    lo = torch.where(ids >= 0, ids, big).min(dim=1).values  # [B]
    if not bool(((hi < 0) | (lo == hi)).all()):
        return None
    return hi


class PartRows:
    """Positions regrouped into one row per part: the one-pass engine's view of parts that are spans of rows.

    ``positions`` ``[B, T]`` (:attr:`Partition.positions`: the part of every position, ``-1`` none). Part ``i``'s
    positions, in order, become row ``i`` of a ``[m, k]`` layout (``k`` its longest part, shorter parts padded
    with zeros), so that every rule reads a part's piece as the piece of one row — with attention kept inside
    each span, the sum of the pieces at a part's positions is its gradient.
    """

    def __init__(self, positions: torch.Tensor, m: int) -> None:
        pos = positions.reshape(-1)  # [B·T]
        self.shape = tuple(positions.shape)  # (B, T)
        self.m = m
        keep = (pos >= 0).nonzero().squeeze(1)  # [n] positions in some part, in order
        order = keep[torch.argsort(pos[keep], stable=True)]  # [n] by part, in order within a part
        counts = torch.bincount(pos[keep], minlength=m)  # [m]
        self.k = max(1, int(counts.max())) if m else 1
        start = torch.cumsum(counts, 0) - counts  # [m]
        slot = torch.arange(order.numel(), device=pos.device) - start.repeat_interleave(counts)  # [n]
        self.index = torch.zeros(m, self.k, dtype=torch.long, device=pos.device)  # [m, k] into B·T
        self.valid = torch.zeros(m, self.k, dtype=torch.bool, device=pos.device)  # [m, k]
        part = pos[order]
        self.index[part, slot] = order
        self.valid[part, slot] = True
        self.positions = counts  # [m] positions per part
        self.padded = not bool(self.valid.all())
        # Parts of one length that follow each other in the rows' order (rollouts packed at a fixed
        # length): the regrouped layout is a view of the rows, and no copy is made.
        self.start: Optional[int] = None
        if m and not self.padded:
            s = int(self.index[0, 0])
            if torch.equal(self.index.reshape(-1), torch.arange(s, s + m * self.k, device=pos.device)):
                self.start = s
        # Parts that are each one run of consecutive positions, of unequal lengths (rollouts packed as they
        # come, a row's padding in none): ``(first, length)`` per part into the B·T positions. The direct
        # route reads a Linear weight's products from these runs of the rows themselves, with no regrouped
        # copy (:func:`..ghost_routes.use_factors`).
        self.runs: Optional[list[tuple[int, int]]] = None
        if m and self.start is None:
            first = self.index[:, 0]  # [m]
            steps = torch.arange(self.k, device=pos.device)  # [k]
            if bool(((self.index == first[:, None] + steps) | ~self.valid).all()):
                self.runs = list(zip(first.tolist(), counts.tolist()))

    def eligible(self, x: Optional[torch.Tensor]) -> bool:
        """Whether ``x`` leads with the batch's ``[B, T]`` (a layer called on every position of every row)."""
        return x is not None and x.dim() >= 2 and tuple(x.shape[:2]) == self.shape

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, ...]`` as ``[m, k, ...]``: each part's positions in a row, zeros past its end.

        A view of ``x`` when the parts are consecutive runs of one length (:attr:`start`), else one copy
        (its padding zeroed in place)."""
        flat = x.reshape(self.shape[0] * self.shape[1], *x.shape[2:])
        if self.start is not None:
            return flat[self.start : self.start + self.m * self.k].view(self.m, self.k, *x.shape[2:])
        out = flat[self.index]  # [m, k, ...]
        if self.padded:
            out[~self.valid] = 0 if out.dtype != torch.bool else False
        return out


class _PartRowUse:
    """A captured use seen through :class:`PartRows` (its input, output gradient and ``x̂`` regrouped)."""

    _OWN = ("_use", "_rows", "_a", "_b", "_xhat")

    def __init__(self, use: _Use, rows: PartRows) -> None:
        object.__setattr__(self, "_use", use)
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_a", None)
        object.__setattr__(self, "_b", None)
        object.__setattr__(self, "_xhat", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._use, name)

    @property
    def raw(self) -> _Use:
        """The use on the batch's own rows (nothing regrouped)."""
        return self._use

    @property
    def runs(self) -> Optional[list[tuple[int, int]]]:
        """Each part's one run of positions into the batch's rows, flattened (:attr:`PartRows.runs`), or None."""
        return self._rows.runs

    @property
    def lead(self) -> int:
        """Rows of the regrouped layout (one per part), known without regrouping anything."""
        return self._rows.m

    @property
    def part_positions(self) -> int:
        """Positions per regrouped row of the output gradient (:meth:`Rule.positions`), without regrouping it."""
        n = self.handler.positions(self._use)  # per batch row
        return n // self._rows.shape[1] * self._rows.k

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("a", "b", "xhat") and value is None:
            object.__setattr__(self, "_" + name, None)
        setattr(self._use, name, value)

    @property
    def a(self) -> Optional[torch.Tensor]:
        if self._a is None and self._use.a is not None:
            object.__setattr__(self, "_a", self._rows.gather(self._use.a))
        return self._a

    @property
    def b(self) -> Optional[torch.Tensor]:
        if self._b is None and self._use.b is not None:
            object.__setattr__(self, "_b", self._rows.gather(self._use.b))
        return self._b

    def normalised(self) -> torch.Tensor:
        if self._xhat is None:
            object.__setattr__(self, "_xhat", self._rows.gather(self._use.normalised()))
        return self._xhat


def part_rows(uses: Sequence[_Use], rows: PartRows) -> list[Any]:
    """``uses`` seen through ``rows``; a use that does not lead with ``[B, T]`` is marked unreadable by rows."""
    out: list[Any] = []
    for u in uses:
        if rows.eligible(u.a):
            out.append(_PartRowUse(u, rows))
        else:
            u.rows_ok = False  # read by the fallback: its leading dimensions are not the batch's positions
            out.append(u)
    return out


def layout(part: Partition, B: int) -> tuple[Optional[torch.Tensor], Optional[PartRows]]:
    """How the one-pass engine reads ``part``: ``(rp, None)`` with ``rp`` ``[B]`` each row's part (whole rows),
    ``(arange(m), rows)`` for spans of rows (:attr:`Partition.positions`), ``(None, None)`` when it cannot."""
    rp = row_parts(part)
    if rp is not None:
        return rp, None
    if part.positions is None:
        return None, None
    rows = PartRows(part.positions.to(part.ids.device), part.n_parts)
    return torch.arange(part.n_parts, device=part.ids.device), rows


# ---- per-part pieces of one parameter --------------------------------------------------------------


class _Rows:
    """Which rows a chunk of parts holds, worked out once per chunk (each of these costs a device sync)."""

    __slots__ = ("rp", "sel", "dst", "c", "in_order")

    def __init__(self, rp: torch.Tensor, c: int) -> None:
        self.rp = rp  # [B] chunk-local part of each row, -1 outside the chunk
        self.c = c
        self.sel = (rp >= 0).nonzero().squeeze(1)  # [r] rows in the chunk
        self.dst = rp[self.sel]  # [r]
        # One row per part, in order (by_rollout): a row's product is its part's piece.
        self.in_order = self.sel.numel() == c and bool((self.dst == torch.arange(c, device=rp.device)).all())


def _use_pieces(use: _Use, param: torch.Tensor, rows: _Rows) -> Optional[torch.Tensor]:
    """This use's contribution to ``param`` for the parts of the chunk ``rows`` describes (its rule's pieces)."""
    if use.b is None:
        return None
    return use.handler.pieces(use, param, rows)


def _leaf_edges(root: torch.Tensor, leaves: Sequence[torch.Tensor]) -> dict[int, int]:
    """Number of graph edges into each leaf's AccumulateGrad node, reachable from ``root``."""
    want = {id(x) for x in leaves}
    count: dict[int, int] = {}
    for node in graph_nodes(root):
        for nxt, _ in node.next_functions:
            var = getattr(nxt, "variable", None)
            if var is not None and id(var) in want:
                count[id(var)] = count.get(id(var), 0) + 1
    return count


def reentrant_checkpoints(root: torch.Tensor) -> bool:
    """Whether the graph of ``root`` holds a reentrant activation checkpoint (``use_reentrant=True``): its
    layers ran without grad in the forward and run again inside the backward, out of the hooks' sight."""
    return any(type(node).__name__ == "CheckpointFunctionBackward" for node in graph_nodes(root))


REENTRANT_WORDS = (
    "reentrant activation checkpointing (use_reentrant=True) runs the checkpointed layers without grad in the "
    "forward and again inside the backward, out of sight of the hooks that ride along; the separate pass reads "
    "the step instead. To ride along, checkpoint without reentrancy: "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) in transformers, "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) elsewhere"
)


def _chunks(rows_per_part: Sequence[int], numel: int, budget: int) -> list[list[int]]:
    """Consecutive parts packed so that a chunk's per-row pieces hold at most ``budget`` elements."""
    out: list[list[int]] = []
    cur: list[int] = []
    load = 0
    for i, r in enumerate(rows_per_part):
        need = max(1, r) * numel
        if cur and load + need > budget:
            out.append(cur)
            cur, load = [], 0
        cur.append(i)
        load += need
    if cur:
        out.append(cur)
    return out


def _sq_t(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖²`` accumulated in float64 as a 0-d tensor, read back once with the others."""
    return sq64(x)


def _sum_sq(xs: Iterable[torch.Tensor]) -> float:
    """``Σ ‖x‖²`` over tensors in float64 with a single read-back."""
    parts = [_sq_t(x) for x in xs]
    return float(torch.stack(parts).sum()) if parts else 0.0


def _row_sq(P: torch.Tensor) -> torch.Tensor:
    """``‖P_i‖²`` of every row of a ``[c, n]`` block in float64 (``[c]``): per-block norms in ``P``'s dtype
    summed in float64 (an upcast copy of the block would double the step's peak memory)."""
    return row_sq64(P)


# Parameters with at most this many elements have their per-part pieces batched: held until the batch
# reaches _BATCH elements, then reduced by one set of products (a norm weight or a bias costs a dozen
# small kernels on its own, which at m = 8 is most of what a small layer costs).
_SMALL = 1 << 15
_BATCH = 1 << 18
# A weight whose every part's pieces hold at most this many elements is read whole by the direct route.
_WHOLE = 1 << 20


class _Accum:
    """Per-part readings accumulated parameter by parameter (float64); small parameters in batches."""

    def __init__(self, m: int, readings: str, device: torch.device) -> None:
        self.held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (P [m, n], target [n], g_full [n])
        self.held_n = 0
        self.dots = torch.zeros(m, dtype=torch.float64, device=device)  # [m]
        self.gram = torch.zeros(m, m, dtype=torch.float64, device=device) if readings == "all" else None  # [m, m]
        # "shares": each part's ‖g_S‖² alone, the Gram's diagonal (m·|θ| work instead of m²·|θ|)
        self.sq = torch.zeros(m, dtype=torch.float64, device=device) if readings == "shares" else None  # [m]
        self.diff_sq = torch.zeros((), dtype=torch.float64, device=device)  # read back once, at the end

    def _reduce(self, P: torch.Tensor, tg: torch.Tensor, gf: torch.Tensor) -> torch.Tensor:
        """Every part's dot, norm (or Gram row) and the parts' sum of one ``[m, n]`` block; returns the sum."""
        # The dots, where the parts nearly cancel against g_full (a head's p − e_y), by float32 products over 2^8
        # columns at a time summed in float64 (fine_products); the Gram, whose diagonal sums squares (nothing
        # cancels there), by one float32 product: a norm is then within ~1e-6 relative on a [8, 2^16] block.
        d, _ = fine_products(P, tg, False, False)
        self.dots += d
        if self.gram is not None:
            self.gram += (P @ P.T).double() if P.dtype != torch.float64 else P @ P.T
        elif self.sq is not None:
            self.sq += _row_sq(P)
        total = row_sum(P)  # [n]
        self.diff_sq += diff_sq64(total, gf)
        return total

    def flush(self) -> None:
        """Reduce the held small parameters' pieces as one block."""
        if not self.held:
            return
        held, self.held, self.held_n = self.held, [], 0
        if len(held) == 1:
            self._reduce(*held[0])
            return
        dtype = held[0][0].dtype
        P = torch.cat([h[0].to(dtype) for h in held], 1)  # [m, Σn]
        self._reduce(P, torch.cat([h[1].to(dtype) for h in held]), torch.cat([h[2].to(dtype) for h in held]))

    def add(
        self,
        pieces: Callable[[list[int]], torch.Tensor],
        chunks: list[list[int]],
        g_full: torch.Tensor,
        keep_sum: bool,
        target: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        gf = g_full.reshape(-1)  # [n]
        tg = gf if target is None else target.reshape(-1)  # [n] what the parts are dotted with
        if len(chunks) == 1 and chunks[0] == list(range(self.dots.shape[0])):
            P = pieces(chunks[0]).reshape(len(chunks[0]), -1)  # [m, n]
            if not keep_sum and P.shape[1] <= _SMALL:
                self.held.append((P, tg, gf))
                self.held_n += P.numel()
                if self.held_n >= _BATCH:
                    self.flush()
                return None
            total = self._reduce(P, tg, gf)
            return total.view_as(g_full) if keep_sum else None
        total = torch.zeros_like(gf)
        for i, ci in enumerate(chunks):
            P = pieces(ci).reshape(len(ci), -1)  # [c, n]
            idx = torch.tensor(ci, device=self.dots.device)
            self.dots[idx] += dots64(P, tg)
            if self.sq is not None:
                self.sq[idx] += _row_sq(P)
            total += row_sum(P).to(total.dtype)
            if self.gram is not None:
                self.gram[idx[:, None], idx[None, :]] += gram64(P, P)
                for cj in chunks[i + 1 :]:
                    Q = pieces(cj).reshape(len(cj), -1)  # [c', n]
                    jdx = torch.tensor(cj, device=self.dots.device)
                    block = gram64(P, Q)  # [c, c']
                    self.gram[idx[:, None], jdx[None, :]] += block
                    self.gram[jdx[:, None], idx[None, :]] += block.T
            del P
        self.diff_sq += diff_sq64(total, gf)
        return total.view_as(g_full) if keep_sum else None


# ---- the engine ------------------------------------------------------------------------------------


def disintegrate_ghost(
    module: nn.Module,
    batch: Any,
    partition: Union[str, PartitionFn, Partition] = "by_rollout",
    *,
    dtype: Any = "float32",
    reference_grads: Any = None,
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    keep_grads: bool = False,
    preserve_rng: bool = True,
    readings: str = "all",
    memory_budget: Optional[int] = None,
    verify_part: Union[bool, str] = False,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    forward_context: Optional[Callable[[], Any]] = None,
    route: str = "auto",
    project_onto: Optional[Sequence[Optional[torch.Tensor]]] = None,
    full_grad: Optional[Sequence[Optional[torch.Tensor]]] = None,
    position_split: bool = False,
    along: Union[bool, AlongSums] = False,
) -> CreditReport:
    r"""Exact per-part credit for a row-separable partition from one forward and one backward pass.

    Args:
        module: an ``nn.Module`` implementing ``credit_terms(batch) -> CreditTerms``.
        batch: what ``credit_terms`` takes.
        partition: a partition whose parts are unions of whole rows (``"by_rollout"``, ``"by_group"``, …).
        dtype: ``"float32"`` (default), ``"float64"``, ``"bfloat16"`` or ``"native"``.
        reference_grads: as in :func:`~lens_callbacks.credit.disintegrate` (gives ``grad_match``).
        terms_fn: use this instead of ``module.credit_terms``.
        keep_grads: attach ``g_full`` and ``Σ_S g_S`` (assembled from the pieces) to ``report.grads``.
        preserve_rng: run under ``torch.random.fork_rng``.
        readings: ``"all"`` (shares, norms, cancellation and the interference matrix ``report.gram``),
            ``"shares"`` (the same without the interference matrix: each part's norm alone, ``m·|θ|`` work
            instead of ``m²·|θ|``) or ``"projected"`` (projected shares only; norms are NaN).
        memory_budget: elements one chunk of per-part pieces may hold (default ``max(|θ|, 16 Mi)``).
        verify_part: also take the largest part's gradient by its own masked backward and check the
            engine's ``<g_S, g_full>`` against it: catches a loss that mixes rows (``True``), or, with
            ``"spans"``, only where the parts were read as spans of rows (packed rollouts: attention that
            crosses them is :class:`SpansInteract`).
        params: name → tensor to evaluate the terms at instead of the live parameters.
        forward_context: a zero-argument factory of a context manager entered around ``credit_terms``
            (e.g. a trainer's autocast).
        route: how ``Linear``/``Conv1D`` weights are read: ``"auto"`` (per layer, the cheaper of the two),
            ``"direct"`` (per-row weight products) or ``"ghost"`` (the ghost identities, no per-row piece).
        project_onto: a vector ``v`` (one tensor per trainable parameter) that replaces ``g_full`` in the
            shares, ``<g_S, v> / ||v||²``, as for :func:`~lens_callbacks.credit.disintegrate` (under DDP:
            the averaged ``.grad``); cancellation and conservation still read against ``g_full``.
        full_grad: the step's full gradient from the caller (one tensor per trainable parameter: the
            trainer's ``.grad`` of this very batch) to use as ``g_full`` instead of the pass's own. The
            pass's backward then runs only to the layers' outputs and forms no weight gradient;
            ``conservation_error`` holds the parts against this gradient (which also covers what
            ``grad_match`` would check: terms that do not add up to the trained loss), and ``grad_match``
            is not read. The captured output gradients are held until the backward ends.
        position_split: also read the step split by the positions its gradient was computed at
            (``report.position_split``, :class:`PositionDots`): every position by its segment, trained or not;
            about one more product the size of each layer's forward.
        along: the parts' sum held against ``g_full`` along ``project_onto`` alone, as in
            :func:`~lens_callbacks.credit.disintegrate` (no ``Σ_S g_S`` is formed); with ``full_grad``, the
            sums themselves (``AlongSums`` taken by the caller from ``full_grad`` and ``project_onto``).

    Returns:
        A :class:`CreditReport` with ``engine="ghost"``.

    Raises:
        NotRowSeparable: the partition splits a row (use ``engine="reference"`` or ``"jvp"``).
        RowInteraction: a module mixes rows (batch-norm in training mode), or ``verify_part`` failed.
    """
    if readings not in READINGS:
        raise ValueError(f"`readings` must be one of {list(READINGS)}, got {readings!r}.")
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {list(ROUTES)!r}, got {route!r}; 'auto' picks per layer by cost.")
    if isinstance(along, AlongSums) and full_grad is None:
        raise ValueError(
            "`along` given as sums (AlongSums) must come with `full_grad`, the g_full they were taken from; pass "
            "along=True to have the pass take them from its own g_full."
        )
    mixing = row_interacting_modules(module)
    if mixing:
        raise RowInteraction(
            f"modules {mixing[:5]!r} mix rows of the batch (batch-norm in training mode), so a row's gradient is "
            "not its own: the one-pass engine would be wrong. Use engine='reference', or put them in eval mode."
        )
    spec = resolve_partition(partition)
    cap = RowCapture(module)
    with preserved_rng(module, preserve_rng):
        cap.install()
        cap.active = True
        try:
            with forward_context() if forward_context is not None else contextlib.nullcontext():
                watch = precision_watch(module, dtype)
                terms, names, leaves, used = evaluate_terms(module, batch, dtype, terms_fn, params=params, watch=watch)
                compute = watch.coarser_than(used)
        finally:
            cap.remove()
        onto = dots_onto(leaves, project_onto)
        given = dots_onto(leaves, full_grad, "full_grad") if full_grad is not None else None
        if given is not None:
            given = [g.to(x.dtype) for g, x in zip(given, leaves)]
        part = apply_partition(spec, terms)
        ids = part.ids.to(terms.terms.device)  # [B, T]
        B = int(terms.terms.shape[0])
        rp, spans = layout(part, B)
        if rp is None:
            raise NotRowSeparable(
                f"`partition` ({partition_label(partition)}) puts positions of one row in different parts; the "
                "one-pass engine needs parts that are unions of whole rows (or spans of rows, Partition.positions). "
                "Use engine='reference' (or 'jvp')."
            )
        m = part.n_parts
        verify = bool(verify_part) if verify_part != "spans" else spans is not None
        pdots = PositionDots(*position_parts(terms)) if position_split else None
        with torch.enable_grad():
            loss = terms.terms.sum()
            reduced = _run(
                cap,
                leaves,
                loss,
                PassLayout(terms, ids, rp, m, B, spans=spans, positions=pdots),
                PassOptions(
                    readings, keep_grads, memory_budget, verify, route, onto=onto, full_grad=given, along=along
                ),
            )
    g_full = reduced.g_full
    full_sq = reduced.along.full_sq if reduced.along is not None else _sum_sq(g_full)
    grad_match = None
    if reference_grads is not None and given is None:
        grad_match = grad_match_to(module, names, reference_grads, g_full, math.sqrt(full_sq))
    return build_report(
        reduced,
        names,
        part.names,
        readings,
        grad_match=grad_match,
        dtype=used,
        n_trained=terms.n_trained,
        loss=float(loss.detach()),
        partition=partition_label(partition),
        engine="ghost" if given is None else "ghost+grad",
        keep_grads=keep_grads,
        onto=onto,
        full_sq=full_sq,
        compute_dtype=compute,
        spans=spans is not None,
        spans_verified=verify and spans is not None,
        position_split=read_position_split(pdots, g_full, onto, full_sq),
    )


def read_position_split(
    pdots: Optional[PositionDots],
    g_full: Sequence[torch.Tensor],
    onto: Optional[Sequence[torch.Tensor]],
    full_sq: float,
) -> Optional[PositionSplit]:
    """The :class:`PositionSplit` from what :class:`PositionDots` summed (None when it was not asked for)."""
    if pdots is None:
        return None
    if pdots.reason is not None:
        return PositionSplit((), (), float("nan"), reason=pdots.reason)
    den = full_sq if onto is None else _sum_sq(onto)
    expected = full_sq  # Σ_P <pieces at P, v> = <g_full, v>
    if onto is not None:
        expected = math.fsum(float(dots64(a.reshape(1, -1), b.reshape(-1))) for a, b in zip(g_full, onto))
    if not (math.isfinite(den) and den > 0):
        return PositionSplit((), (), float("nan"), reason=f"||g_full||² = {den}: shares are undefined this step.")
    dots = [float(x) for x in pdots.dots.tolist()]
    return PositionSplit(pdots.names, tuple(d / den for d in dots), abs(math.fsum(dots) - expected) / den)


class Reduced(NamedTuple):
    """What one pass's reductions hand the report, by name."""

    g_full: list[torch.Tensor]  # the full gradient, per leaf
    totals: list[torch.Tensor]  # Σ_S g_S per leaf (empty unless the sum is kept)
    dots: torch.Tensor  # [m] float64: <g_S, onto> (onto = g_full unless given)
    gram: Optional[torch.Tensor]  # [m, m] float64 <g_S, g_S'>, or None without the interference matrix
    diff_sq: float  # ‖Σ_S g_S − g_full‖², in float64
    coverage: tuple[tuple[str, int], ...]  # (path, elements read by it), sorted
    sq_parts: Optional[torch.Tensor]  # [m] float64 ‖g_S‖² when the Gram is not read, else None
    along: Optional[AlongSums] = None  # the sums a check along `onto` took (`_Reducer(along=True)`)


@dataclass(frozen=True)
class PassLayout:
    """The batch as one pass reads it: the terms, each position's part and each row's part."""

    terms: CreditTerms
    ids: torch.Tensor  # [B, T] part id per position (-1: in none)
    rp: torch.Tensor  # [B] the part of each row
    m: int  # parts
    B: int  # rows
    spans: Optional[PartRows] = None  # parts as spans of rows (packed rollouts), else None
    positions: Optional[PositionDots] = None  # the position split's accumulator, when asked for


@dataclass(frozen=True)
class PassOptions:
    """How one pass reads the parts (the options :func:`disintegrate_ghost` takes, as one value)."""

    readings: str
    keep_grads: bool
    memory_budget: Optional[int]
    verify_part: bool
    route: str = "auto"
    onto: Optional[Sequence[torch.Tensor]] = None
    full_grad: Optional[Sequence[torch.Tensor]] = None
    along: Union[bool, AlongSums] = False  # the parts' sum held against g_full along `onto` alone (no Σ_S g_S
    # formed); its sums given by the caller or taken in the pass


def build_report(
    reduced: Reduced,
    names: Sequence[str],
    part_names: Sequence[str],
    readings: str,
    *,
    grad_match: Optional[float],
    dtype: str,
    n_trained: int,
    loss: float,
    partition: str,
    engine: str,
    keep_grads: bool,
    onto: Optional[Sequence[torch.Tensor]] = None,
    full_sq: Optional[float] = None,
    compute_dtype: Optional[str] = None,
    spans: bool = False,
    spans_verified: bool = False,
    position_split: Optional[PositionSplit] = None,
) -> CreditReport:
    """A :class:`CreditReport` from what :func:`reduce_pieces` returned (``onto``: what the dots were taken with;
    ``full_sq``: ``‖g_full‖²`` when the caller has it already)."""
    g_full, dots, gram, diff_sq, coverage = (
        reduced.g_full,
        reduced.dots,
        reduced.gram,
        reduced.diff_sq,
        reduced.coverage,
    )
    total_list, sq_parts = reduced.totals, reduced.sq_parts
    m = len(part_names)
    full_sq = _sum_sq(g_full) if full_sq is None else full_sq
    full_norm = math.sqrt(full_sq)
    dots_l = [float(d) for d in dots.tolist()]
    if gram is not None or sq_parts is not None:
        diag = gram.diagonal() if gram is not None else sq_parts
        sq = [max(float(v), 0.0) for v in diag.tolist()]
        part_norm = tuple(math.sqrt(s) for s in sq)
        norm_total = math.fsum(part_norm)
        norm_share = tuple(n / norm_total if norm_total > 0 else float("nan") for n in part_norm)
    else:
        part_norm = tuple(float("nan") for _ in range(m))
        norm_total = float("nan")
        norm_share = part_norm
    reason, projected, conservation, cancellation = share_readings(
        dots_l,
        full_sq,
        math.sqrt(diff_sq),
        norm_total,
        None if onto is None else (reduced.along.onto_sq if reduced.along is not None else _sum_sq(onto)),
    )
    grads = None
    if keep_grads:
        grads = CreditGrads(tuple(names), [g.detach() for g in g_full], [t.detach() for t in total_list])
    return CreditReport(
        part_names=tuple(part_names),
        projected_share=projected,
        norm_share=norm_share,
        part_norm=part_norm,
        cancellation=cancellation,
        conservation_error=conservation,
        grad_match=grad_match,
        dtype=dtype,
        n_trained=n_trained,
        full_grad_norm=full_norm,
        loss=loss,
        partition=partition,
        reason=reason,
        grads=grads,
        engine=engine,
        readings=readings,
        gram=None if gram is None else tuple(tuple(float(v) for v in row) for row in gram.tolist()),
        coverage=coverage,
        compute_dtype=compute_dtype,
        spans=spans,
        spans_verified=spans_verified,
        position_split=position_split,
    )


def _run(
    cap: RowCapture, leaves: Sequence[torch.Tensor], loss: torch.Tensor, lay: PassLayout, opt: PassOptions
) -> Reduced:
    """One pass: the backward of ``loss`` with every covered parameter reduced inside it, then the fallback."""
    terms, rp, ids, m, B, spans, positions = lay.terms, lay.rp, lay.ids, lay.m, lay.B, lay.spans, lay.positions
    readings, keep_grads, memory_budget, verify_part = opt.readings, opt.keep_grads, opt.memory_budget, opt.verify_part
    route, onto, full_grad = opt.route, opt.onto, opt.full_grad
    uses, _ = stack_spans(cap.uses, B)  # unstacked, their parameters take the fallback (coverage says so)
    if spans is not None:  # parts are spans of rows: each part's positions read as one row
        uses, B = part_rows(uses, spans), m
    by_leaf = plan_uses(uses, leaves, B, _leaf_edges(loss, leaves) if loss.requires_grad else {})
    fallback = [i for i, x in enumerate(leaves) if i not in by_leaf]
    red = _Reducer(
        by_leaf,
        leaves,
        rp,
        m,
        readings,
        keep_grads,
        memory_budget,
        route,
        onto=onto,
        positions=positions,
        along=opt.along,
    )
    if full_grad is not None:
        # g_full is given: a backward to the layers' outputs alone captures every output gradient the
        # pieces need and forms no weight gradient (a third of a backward's products).
        edges = [u.edge for u in cap.uses if u.edge is not None]
        if loss.requires_grad and edges:
            torch.autograd.grad(loss, edges, retain_graph=bool(fallback) or verify_part, allow_unused=True)
        g_full = list(full_grad)
    elif loss.requires_grad:
        # Each covered parameter is reduced inside the backward, as soon as its gradient exists.
        handles = [leaves[i].register_hook(red.hook(i)) for i in by_leaf]
        try:
            gs = torch.autograd.grad(loss, list(leaves), retain_graph=bool(fallback) or verify_part, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        g_full = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)]
    else:
        g_full = [torch.zeros_like(x) for x in leaves]
    seal(cap.uses)
    seal(uses)
    fb = None
    if fallback and loss.requires_grad:
        fb = _fallback_parts(terms, ids, [leaves[i] for i in fallback], m, retain=verify_part)
    return red.finish(g_full, fallback, fb, (terms, ids, spans) if verify_part else None)


def seal(uses: Iterable[_Use]) -> None:
    """Freeze every use's output gradient: the backward pass that defines ``B`` is over."""
    for u in uses:
        u.sealed = True


def plan_uses(
    uses: Sequence[_Use], leaves: Sequence[torch.Tensor], B: int, edges: dict[int, int]
) -> dict[int, list[_Use]]:
    """Leaf index → its captured uses, for the leaves the hooks cover completely; the rest fall back."""
    index = {id(x): i for i, x in enumerate(leaves)}
    seen: dict[int, list[_Use]] = {}
    bad: set[int] = set()
    for u in uses:
        for t in (u.weight, u.bias):
            if t is None or id(t) not in index:
                continue
            i = index[id(t)]
            seen.setdefault(i, []).append(u)
            lead = u.lead if isinstance(u, _PartRowUse) else u.a.shape[0]  # (a regrouped input is not formed)
            if not getattr(u, "rows_ok", True) or lead != B:
                bad.add(i)  # the layer saw no per-row leading dimension: rows cannot be told apart
    out = {}
    for i, us in seen.items():
        if i in bad or edges.get(id(leaves[i]), 0) != sum(u.calls for u in us):
            continue  # a use the hooks did not see (or a use outside the graph): exact fallback
        if sparse_only(us, leaves[i]) and not ghost_eligible(us, leaves[i]):
            continue  # an embedding weight also used by a layer without an L^T R piece: exact fallback
        out[i] = us
    return out


def _fallback_parts(
    terms: CreditTerms, ids: torch.Tensor, fl: list[torch.Tensor], m: int, retain: bool
) -> torch.Tensor:
    """``[m, n_fallback]``: each part's gradient on the fallback parameters, one masked backward per part."""
    rows = []
    for i in range(m):
        li = terms.terms.masked_select(ids == i).sum()
        if li.requires_grad:
            gs = torch.autograd.grad(li, fl, retain_graph=retain or i < m - 1, allow_unused=True)
            gs = [torch.zeros_like(x) if g is None else g for x, g in zip(fl, gs)]
        else:
            gs = [torch.zeros_like(x) for x in fl]
        rows.append(torch.cat([g.reshape(-1) for g in gs]))
    return torch.stack(rows)  # [m, n_fallback]


def reduce_pieces(
    uses: Sequence[_Use],
    by_leaf: dict[int, list[_Use]],
    leaves: Sequence[torch.Tensor],
    g_full: Sequence[torch.Tensor],
    rp: torch.Tensor,
    m: int,
    readings: str,
    keep_sum: bool,
    memory_budget: Optional[int],
    fallback: Sequence[int],
    fb: Optional[torch.Tensor],
    verify: Optional[tuple] = None,
    route: str = "auto",
    positions: Optional[PositionDots] = None,
    onto: Optional[Sequence[torch.Tensor]] = None,
    along: Union[bool, AlongSums] = False,
):
    """Dots with ``g_full`` (or ``onto``), the Gram and ``Σ_S g_S`` from the captured pieces (and the fallback's parts).

    ``route`` picks, for every ``Linear``/``Conv1D`` weight, how its per-part readings are formed:
    ``"auto"`` (by cost, see :mod:`.ghost_routes`), ``"direct"`` (per-row products) or ``"ghost"`` (the
    ghost identities; no per-row piece is formed). Other parameters always take the direct route.
    """
    red = _Reducer(
        by_leaf, leaves, rp, m, readings, keep_sum, memory_budget, route, onto=onto, positions=positions, along=along
    )
    return red.finish(g_full, fallback, fb, verify)


class PositionDots:
    """The position split, read in the same pass: ``<piece at the positions of P, g_full>`` for every part ``P``
    of *all* positions (a turn's prompt, tool and user tokens included), beside the loss-mask split.

    Per covered parameter, the pieces at each position are dotted with the parameter's full gradient without
    being formed (``Σ_t L_t · (W R_t)`` per position: one product the size of the layer's forward) and summed
    into the position's part. Every parameter must be read by a layer called on every position of every row;
    where one is not (or falls back), the split is not read and :attr:`reason` says why.
    """

    def __init__(self, ids: torch.Tensor, names: Sequence[str]) -> None:
        self.shape = tuple(ids.shape)  # (B, T)
        self.names = tuple(names)
        flat = ids.reshape(-1)  # [B·T]
        self.rows = _Rows(flat, len(self.names))
        self.dots = torch.zeros(len(self.names), dtype=torch.float64, device=ids.device)  # [m_pos]
        self.reason: Optional[str] = None

    def add(self, uses: Sequence[Any], param: torch.Tensor, g: torch.Tensor, target: Optional[torch.Tensor]) -> None:
        if self.reason is not None:
            return
        base = [getattr(u, "_use", u) for u in uses]  # through a spans view: the captured use itself
        for u in base:
            if u.a is None or u.a.dim() < 2 or tuple(u.a.shape[:2]) != self.shape:
                self.reason = (
                    f"{type(u.module).__name__} was not called on every position of every row "
                    f"(input {list(u.a.shape) if u.a is not None else None}, batch {list(self.shape)})"
                )
                return
        W = g if target is None else target
        BT = self.shape[0] * self.shape[1]
        if ghost_eligible(base, param):  # L^T R weights: the dots without any piece
            for u in base:
                f = use_factors(u, param, self.rows.sel, BT)
                if f is not None:
                    f = widened(f)
                    self.dots.index_add_(0, self.rows.dst, row_dot(f, W.to(f.R.dtype)))
            return
        for u in base:
            piece = _use_pieces(u, param, self.rows)  # [m_pos, *param.shape], d-sized (biases, norm weights)
            if piece is not None:
                self.dots += dots64(piece.reshape(piece.shape[0], -1), W.reshape(-1).to(piece.dtype))

    def fail(self, why: str) -> None:
        self.reason = self.reason or why


class _Reducer:
    """The per-parameter reductions of :func:`reduce_pieces`, one parameter at a time.

    :meth:`hook` gives a gradient hook for a covered parameter: registered on the parameter before the
    backward, it reduces the parameter as soon as its gradient exists (every use's output gradient is
    captured by then: a layer's output gradient is complete before the layer's own backward runs) and
    then drops the captured tensors no other parameter still needs, so the output gradients of the whole
    network are never held at once. :meth:`finish` reduces whatever has not been, adds the fallback's
    parts and returns what :func:`build_report` takes.
    """

    def __init__(
        self,
        by_leaf,
        leaves,
        rp,
        m,
        readings,
        keep_sum,
        memory_budget,
        route,
        onto=None,
        positions: Optional[PositionDots] = None,
        along: Union[bool, AlongSums] = False,
    ) -> None:
        self.positions = positions
        # `along`: the parts' dots alone, held against g_full along `onto` in `finish` (no Σ_S g_S is formed);
        # its sums given (AlongSums, taken by the caller from g_full and onto) or taken there
        self.along = along is not False
        self.along_given = along if isinstance(along, AlongSums) else None
        if along and (onto is None or keep_sum or readings != "projected"):
            raise ValueError(
                "`along` must come with `onto`, readings='projected' and keep_sum=False, got "
                f"onto={'given' if onto is not None else None}, readings={readings!r}, keep_sum={keep_sum!r}."
            )
        if route not in ROUTES:
            raise ValueError(f"`route` must be one of {list(ROUTES)!r}, got {route!r}.")
        self.onto: Optional[Sequence[torch.Tensor]] = onto  # the parts are dotted with these instead of g_full
        self.device = leaves[0].device if leaves else torch.device("cpu")
        self.by_leaf, self.leaves, self.m, self.keep_sum, self.route = by_leaf, leaves, m, keep_sum, route
        self.rp = rp.to(self.device)
        self.rows_per_part = torch.bincount(self.rp[self.rp >= 0], minlength=m).tolist() if m else []
        n_total = sum(x.numel() for x in leaves)
        self.budget = memory_budget if memory_budget is not None else max(n_total, _MIN_BUDGET)
        self.acc = _Accum(m, readings, self.device)
        self.totals: list[Optional[torch.Tensor]] = [None] * len(leaves)
        self.coverage: dict[str, int] = {}
        self.local_rows: dict[tuple[int, ...], _Rows] = {}
        self.B = int(self.rp.shape[0])
        self.n_rows = sum(self.rows_per_part)
        self.sel_dst: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.done: set[int] = set()
        self.pending: dict[int, int] = {}  # id(use) → covered parameters of it not yet reduced
        for us in by_leaf.values():
            for u in us:
                self.pending[id(u)] = self.pending.get(id(u), 0) + 1

    def rows_of(self, chunk: list[int]) -> _Rows:
        """The rows of a chunk (chunk-local part id of each row, ``-1`` outside), shared by every parameter."""
        key = tuple(chunk)
        if key not in self.local_rows:
            m, device, rp = self.m, self.device, self.rp
            local = torch.full((m,), -1, dtype=torch.long, device=device)
            local[torch.tensor(chunk, device=device)] = torch.arange(len(chunk), device=device)
            self.local_rows[key] = _Rows(torch.where(rp >= 0, local[rp.clamp(min=0)], rp), len(chunk))  # [B]
        return self.local_rows[key]

    def hook(self, i: int, release: bool = True) -> Callable[[torch.Tensor], None]:
        def on_grad(g: torch.Tensor) -> None:
            self.param(i, g.detach(), release)
            return None

        return on_grad

    def param(self, i: int, g: torch.Tensor, release: bool = False) -> None:
        """Reduce parameter ``i`` against its full gradient ``g``."""
        if i in self.done:
            return
        us, p, acc = self.by_leaf[i], self.leaves[i], self.acc

        def pieces(chunk: list[int]) -> torch.Tensor:
            rows = self.rows_of(chunk)
            acc_p = None
            for u in us:
                piece = _use_pieces(u, p, rows)
                if piece is not None:
                    acc_p = piece if acc_p is None else acc_p + piece
            if acc_p is None:
                acc_p = torch.zeros((len(chunk),) + tuple(p.shape), dtype=g.dtype, device=self.device)
            return acc_p

        half = max(1, self.budget // 2)
        route = choose_route(
            us, p, self.n_rows, self.m, acc.gram is not None, self.route, diag=acc.sq is not None, total=not self.along
        )
        target = None if self.onto is None else self.onto[i]
        # A small weight's pieces are formed whole and reduced in a batch with other small parameters
        # (the per-block reads cost a dozen kernels each, most of a toy layer's time); a larger one (or a
        # tied embedding) is read a block of its rows at a time.
        blocked = ghost_eligible(us, p) and (sparse_only(us, p) or p.numel() * self.m > _WHOLE)
        if route == "ghost" or blocked:
            if self.sel_dst is None:
                sel_all = (self.rp >= 0).nonzero().squeeze(1)  # [r] rows in some part
                self.sel_dst = (sel_all, self.rp[sel_all])
            sel, dst = self.sel_dst
            if route == "ghost":
                total, diff = ghost_param(
                    us,
                    g,
                    sel,
                    dst,
                    self.B,
                    acc.dots,
                    acc.gram,
                    half,
                    sq=acc.sq,
                    param=p,
                    keep_total=self.keep_sum,
                    target=target,
                    total=not self.along,
                )
            else:  # the direct route on an Lᵀ R weight: every part's pieces, a block of the weight's rows at a time
                total, diff = direct_param(
                    us,
                    g,
                    sel,
                    dst,
                    self.m,
                    self.B,
                    acc.dots,
                    acc.gram,
                    half,
                    sq=acc.sq,
                    param=p,
                    keep_total=self.keep_sum,
                    target=target,
                )
            if diff is not None:
                acc.diff_sq += diff
            self.totals[i] = total if self.keep_sum else None
        else:
            chunks = _chunks(self.rows_per_part, p.numel(), half)
            self.totals[i] = acc.add(pieces, chunks, g, self.keep_sum, target)
        if self.positions is not None:
            self.positions.add(us, p, g, target)
        key = "+".join(sorted({u.rule for u in us}))
        self.coverage[key] = self.coverage.get(key, 0) + p.numel()
        self.done.add(i)
        if release:
            for u in us:
                self.pending[id(u)] -= 1
                if self.pending[id(u)] == 0:
                    u.a = u.b = u.xhat = u.capture = None  # every parameter of this use is read: let them go

    def finish(self, g_full, fallback, fb, verify):
        acc, m, leaves, totals = self.acc, self.m, self.leaves, self.totals
        for i in self.by_leaf:
            self.param(i, g_full[i])
        acc.flush()
        coverage = self.coverage
        if fallback and self.positions is not None:
            self.positions.fail(
                f"{len(fallback)} parameter(s) are read by the fallback, which has no pieces by position"
            )
        if fallback:
            gf = torch.cat([g_full[i].reshape(-1) for i in fallback])  # [n_fallback]
            n_fb = int(gf.numel())
            coverage["fallback"] = n_fb
            if fb is None:
                fb = torch.zeros(m, n_fb, dtype=gf.dtype, device=self.device)
            tg = gf if self.onto is None else torch.cat([self.onto[i].reshape(-1) for i in fallback])  # [n_fallback]
            acc.dots += dots64(fb, tg)
            if acc.gram is not None:
                acc.gram += gram64(fb, fb)
            if acc.sq is not None:
                acc.sq += _row_sq(fb)
            s = fb.sum(0)
            acc.diff_sq += diff_sq64(s, gf)
            if self.keep_sum:
                off = 0
                for i in fallback:
                    n = leaves[i].numel()
                    totals[i] = s[off : off + n].view_as(leaves[i])
                    off += n
        if verify is not None:
            _verify_one_part(
                verify,
                leaves,
                g_full if self.onto is None else self.onto,
                acc,
                self.rows_per_part,
                self.by_leaf,
                fallback,
                fb,
                self.rp,
                m,
            )
        keep = self.keep_sum
        total_list = [t if t is not None else torch.zeros_like(g) for t, g in zip(totals, g_full)] if keep else []
        along = (self.along_given or along_sums(g_full, self.onto)) if self.along and self.onto is not None else None
        diff_sq = float(acc.diff_sq)
        if along is not None:
            # ‖r‖² of the residual r = Σ_S g_S − g_full projected on v: (Σ_S <g_S, v> − <g_full, v>)² / ‖v‖², a
            # lower bound of ‖r‖² that no missing term, use or row escapes unless it is orthogonal to v (the
            # readings made along v are then right whatever it is)
            gap = math.fsum(acc.dots.tolist()) - along.full_dot
            diff_sq = gap * gap / along.onto_sq if along.onto_sq > 0.0 else 0.0
        coverage_t = tuple(sorted(coverage.items()))
        return Reduced(g_full, total_list, acc.dots, acc.gram, diff_sq, coverage_t, acc.sq, along)


def _verify_one_part(verify, leaves, g_full, acc, rows_per_part, by_leaf, fallback, fb, rp, m) -> None:
    terms, ids, spans = verify
    if m == 0:
        return
    weight = rows_per_part if spans is None else spans.positions.tolist()
    k = max(range(m), key=lambda i: weight[i])
    li = terms.terms.masked_select(ids == k).sum()
    if not li.requires_grad:
        return
    gs = torch.autograd.grad(li, list(leaves), allow_unused=True)
    gs = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)]
    dot = math.fsum(float(torch.sum(a.double() * b.double())) for a, b in zip(gs, g_full))
    full = math.sqrt(math.fsum(float(torch.sum(b.double() ** 2)) for b in g_full)) or 1.0
    part = math.sqrt(math.fsum(float(torch.sum(a.double() ** 2)) for a in gs))
    tol = (
        1e-4
        if leaves and leaves[0].dtype in (torch.float32,)
        else (1e-10 if leaves and leaves[0].dtype == torch.float64 else 1e-2)
    )
    err = abs(dot - float(acc.dots[k])) / (part * full or 1.0)
    if err > tol:
        if spans is not None:
            raise SpansInteract(
                f"part {k}'s gradient by its own backward disagrees with the pieces at its positions ({err:.3e} "
                "relative): attention crosses the packed rollouts (the position ids do not restart where a rollout "
                "does, or the attention mask is not block-diagonal), so a rollout's gradient is not its own "
                "positions'. Keep attention inside each rollout, or audit with engine='reference'."
            )
        raise RowInteraction(
            f"part {k}'s gradient by its own backward disagrees with the one-pass pieces ({err:.3e} relative): rows "
            "of this batch interact (a cross-row term in the loss or a module that mixes rows). Use engine='reference'."
        )


# ---- riding on the training step's own forward and backward ----------------------------------------


class _TermsWrapper:
    """The module's ``credit_terms``, wrapped once for every :class:`RideAlong` riding on it.

    Several riders (e.g. a credit audit and a probe reading, both riding along) join the one wrapper, so
    they may start and stop in any order and the module's own ``credit_terms`` comes back when the last
    leaves."""

    def __init__(self, module: nn.Module) -> None:
        self.orig = getattr(module, "credit_terms")
        self.had_attr = "credit_terms" in module.__dict__
        self.riders: list["RideAlong"] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.orig(*args, **kwargs)
        riders = list(self.riders)
        for r in riders:
            r.cap.active = True
        try:
            t = self.orig(*args, **kwargs)
        finally:
            for r in riders:
                r.cap.active = False
        for r in riders:
            r._took(t)
        return t

    @classmethod
    def join(cls, module: nn.Module, rider: "RideAlong") -> None:
        w = module.__dict__.get("credit_terms")
        if not isinstance(w, cls):
            w = cls(module)
            object.__setattr__(module, "credit_terms", w)
        w.riders.append(rider)

    @classmethod
    def leave(cls, module: nn.Module, rider: "RideAlong") -> None:
        w = module.__dict__.get("credit_terms")
        if not isinstance(w, cls) or rider not in w.riders:
            return
        w.riders.remove(rider)
        if not w.riders:
            if w.had_attr:
                object.__setattr__(module, "credit_terms", w.orig)
            else:
                module.__dict__.pop("credit_terms", None)


class RideAlong:
    """The one-pass engine's hooks installed for a training step's own forward and backward.

    ``start()`` installs the layer hooks and wraps the module's ``credit_terms`` so that only its
    forward is captured (not, e.g., sampling under ``no_grad``); ``on_loss(loss, partition_fn, ...)`` is
    called with the loss about to be backpropagated; after the backward, ``report(...)`` reads ``g_full``
    from the parameters' ``.grad`` and adds only the per-layer reductions. ``stop()`` removes everything;
    nothing is kept between steps. The step itself is not changed: hooks return no new value or gradient
    (a broadcast position embedding is expanded to the batch, with the same values and the same backward
    reduction).

    Given the partition at ``on_loss``, every covered parameter is reduced inside the backward, as soon
    as its gradient exists, and the captured tensors of a layer are let go once all its parameters are
    read (as in the separate pass): the output gradients of the whole network are never held at once.
    ``report`` then checks that ``.grad`` is the gradient each parameter was reduced against (its
    squared norm, summed in float64, must be the same number).

    The contract it checks before it reads anything: ``credit_terms`` ran exactly once with grad, the
    loss equals ``terms.sum()`` and its gradient with respect to ``terms`` is one everywhere, every
    trainable parameter is covered by the hooks, the partition keeps rows whole, and the captured pieces
    add up to ``.grad``. Any failure returns a string naming it (the caller falls back to a separate
    pass) rather than a reading.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.cap = RowCapture(module)
        self.calls = 0
        self.terms: Optional[CreditTerms] = None
        self.compute_dtype: Optional[str] = None
        self.terms_grad_ones: Optional[bool] = None
        self.scale = 1.0  # the loss is `scale · terms.sum()` (a trainer's division by the accumulation count)
        self.loss: Optional[torch.Tensor] = None
        self.edges: Optional[dict[int, int]] = None
        self.reentrant = False  # the loss's graph holds a reentrant activation checkpoint
        self._joined = False  # joined to the module's `credit_terms` wrapper (`_TermsWrapper`)
        self.last_along: Optional[AlongSums] = None  # the sums the latest `report(along=True)` took
        self._plan: Any = None  # what on_loss prepared: a dict (reducing in the backward) or the reason it could not
        self._handles: list[Any] = []

    def start(self) -> "RideAlong":
        self.cap.install()
        _TermsWrapper.join(self.module, self)
        self._joined = True
        return self

    def _took(self, t: Any) -> None:
        """The training step's ``credit_terms`` returned ``t`` (grad enabled, this rider's capture on)."""
        self.calls += 1
        self.terms = t
        self.compute_dtype = compute_dtype_now(self.module)  # autocast's dtype in the training step, if any
        if isinstance(t, CreditTerms) and t.terms.requires_grad:
            ref = weakref.ref(self)  # weak: the graph holds the hook, and this rider holds the terms

            def hook(g: torch.Tensor) -> None:
                rider = ref()
                if rider is not None:
                    rider._terms_grad(g)

            t.terms.register_hook(hook)

    def _terms_grad(self, g: torch.Tensor) -> None:
        ones = bool(torch.all(g == self.scale))
        self.terms_grad_ones = ones if self.terms_grad_ones is None else (self.terms_grad_ones and ones)
        return None

    def on_loss(
        self,
        loss: torch.Tensor,
        partition_fn: Optional[Callable[[CreditTerms], Partition]] = None,
        *,
        readings: str = "all",
        memory_budget: Optional[int] = None,
        keep_grads: bool = False,
        route: str = "auto",
        scale: float = 1.0,
        position_split: bool = False,
    ) -> None:
        """Called with the loss before its backward: the graph's edges are counted while it exists.

        With ``partition_fn`` (and the other arguments ``report`` takes), each covered parameter is
        reduced inside the coming backward. ``scale``: the loss is ``scale · terms.sum()`` (Lightning divides
        the training step's loss by ``accumulate_grad_batches``); the readings are then of the gradient the
        backward forms, ``.grad``'s units. Nothing here raises: what cannot be prepared is reported by
        ``report``.
        """
        self.scale = float(scale)
        self.loss = loss.detach()
        leaves = [p for p in self.module.parameters() if p.requires_grad]
        self.edges = _leaf_edges(loss, leaves) if loss.requires_grad else {}
        self.reentrant = loss.requires_grad and reentrant_checkpoints(loss)
        self._plan = None
        if partition_fn is None or not loss.requires_grad:
            return
        try:
            self._plan = self._prepare(partition_fn, readings, memory_budget, keep_grads, route, position_split)
        except Exception as err:  # reported by `report`, never raised into the training step
            self._plan = f"{type(err).__name__}: {err}"

    def _layout(self, partition_fn: Callable[[CreditTerms], Partition]) -> Union[str, dict[str, Any]]:
        """The partition's rows and the parameters' uses, or the reason the step cannot ride along."""
        if self.calls != 1 or self.terms is None:
            return f"`credit_terms` ran {self.calls} times with grad enabled in the training step; riding along needs exactly one."
        t = validate_terms(self.terms)
        part = partition_fn(t.detached())
        part.check_covers(t.trained)
        B = int(t.terms.shape[0])
        rp, spans = layout(part, B)
        if rp is None:
            return SPLITS_ROWS + "; riding along needs whole rows (or spans of rows, Partition.positions)."
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        leaves = [p for _, p in named]
        uses, why = stack_spans(self.cap.uses, B)
        if why is not None:
            return f"`batch_rows` was used, but {why}."
        if spans is not None:
            uses, B = part_rows(uses, spans), part.n_parts
        by_leaf = plan_uses(uses, leaves, B, self.edges or {})
        missing = [names[i] for i in range(len(leaves)) if i not in by_leaf]
        if missing:
            return _uncovered(missing, self.reentrant)
        return {
            "part": part,
            "rp": rp,
            "names": names,
            "leaves": leaves,
            "by_leaf": by_leaf,
            "uses": uses,
            "spans": spans,
        }

    def _prepare(
        self, partition_fn, readings, memory_budget, keep_grads, route, position_split=False
    ) -> Union[str, dict[str, Any]]:
        lay = self._layout(partition_fn)
        if isinstance(lay, str):
            return lay
        pdots = PositionDots(*position_parts(validate_terms(self.terms))) if position_split else None
        red = _Reducer(
            lay["by_leaf"],
            lay["leaves"],
            lay["rp"],
            lay["part"].n_parts,
            readings,
            keep_grads,
            memory_budget,
            route,
            positions=pdots,
        )
        # ‖g‖² of the gradient each parameter was reduced against, to hold against its `.grad` afterwards
        seen = torch.full((len(lay["leaves"]),), float("nan"), dtype=torch.float64, device=red.device)  # [n_leaves]
        plan: dict[str, Any] = {
            **lay,
            "red": red,
            "seen": seen,
            "args": (readings, keep_grads),
            "error": None,
            "positions": pdots,
        }

        def hook(i: int) -> Callable[[torch.Tensor], None]:
            def on_grad(g: torch.Tensor) -> None:
                if plan["error"] is not None:
                    return None
                try:
                    g = g.detach()
                    seen[i] = _sq_t(g)
                    red.param(i, g, release=True)
                except Exception as err:  # inside the training backward: reported by `report`, never raised
                    plan["error"] = f"{type(err).__name__}: {err}"
                return None

            return on_grad

        self._handles = [lay["leaves"][i].register_hook(hook(i)) for i in lay["by_leaf"]]
        return plan

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def stop(self) -> None:
        self.cap.remove()
        self._remove_hooks()
        if self._joined:
            _TermsWrapper.leave(self.module, self)
            self._joined = False
        seal(self.cap.uses)

    def clear(self) -> None:
        self.stop()
        self.cap.clear()
        self.terms = None
        self.loss = None
        self.edges = None
        self._plan = None

    def report(
        self,
        partition_fn: Callable[[CreditTerms], Partition],
        *,
        partition_name: str = "",
        readings: str = "all",
        memory_budget: Optional[int] = None,
        keep_grads: bool = False,
        route: str = "auto",
        project_onto: Optional[Sequence[Optional[torch.Tensor]]] = None,
        along: Union[bool, AlongSums] = False,
    ) -> Union[CreditReport, str]:
        """The step's credit from the captured pieces and ``.grad``, or the reason it cannot be read.

        When ``on_loss`` was given the partition, the reductions it started in the backward are finished
        here (``readings`` and ``keep_grads`` must then be the ones it was given). ``project_onto``: a vector
        known only after the backward (one tensor per trainable parameter) that the parts are dotted with
        instead of ``g_full``, as in ``disintegrate``; it needs ``on_loss`` without a partition (the captured
        tensors are then held until here). The captures are kept until :meth:`clear`, so a step may be read
        against several vectors. ``along`` (with ``project_onto`` and ``readings="projected"``): the parts'
        sum is held against ``.grad`` along ``v`` alone — ``Σ_S g_S`` is not formed, so a weight's parts cost
        one product of the size of its forward — and ``conservation_error`` is the residual's component along
        ``v`` over ``‖g_full‖`` (a lower bound of the full one; what the readings along ``v`` depend on), and the
        sums it took (``‖.grad‖²``, ``<.grad, v>``, ``‖v‖²``) are left in :attr:`last_along` for the caller.
        ``along`` may be those sums, taken by the caller from ``.grad`` and ``v`` (the probe's map pass does):
        the check reads them instead of a pass over ``.grad`` and ``v`` of its own.
        """
        self.stop()
        self.last_along = None
        plan, self._plan = self._plan, None
        if plan is not None and project_onto is not None:
            raise ValueError(
                "`project_onto` must be given with on_loss(loss) called without a partition, got a partition at "
                "on_loss: its reductions were taken against `.grad` inside the backward."
            )
        broken = self._contract()
        if broken is not None:
            return broken
        t = self.terms
        assert t is not None and self.loss is not None
        if isinstance(plan, str):
            return plan
        if plan is not None and plan["args"] != (readings, keep_grads):
            raise ValueError(
                f"`readings`/`keep_grads` must be the ones given to on_loss {plan['args']!r}, got {(readings, keep_grads)!r}."
            )
        lay = plan if plan is not None else self._layout(partition_fn)
        if isinstance(lay, str):
            return lay
        part, names, leaves, by_leaf = lay["part"], lay["names"], lay["leaves"], lay["by_leaf"]
        onto = dots_onto(leaves, project_onto)
        g_full, sq_each, full_sq = _grads_now(leaves, keep_grads, sums=plan is not None or along is False)
        if plan is not None and plan["error"] is not None:
            return f"the reduction inside the training backward failed: {plan['error']}"
        if plan is not None:
            red = plan["red"]
            done = sorted(red.done)
            seen = plan["seen"][done]  # [n_done]
            assert sq_each is not None
            have = sq_each[done].to(seen.device)  # [n_done]
            if not torch.equal(seen, have):  # the same function of the same bits: equal unless `.grad` differs
                bad = int((seen != have).nonzero()[0, 0])
                return (
                    f"`.grad` of {names[done[bad]]!r} is not the gradient of this backward (squared norm "
                    f"{float(have[bad]):.6e} against {float(seen[bad]):.6e} seen in it): was it zeroed before the step?"
                )
            reduced = red.finish(g_full, [], None, None)
        else:
            reduced = reduce_pieces(
                lay["uses"],
                by_leaf,
                leaves,
                g_full,
                lay["rp"],
                part.n_parts,
                readings,
                keep_grads,
                memory_budget,
                [],
                None,
                route=route,
                onto=onto,
                along=along,
            )
            if reduced.along is not None:
                full_sq = reduced.along.full_sq
        self.last_along = reduced.along
        split = read_position_split(plan["positions"], g_full, None, full_sq) if plan is not None else None
        return _ride_report(
            reduced,
            full_sq,
            t,
            float(self.loss),
            names,
            part.names,
            readings,
            partition_name,
            keep_grads,
            self.compute_dtype,
            spans=lay["spans"] is not None,
            position_split=split,
            onto=onto,
        )

    def _contract(self) -> Optional[str]:
        """What breaks the contract of riding along (``credit_terms`` once, a backward of ``scale · terms.sum()``
        with gradient ``scale`` on every term), or None."""
        if self.calls != 1 or self.terms is None:
            return f"`credit_terms` ran {self.calls} times with grad enabled in the training step; riding along needs exactly one."
        if self.loss is None or self.edges is None:
            return "no backward of the training loss was seen in this step (manual optimization, or no loss)."
        t = self.terms
        total = t.terms.detach().sum() * self.scale
        tol = _tolerance(t.terms.dtype)
        if self.terms_grad_ones is not True or not bool(
            torch.isclose(self.loss.to(total.dtype), total, rtol=tol, atol=tol * float(t.terms.detach().abs().sum()))
        ):
            what = "`terms.sum()`" if self.scale == 1.0 else f"{self.scale:.6g} · `terms.sum()`"
            grad = "one" if self.scale == 1.0 else f"{self.scale:.6g}"
            return (
                f"the training loss ({float(self.loss):.6g}) is not {what} ({float(total):.6g}) with gradient {grad} on "
                "every term, so the captured gradients are not the terms' gradients."
            )
        return None


def _uncovered(missing: Sequence[str], reentrant: bool) -> str:
    """Why riding along cannot read parameters the hooks did not see (``missing``)."""
    if reentrant:
        return f"{REENTRANT_WORDS} ({len(missing)} parameters unseen, e.g. {missing[0]!r})."
    return f"parameters {list(missing[:3])!r} ({len(missing)} in all) are used outside the layers the hooks cover."


def _grads_now(
    leaves: Sequence[torch.Tensor], keep: bool, sums: bool = True
) -> tuple[list[torch.Tensor], Optional[torch.Tensor], float]:
    """``(g_full, ‖g‖² per parameter, ‖g_full‖²)`` from ``.grad`` (cloned when kept past the step: ``.grad`` may
    be zeroed in place later); without ``sums``, ``(g_full, None, nan)``: a check along a vector takes them."""
    g_full = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in leaves]
    if keep:
        g_full = [g.clone() for g in g_full]
    if not sums:
        return g_full, None, float("nan")
    sq_each = torch.stack([_sq_t(g) for g in g_full]) if g_full else torch.zeros(0, dtype=torch.float64)  # [n_leaves]
    return g_full, sq_each, float(sq_each.sum())


def _ride_report(
    reduced: tuple,
    full_sq: float,
    t: CreditTerms,
    loss: float,
    names: Sequence[str],
    part_names: Sequence[str],
    readings: str,
    partition_name: str,
    keep_grads: bool,
    compute_dtype: Optional[str] = None,
    spans: bool = False,
    position_split: Optional[PositionSplit] = None,
    onto: Optional[Sequence[torch.Tensor]] = None,
) -> Union[CreditReport, str]:
    """The report of a step read riding along, once the captured pieces are shown to add up to ``.grad``
    (``onto``: what the parts were dotted with, when not ``.grad``).

    They add up within the floor of the coarser of the terms' dtype and autocast's (``compute_dtype``): under
    ``bf16-mixed`` the layers' inputs and output gradients are bfloat16, and so is their rounding. Beyond it
    the step's loss holds a term that ``terms`` does not."""
    used = str(t.terms.dtype).replace("torch.", "")
    report = build_report(
        reduced,
        names,
        part_names,
        readings,
        grad_match=None,
        dtype=used,
        n_trained=t.n_trained,
        loss=loss,
        partition=partition_name,
        engine="ghost+training_step",
        keep_grads=keep_grads,
        full_sq=full_sq,
        compute_dtype=compute_dtype,
        spans=spans,
        position_split=position_split,
        onto=onto,
    )
    if report.conservation_violated:
        where = used if compute_dtype is None else f"{used} under {compute_dtype} autocast"
        return (
            f"the captured pieces do not add up to `.grad` ({report.conservation_error:.3e} relative, over the "
            f"{report.conservation_floor:.1e} that rounding in {where} explains): not rounding, a term of the step's "
            "loss is not in `terms` (or `.grad` was changed between the backward and the optimizer step)."
        )
    return report


def _merge_uses(groups: Sequence[Sequence[_Use]], batches: Sequence[int]) -> Union[list[_Use], str]:
    """Each micro-batch's captured uses as the uses of one batch, their rows stacked in order.

    Rows do not interact, so a row's piece of a parameter is a function of that row's input and output
    gradient alone, wherever the row was computed: the stacked uses give every row's piece exactly. The
    micro-batches' own tensors are let go as they are stacked."""
    why = _unstackable(groups, batches, "the micro-batches' forwards")
    if why is not None:
        return why
    out: list[_Use] = []
    for us in zip(*groups):
        merged = _StackedUse(us, batches)
        _ = merged.b  # every backward is over: stack the output gradients now and let the micro-batches' go
        merged.calls = us[0].calls  # held against one micro-batch's graph (each has the same edges)
        merged.sealed = True
        out.append(merged)
    return out


def report_accumulated(
    riders: Sequence[RideAlong],
    partition_fn: Callable[[CreditTerms], Partition],
    *,
    partition_name: str = "",
    readings: str = "all",
    memory_budget: Optional[int] = None,
    keep_grads: bool = False,
    route: str = "auto",
    position_split: bool = False,
) -> Union[CreditReport, str]:
    """One optimizer step's credit over its accumulated micro-batches, each captured riding on its own
    forward and backward, or the reason it cannot be read.

    With gradient accumulation a part of an early micro-batch must be dotted with the whole step's
    gradient, which exists only after the last backward. So each micro-batch's :class:`RideAlong` only
    captures (``on_loss`` given no partition: nothing is reduced in its backward) and its layers' inputs
    and output gradients are kept; call this after the last backward, before anything clips or zeroes
    ``.grad``. The micro-batches' rows are stacked as one batch (rows do not interact) and reduced once
    against ``.grad``, the gradient the optimizer receives: every reading of one batch, a part's rows may
    lie in several micro-batches, and the conservation error holds the parts' sum against ``.grad``.

    Memory: every micro-batch's captured tensors are held to the step's end (for a LoRA adapter, its
    layers' inputs and output gradients only) and stacked once.
    """
    if not riders:
        raise ValueError("`riders` must hold one RideAlong per micro-batch, got none.")
    module = riders[0].module
    trained = [id(p) for p in module.parameters() if p.requires_grad]
    if any([id(p) for p in r.module.parameters() if p.requires_grad] != trained for r in riders):
        raise ValueError("`riders` must all ride on the same module's parameters; got riders of different modules.")
    for k, r in enumerate(riders):
        r.stop()
        plan, r._plan = r._plan, None
        if plan is not None:
            raise ValueError(
                f"`riders[{k}]` was given a partition at on_loss, so it reduced against its own backward's gradient; "
                "call on_loss(loss) without a partition on every micro-batch of an accumulated step."
            )
        broken = r._contract()
        if broken is not None:
            return f"micro-batch {k}: {broken}"
    terms = [validate_terms(r.terms) for r in riders]
    if len({int(t.terms.shape[1]) for t in terms}) != 1:
        return f"the micro-batches have {[int(t.terms.shape[1]) for t in terms]} positions per row; stacking their rows needs one length."
    t = cat_terms(terms)  # rollout ids repeated across micro-batches become parts keyed by micro-batch
    part = partition_fn(t.detached())
    part.check_covers(t.trained)
    rp, spans = layout(part, int(t.terms.shape[0]))
    if rp is None:
        return SPLITS_ROWS + "; riding along needs whole rows (or spans of rows, Partition.positions)."
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names, leaves = [n for n, _ in named], [p for _, p in named]
    batches = [int(x.terms.shape[0]) for x in terms]
    for k, r in enumerate(riders):
        by = plan_uses(r.cap.uses, leaves, batches[k], r.edges or {})
        missing = [names[i] for i in range(len(leaves)) if i not in by]
        if missing:
            return _uncovered(missing, r.reentrant)
    uses = _merge_uses([r.cap.uses for r in riders], batches)
    if isinstance(uses, str):
        return uses
    rows = sum(batches)
    if spans is not None:
        uses, rows = part_rows(uses, spans), part.n_parts
    by_leaf = plan_uses(uses, leaves, rows, riders[0].edges or {})
    g_full, _, full_sq = _grads_now(leaves, keep_grads)
    pdots = PositionDots(*position_parts(t)) if position_split else None
    reduced = reduce_pieces(
        uses,
        by_leaf,
        leaves,
        g_full,
        rp,
        part.n_parts,
        readings,
        keep_grads,
        memory_budget,
        [],
        None,
        route=route,
        positions=pdots,
    )
    loss = math.fsum(float(r.loss) for r in riders)  # type: ignore[arg-type]
    return _ride_report(
        reduced,
        full_sq,
        t,
        loss,
        names,
        part.names,
        readings,
        partition_name,
        keep_grads,
        riders[-1].compute_dtype,
        spans=spans is not None,
        position_split=read_position_split(pdots, g_full, None, full_sq),
    )


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 1e-2)
