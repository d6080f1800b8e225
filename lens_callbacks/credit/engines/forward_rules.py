r"""Forward-mode rules that keep the tangent pass within the plain step's memory, one small function per op.

The forward-mode engine carries a tangent through the user's ``credit_terms``. torch's own forward-mode
formulas are exact but allocate freely, and on a language model the largest tensors are vocabulary-wide:
``[B, T, V]`` logits and their log-softmax. torch forms the head's tangent as ``ẊWᵀ + XẆᵀ`` (two products
and their sum: three logits-sized buffers at once) and the log-softmax's as ``ẋ − Σ softmax(x) ∘ ẋ`` (the
softmax and the product each a full buffer), so the tangent pass peaked above the training step it audits.
While :class:`ForwardRules` is entered these ops take the rules below instead, which compute the same
derivatives with no buffer the result does not need:

- ``linear``: ``Ẏ = ẊWᵀ``, then ``XẆᵀ`` accumulated into it in place (``addmm_``), then ``ḃ``;
- ``log_softmax``: ``ẏ = ẋ − Σ_dim exp(y) ∘ ẋ`` with the sum taken slice by slice, so the softmax and the
  product exist one slice at a time. Inside :class:`ForwardRules` the subtraction is deferred to where the
  result is read: a ``gather`` along ``dim`` (the taken tokens' log-probabilities) applies it to the picked
  entries only, so the log-softmax's tangent is never a vocabulary-wide buffer of its own; any other read
  forms it whole first;
- ``scaled_dot_product_attention``: :func:`~lens_callbacks.credit.engines.attention.attention_jvp`.

Each rule applies only where a tangent reaches the op; otherwise torch's op runs unchanged. Each equals
torch's forward-mode derivative to float64 rounding (tests/credit/test_forward_rules.py).

Pure torch; never imports lightning.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from .attention import ForwardAttention

__all__ = ["ForwardRules", "DeferredWrite", "linear_jvp", "log_softmax_jvp", "RULES"]

#: Elements of one slice of the log-softmax's sum (16 Mi: 64 MiB in float32).
SLICE_ELEMENTS = 1 << 24


def linear_jvp(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Any:
    """``F.linear`` on dual tensors: ``(XWᵀ + b, ẊWᵀ + XẆᵀ + ḃ)``, the second product added in place.

    Returns ``NotImplemented`` when no input carries a tangent (torch's op then runs).
    """
    xp, dx = fwAD.unpack_dual(input)
    wp, dw = fwAD.unpack_dual(weight)
    bp, db = fwAD.unpack_dual(bias) if bias is not None else (None, None)
    if dx is None and dw is None and db is None:
        return NotImplemented
    y = F.linear(xp, wp, bp)
    t = F.linear(dx, wp) if dx is not None else None  # ẊWᵀ
    if dw is not None:
        if t is not None and xp.dim() > 1 and t.is_contiguous() and t.dtype == xp.dtype == dw.dtype:
            t.view(-1, t.shape[-1]).addmm_(xp.reshape(-1, xp.shape[-1]), dw.t())  # + XẆᵀ, no third buffer
        else:  # autocast (mixed dtypes) or a 1-D input: torch's sum
            u = F.linear(xp, dw)
            t = u if t is None else t + u
    if db is not None:
        t = db.to(y.dtype).expand_as(y).clone() if t is None else t.add_(db)
    return fwAD.make_dual(y, t)


def log_softmax_jvp(input: torch.Tensor, dim: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> Any:
    """``log_softmax`` on a dual tensor: ``(y, ẋ − Σ_dim exp(y) ∘ ẋ)``, the sum one slice at a time.

    Takes the arguments of ``torch.log_softmax`` and ``Tensor.log_softmax``; returns ``NotImplemented`` when the
    input carries no tangent or ``dim`` is not an int (implicit, or a dimension name): torch's op then runs.
    """
    if not isinstance(dim, int) or isinstance(dim, bool):
        return NotImplemented
    xp, dx = fwAD.unpack_dual(input)
    if dx is None:
        return NotImplemented
    y = torch.empty(xp.shape, dtype=dtype if dtype is not None else xp.dtype, device=xp.device)
    dx = dx.to(y.dtype)
    d = dim % y.dim() if y.dim() else 0
    r = _log_softmax_into(xp, d, dtype, y, dx)  # y = log_softmax(x); r = Σ_dim softmax ∘ ẋ, keepdim
    return fwAD.make_dual(y, dx - r)


def _functional_log_softmax(
    input: torch.Tensor, dim: Optional[int] = None, _stacklevel: int = 3, dtype: Optional[torch.dtype] = None
) -> Any:
    """``F.log_softmax``'s arguments (``_stacklevel`` before ``dtype``) for :func:`log_softmax_jvp`."""
    return log_softmax_jvp(input, dim, dtype)


def _log_softmax_into(
    xp: torch.Tensor, dim: int, dtype: Optional[torch.dtype], y: torch.Tensor, dx: torch.Tensor
) -> torch.Tensor:
    """``y ← log_softmax(xp)`` written slice by slice (torch's kernel wants contiguous slices: a whole-tensor
    call on a strided ``y`` would form the result once more beside it), returning ``Σ_dim exp(y) ∘ dx``
    (keepdim) taken from each slice while it is at hand."""
    others = [i for i in range(y.dim()) if i != dim]
    if not others:
        y.copy_(torch.log_softmax(xp, dim, dtype=dtype))
        return y.exp().mul_(dx).sum(dim, keepdim=True)
    split = max(others, key=lambda i: y.shape[i])
    n = y.shape[split]
    per = max(1, SLICE_ELEMENTS // max(1, y.numel() // max(1, n)))
    parts = []
    for a in range(0, n, per):
        w = min(per, n - a)
        ys = torch.log_softmax(xp.narrow(split, a, w), dim, dtype=dtype)
        y.narrow(split, a, w).copy_(ys)
        parts.append(ys.exp_().mul_(dx.narrow(split, a, w)).sum(dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=split)


#: torch function → (op name, forward-mode rule); each rule returns NotImplemented where it does not apply.
RULES: dict[Any, tuple[str, Callable[..., Any]]] = {
    torch._C._nn.linear: ("linear", linear_jvp),
    torch.log_softmax: ("log_softmax", log_softmax_jvp),
    torch.Tensor.log_softmax: ("log_softmax", log_softmax_jvp),
    F.log_softmax: ("log_softmax", _functional_log_softmax),
}


class _Deferred:
    """A log-softmax whose tangent ``ẋ − r`` is not formed yet: the dual carries ``ẋ`` itself until an op other
    than a ``gather`` along ``dim`` reads it."""

    __slots__ = ("dx", "r", "dim", "full")

    def __init__(self, dx: torch.Tensor, r: torch.Tensor, dim: int) -> None:
        self.dx, self.r, self.dim = dx, r, dim  # ẋ; Σ_dim softmax ∘ ẋ (keepdim); the softmax's dim
        self.full: Optional[torch.Tensor] = None  # the dual with its whole tangent, once an op needed it


#: ops that read a tensor's metadata only: a deferred log-softmax passes through them as it is
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.stride,
    torch.Tensor.numel,
    torch.Tensor.is_contiguous,
    torch.Tensor.__len__,
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_floating_point,
}
_GATHER = {torch.gather, torch.Tensor.gather}
#: a view of ``ẋ`` can be the tangent of the log-softmax when its base is at most this much larger
_BASE_SLACK = 1.25


class DeferredWrite(RuntimeError):
    """An op would write into a log-softmax whose tangent the forward-mode pass has deferred."""


class ForwardRules(ForwardAttention):
    """While entered, ``linear``, ``log_softmax`` and ``scaled_dot_product_attention`` on dual tensors take their rules.

    A log-softmax's tangent ``ẋ − Σ softmax ∘ ẋ`` is deferred: the dual it returns carries ``ẋ`` (no new
    vocabulary-wide buffer), and the correction is applied where the result is read — to the picked entries
    only when the read is a ``gather`` along the softmax's dim (the taken tokens' log-probabilities), to the
    whole tensor, formed then, by any other op. An op that would write into such a result raises
    :class:`DeferredWrite`.

    ``calls`` counts the attention calls the attention rule computed; ``rule_calls`` counts every rule's
    calls by op name (a deferred log-softmax read by a gather also counts ``gather``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rule_calls: dict[str, int] = {}
        self._deferred: dict[int, tuple[weakref.ref, _Deferred]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._deferred:
            out = self._read_deferred(func, args, kwargs)
            if out is not NotImplemented:
                return out
        entry = RULES.get(func)
        if entry is not None:
            name, rule = entry
            out = self._log_softmax(func, args, kwargs) if name == "log_softmax" else None
            if out is None:
                out = rule(*args, **kwargs)
            if out is not NotImplemented:
                self._count(name)
                return out
            return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def resolve(self, t: Any) -> Any:
        """``t`` with its whole tangent: a deferred log-softmax's dual formed (anything else as it is). What the
        pass hands on past the mode's exit goes through here first; inside the mode every read does."""
        d = self._find(t)
        if d is None:
            return t
        if d.full is None:
            d.full = fwAD.make_dual(fwAD.unpack_dual(t).primal, d.dx - d.r)
        return d.full

    def _count(self, name: str) -> None:
        self.rule_calls[name] = self.rule_calls.get(name, 0) + 1

    def _log_softmax(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The log-softmax with its tangent deferred, or None where :func:`log_softmax_jvp` runs instead (the
        tangent is not laid out as the result can be, or ``dim`` is not an int)."""
        names = ("input", "dim", "_stacklevel", "dtype") if func is F.log_softmax else ("input", "dim", "dtype")
        call = dict(zip(names, args))
        call.update(kwargs)
        x, dim, dtype = call.get("input"), call.get("dim"), call.get("dtype")
        if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or isinstance(dim, bool):
            return None
        xp, dx = fwAD.unpack_dual(x)
        if dx is None:
            return None
        out_dtype = dtype if dtype is not None else xp.dtype
        if dx.dtype != out_dtype or not out_dtype.is_floating_point:
            return None
        base = dx if dx._base is None else dx._base
        if base.numel() > _BASE_SLACK * max(1, dx.numel()):
            return None
        # the result laid out as ẋ is within its base, so that the dual takes ẋ as its tangent without a copy
        y = torch.empty_like(base, dtype=out_dtype).as_strided(dx.shape, dx.stride(), dx.storage_offset())
        d = dim % y.dim() if y.dim() else 0
        r = _log_softmax_into(xp, d, dtype, y, dx)  # y = log_softmax(x); r = Σ_dim softmax ∘ ẋ, keepdim
        out = fwAD.make_dual(y, dx)
        key = id(out)
        self._deferred[key] = (weakref.ref(out, lambda _, k=key, d=self._deferred: d.pop(k, None)), _Deferred(dx, r, d))
        return out

    def _find(self, t: Any) -> Optional[_Deferred]:
        if not isinstance(t, torch.Tensor):
            return None
        hit = self._deferred.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def _read_deferred(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` on arguments that hold a deferred log-softmax, or NotImplemented when none does."""
        found = False
        for a in itertools.chain(args, kwargs.values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            if any(self._find(t) is not None for t in items):
                found = True
                break
        if not found or func in _METADATA:
            return NotImplemented
        if func in _GATHER:
            out = self._gather(args, kwargs)
            if out is not None:
                return out
        name = getattr(func, "__name__", "")
        if (
            (name.endswith("_") and not name.endswith("__"))
            or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
            or "out" in kwargs
        ):
            raise DeferredWrite(
                f"`{name}` would write into the result of a log_softmax whose forward-mode tangent is deferred; "
                "write into a copy (`.clone()`) or audit with engine='reference'."
            )

        whole = self.resolve

        def swap(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(whole(t) for t in a) if not hasattr(a, "_fields") else type(a)(*(whole(t) for t in a))
            return whole(a)

        return func(*(swap(a) for a in args), **{k: swap(v) for k, v in kwargs.items()})

    def _gather(self, args: Any, kwargs: Any) -> Any:
        """``gather`` of a deferred log-softmax along its dim: ``ẋ[idx] − r`` at the picked entries only."""
        call = dict(zip(("input", "dim", "index"), args))
        call.update(kwargs)
        x, dim, index = call.get("input"), call.get("dim"), call.get("index")
        d = self._find(x)
        if (
            d is None
            or not isinstance(dim, int)
            or not isinstance(index, torch.Tensor)
            or self._find(index) is not None
        ):
            return None
        if dim % max(1, x.dim()) != d.dim or set(call) - {"input", "dim", "index", "sparse_grad"}:
            return None
        y = fwAD.unpack_dual(x).primal
        ip = fwAD.unpack_dual(index).primal
        t = torch.gather(d.dx, d.dim, ip) - torch.gather(d.r, d.dim, torch.zeros_like(ip))
        self._count("gather")
        return fwAD.make_dual(torch.gather(y, d.dim, ip), t)
