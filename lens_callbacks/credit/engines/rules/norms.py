r"""``nn.LayerNorm`` and RMSNorm variants: ``g_k(w) = Σ_t B_kt ∘ x̂_kt``, bias ``Σ_t B_kt``.

``x̂`` is the layer's own normalised input, recomputed from the captured input by the layer's own
arithmetic with the weight set to one (or kept from the forward under autocast, whose dtype rules the
recomputation would not see). The pieces are ``d``-sized per row: formed directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import Rule, forward_is, rows_of


class _NormRule(Rule):
    def on_forward(self, use: Any, mod: nn.Module, x: torch.Tensor, capture: Any) -> None:
        use.capture = capture  # x̂ is recomputed from the input when the weight is read
        if torch.is_autocast_enabled(x.device.type):
            # x̂ under the forward's autocast (its dtype rules): taken now, not recomputed outside it
            use.xhat = capture.quiet(self.normalised, mod, x)

    def normalised(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pieces(self, use: Any, param: torch.Tensor, rows: Any) -> torch.Tensor:
        B = rows.rp.shape[0]
        sel, dst, c = rows.sel, rows.dst, rows.c
        g = use.b
        out = torch.zeros((c,) + tuple(param.shape), dtype=g.dtype, device=g.device)
        if sel.numel() == 0:
            return out
        G = rows_of(g, B)[sel]  # [r, n, d]
        if param is use.weight:
            X = rows_of(use.normalised(), B)[sel].to(g.dtype)  # [r, n, d]
            return out.index_add_(0, dst, (G * X).sum(1))  # [r, d]
        return out.index_add_(0, dst, G.sum(1))  # [r, d]


class LayerNormRule(_NormRule):
    name = "layernorm"

    def matches(self, mod: nn.Module) -> bool:
        return forward_is(mod, nn.LayerNorm) and mod.elementwise_affine and len(mod.normalized_shape) == 1

    def normalised(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.layer_norm(x.detach(), mod.normalized_shape, None, None, mod.eps)


class RMSNormRule(_NormRule):
    """torch's ``nn.RMSNorm``, and transformers' Llama/Qwen2/Mistral/T5 RMSNorm (``weight * normed(x)``;
    Gemma's ``(1 + weight) * …`` is not this and is left to the fallback)."""

    name = "rmsnorm"

    def matches(self, mod: nn.Module) -> bool:
        rms = getattr(nn, "RMSNorm", None)
        if rms is not None and forward_is(mod, rms):
            return mod.weight is not None and len(mod.normalized_shape) == 1
        name = type(mod).__name__
        w = getattr(mod, "weight", None)
        return (
            name.endswith("RMSNorm")
            and "Gemma" not in name
            and isinstance(w, torch.Tensor)
            and w.dim() == 1
            and getattr(mod, "bias", None) is None
        )

    def normalised(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(mod) is getattr(nn, "RMSNorm", None):
            with torch.no_grad():
                return torch.nn.functional.rms_norm(x.detach(), mod.normalized_shape, None, mod.eps)
        # the layer's own forward with weight one: the same arithmetic as training (its hooks stay quiet)
        with torch.no_grad():
            return torch.func.functional_call(mod, {"weight": torch.ones_like(mod.weight)}, (x.detach(),)).detach()
