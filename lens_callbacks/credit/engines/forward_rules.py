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
  product exist one slice at a time;
- ``scaled_dot_product_attention``: :func:`~lens_callbacks.credit.engines.attention.attention_jvp`.

Each rule applies only where a tangent reaches the op; otherwise torch's op runs unchanged. Each equals
torch's forward-mode derivative to float64 rounding (tests/credit/test_forward_rules.py).

Pure torch; never imports lightning.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from .attention import ForwardAttention

__all__ = ["ForwardRules", "linear_jvp", "log_softmax_jvp", "RULES"]

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
    y = torch.log_softmax(xp, dim, dtype=dtype)
    dx = dx.to(y.dtype)
    d = dim % y.dim() if y.dim() else 0
    r = _softmax_dot(y, dx, d)  # Σ_dim softmax ∘ ẋ, keepdim
    return fwAD.make_dual(y, dx - r)


def _functional_log_softmax(
    input: torch.Tensor, dim: Optional[int] = None, _stacklevel: int = 3, dtype: Optional[torch.dtype] = None
) -> Any:
    """``F.log_softmax``'s arguments (``_stacklevel`` before ``dtype``) for :func:`log_softmax_jvp`."""
    return log_softmax_jvp(input, dim, dtype)


def _softmax_dot(y: torch.Tensor, dx: torch.Tensor, dim: int) -> torch.Tensor:
    """``Σ_dim exp(y) ∘ dx`` (keepdim), in slices of about ``SLICE_ELEMENTS`` along the largest other dimension."""
    others = [i for i in range(y.dim()) if i != dim]
    if not others:
        return y.exp().mul_(dx).sum(dim, keepdim=True)
    split = max(others, key=lambda i: y.shape[i])
    n = y.shape[split]
    per = max(1, SLICE_ELEMENTS // max(1, y.numel() // max(1, n)))
    parts = [
        y.narrow(split, a, min(per, n - a)).exp().mul_(dx.narrow(split, a, min(per, n - a))).sum(dim, keepdim=True)
        for a in range(0, n, per)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=split)


#: torch function → (op name, forward-mode rule); each rule returns NotImplemented where it does not apply.
RULES: dict[Any, tuple[str, Callable[..., Any]]] = {
    torch._C._nn.linear: ("linear", linear_jvp),
    torch.log_softmax: ("log_softmax", log_softmax_jvp),
    torch.Tensor.log_softmax: ("log_softmax", log_softmax_jvp),
    F.log_softmax: ("log_softmax", _functional_log_softmax),
}


class ForwardRules(ForwardAttention):
    """While entered, ``linear``, ``log_softmax`` and ``scaled_dot_product_attention`` on dual tensors take their rules.

    ``calls`` counts the attention calls the attention rule computed; ``rule_calls`` counts every rule's
    calls by op name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rule_calls: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entry = RULES.get(func)
        if entry is not None:
            name, rule = entry
            out = rule(*args, **(kwargs or {}))
            if out is not NotImplemented:
                self.rule_calls[name] = self.rule_calls.get(name, 0) + 1
                return out
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)
