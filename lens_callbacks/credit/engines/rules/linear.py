r"""``nn.Linear`` and transformers' ``Conv1D``: a weight's per-row piece is ``Lᵀ R``.

``Linear`` (weight ``[out, in]``): ``g_k(W) = B_kᵀ A_k``, bias ``Σ_t B_kt``. ``Conv1D`` (weight
``[in, out]``): ``g_k(W) = A_kᵀ B_k``. The ghost route reads the weight from the factors without any
per-row piece; the direct route forms ``[c, d_L, d_R]`` pieces by one batched product.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from . import Factors, Rows, Rule, Use, forward_is, take


class LinearRule(Rule):
    name = "linear"
    #: the weight is ``Lᵀ R`` with ``L`` the output gradient (``Linear``) or the input (``Conv1D``)
    out_left = True

    def matches(self, mod: nn.Module) -> bool:
        return forward_is(mod, nn.Linear)

    def has_factors(self, use: Use, param: torch.Tensor) -> bool:
        return param is use.weight and param.dim() == 2

    def _lr(self, use: Use, sel: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = take(use.b, sel, B)  # [r, n, out]
        a = take(use.a, sel, B).to(g.dtype)  # [r, n, in]
        return (g, a) if self.out_left else (a, g)

    def factors(self, use: Use, param: torch.Tensor, sel: torch.Tensor, B: int) -> Optional[Factors]:
        if use.b is None or not self.has_factors(use, param):
            return None
        L, R = self._lr(use, sel, B)
        return Factors(L, R, False)

    def pieces(self, use: Use, param: torch.Tensor, rows: Rows) -> torch.Tensor:
        B = rows.rp.shape[0]
        sel, dst, c = rows.sel, rows.dst, rows.c
        g = use.b
        if param is use.weight:
            L, R = self._lr(use, sel, B)  # [r, n, d_L], [r, n, d_R]
            prod = torch.bmm(L.transpose(1, 2), R)  # [r, d_L, d_R]
            if rows.in_order:  # one row per part, in order (by_rollout): the per-row product is the piece
                return prod
            return torch.zeros((c,) + tuple(param.shape), dtype=g.dtype, device=g.device).index_add_(0, dst, prod)
        if sel.numel() and rows.in_order:
            return take(g, sel, B).sum(1)  # [r, out]: one row per part, in order
        out = torch.zeros((c,) + tuple(param.shape), dtype=g.dtype, device=g.device)
        if sel.numel():
            out.index_add_(0, dst, take(g, sel, B).sum(1))  # [r, out]
        return out


class Conv1DRule(LinearRule):
    """transformers' ``Conv1D`` (GPT-2): ``y = x W + b`` with ``W`` ``[in, out]``.

    Matched by type (``transformers.pytorch_utils.Conv1D``, looked up among the loaded modules, never
    imported). Fallback heuristic for a copy of the class elsewhere: named ``Conv1D``, with ``nf`` and a
    ``weight``.
    """

    name = "conv1d"
    out_left = False

    def matches(self, mod: nn.Module) -> bool:
        cls = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
        if isinstance(cls, type) and isinstance(mod, cls):
            return forward_is(mod, cls)
        return (
            type(mod).__name__ == "Conv1D"
            and hasattr(mod, "nf")
            and isinstance(getattr(mod, "weight", None), torch.Tensor)
        )
