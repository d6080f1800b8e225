r"""Mergers of the fast gradient with the anchor's sign reference ``M_anchor``.

``signed_ema`` (the operating merger): ``G_corr = α·G + (1−α)·|G|·sign(M)``. Where signs agree it returns
``G``; where they disagree ``(2α − 1)·G``.

``projected`` (additive over it): per-coordinate confidence ``w_i = clip(|M_i|/(κ·quantile_p(|M|)), 0, 1)``,
trust ``τ`` per block, ``α_eff = α + (1−α)(1−τ)``,
``signed_i = w_i·|G_i|·sign(M_i) + (1−w_i)·G_i``, ``G_corr = α_eff·G + (1−α_eff)·signed``.
At ``τ = 1, w ≡ 1`` it is ``signed_ema`` bit for bit. The output's magnitude is always ``|G|``'s.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["signed_ema", "projected_merge", "confidence_weights", "ema_update"]


def _mix(g: torch.Tensor, signed: torch.Tensor, alpha: float) -> torch.Tensor:
    # The one expression both mergers end in, so that full confidence is bitwise signed_ema.
    return alpha * g + (1.0 - alpha) * signed


def signed_ema(g: torch.Tensor, m: torch.Tensor, alpha: float = 0.25) -> torch.Tensor:
    r"""``α·G + (1−α)·|G|·sign(M)``.

    Example:
        >>> signed_ema(torch.tensor([2.0, 2.0]), torch.tensor([1.0, -3.0])).tolist()
        [2.0, -1.0]
    """
    return _mix(g, g.abs() * torch.sign(m), alpha)


def confidence_weights(m: torch.Tensor, kappa: float = 1.0, p: float = 0.5) -> torch.Tensor:
    r"""``w_i = clip(|M_i| / (κ·quantile_p(|M|)), 0, 1)`` over one tensor.

    The quantile is exact (``kthvalue``, no size limit): the ``ceil(p·n)``-th smallest ``|M_i|``. If it is 0,
    coordinates with ``M_i ≠ 0`` get ``w = 1`` and the others 0.

    Example:
        >>> confidence_weights(torch.tensor([0.0, 1.0, 2.0, 4.0]), kappa=1.0, p=0.5).tolist()
        [0.0, 1.0, 1.0, 1.0]
    """
    a = m.detach().abs()
    flat = a.reshape(-1)
    if flat.numel() == 0:
        return torch.ones_like(a)
    k = min(max(int(-(-p * flat.numel() // 1)), 1), flat.numel())
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    q = float(flat.kthvalue(k).values)
    if q <= 0.0:
        return (a > 0).to(a.dtype)
    return (a / (kappa * q)).clamp(0.0, 1.0)


def projected_merge(
    g: torch.Tensor, m: torch.Tensor, alpha: float = 0.25, tau: float = 1.0, w: Optional[torch.Tensor] = None
) -> torch.Tensor:
    r"""The additive projected merger (see the module docstring); ``w = None`` means ``w ≡ 1``.

    Example:
        >>> g, m = torch.tensor([2.0, 2.0]), torch.tensor([1.0, -3.0])
        >>> torch.equal(projected_merge(g, m, 0.25, 1.0, torch.ones(2)), signed_ema(g, m, 0.25))
        True
        >>> projected_merge(g, m, 0.25, 0.0).tolist()        # no trust: the fast gradient
        [2.0, 2.0]
    """
    alpha_eff = alpha + (1.0 - alpha) * (1.0 - tau)
    signed = g.abs() * torch.sign(m)
    if w is not None:
        w = w.to(g.dtype)
        # Where w = 1 keep the exact signed_ema value (signed zeros included); blend elsewhere.
        signed = torch.where(w >= 1.0, signed, w * signed + (1.0 - w) * g)
    return _mix(g, signed, alpha_eff)


def ema_update(m: Optional[torch.Tensor], g_anchor: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    r"""``M ← β·M + (1−β)·G_anchor``; the first update sets ``M = G_anchor``.

    Example:
        >>> ema_update(torch.tensor([1.0]), torch.tensor([3.0]), 0.5).tolist()
        [2.0]
    """
    if m is None:
        return g_anchor.detach().clone()
    return beta * m + (1.0 - beta) * g_anchor.detach()
