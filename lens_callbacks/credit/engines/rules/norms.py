r"""``nn.LayerNorm`` and RMSNorm variants: ``g_k(w) = Σ_t B_kt ∘ x̂_kt``, bias ``Σ_t B_kt``.

``x̂`` is the layer's own normalised input, recomputed from the captured input by the layer's own
arithmetic with the weight set to one (or kept from the forward under autocast, whose dtype rules the
recomputation would not see). The pieces are ``d``-sized per row: formed directly.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from . import Rows, Rule, Use, forward_is, take


class _NormRule(Rule):
    def on_forward(self, use: Use, mod: nn.Module, x: torch.Tensor, capture: Any) -> None:
        use.capture = capture  # x̂ is recomputed from the input when the weight is read
        if torch.is_autocast_enabled(x.device.type):
            # x̂ under the forward's autocast (its dtype rules): taken now, not recomputed outside it
            use.xhat = capture.quiet(self.normalised, mod, x)

    def normalised(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pieces(self, use: Use, param: torch.Tensor, rows: Rows) -> torch.Tensor:
        B = rows.rp.shape[0]
        sel, dst, c = rows.sel, rows.dst, rows.c
        g = use.b
        if sel.numel() == 0:
            return torch.zeros((c,) + tuple(param.shape), dtype=g.dtype, device=g.device)
        G = take(g, sel, B)  # [r, n, d]
        if param is use.weight:
            per_row = (G * take(use.normalised(), sel, B).to(g.dtype)).sum(1)  # [r, d]
        else:
            per_row = G.sum(1)  # [r, d]
        if rows.in_order:  # one row per part, in order: a row's piece is its part's
            return per_row
        return torch.zeros((c,) + tuple(param.shape), dtype=g.dtype, device=g.device).index_add_(0, dst, per_row)


class LayerNormRule(_NormRule):
    name = "layernorm"

    def matches(self, mod: nn.Module) -> bool:
        return forward_is(mod, nn.LayerNorm) and mod.elementwise_affine and len(mod.normalized_shape) == 1

    def normalised(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.layer_norm(x.detach(), mod.normalized_shape, None, None, mod.eps)


#: transformers' RMSNorm classes known to compute ``weight * x / rms(x)``, by (module, class name): matched by
#: type when that module is loaded (the class's own module always is, once such a layer exists).
KNOWN_RMSNORMS = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
)


def _known_rmsnorm(mod: nn.Module) -> bool:
    for module_name, cls_name in KNOWN_RMSNORMS:
        cls = getattr(sys.modules.get(module_name), cls_name, None)
        if isinstance(cls, type) and forward_is(mod, cls):
            return True
    return False


class RMSNormRule(_NormRule):
    """torch's ``nn.RMSNorm`` and the transformers classes in :data:`KNOWN_RMSNORMS`, matched by type.

    Fallback heuristic for other libraries' layers: a class whose name ends in ``RMSNorm`` (not Gemma's,
    whose ``(1 + weight) * …`` is not this), with a 1-d ``weight`` and no ``bias``. A layer that matches
    neither is read by the engine's exact fallback.
    """

    name = "rmsnorm"

    def matches(self, mod: nn.Module) -> bool:
        rms = getattr(nn, "RMSNorm", None)
        if rms is not None and forward_is(mod, rms):
            return mod.weight is not None and len(mod.normalized_shape) == 1
        w = getattr(mod, "weight", None)
        shaped = isinstance(w, torch.Tensor) and w.dim() == 1 and getattr(mod, "bias", None) is None
        if _known_rmsnorm(mod):
            return shaped
        name = type(mod).__name__
        return shaped and name.endswith("RMSNorm") and "Gemma" not in name

    def normalised(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(mod) is getattr(nn, "RMSNorm", None):
            with torch.no_grad():
                return torch.nn.functional.rms_norm(x.detach(), mod.normalized_shape, None, mod.eps)
        # the layer's own forward with weight one: the same arithmetic as training (its hooks stay quiet)
        with torch.no_grad():
            return torch.func.functional_call(mod, {"weight": torch.ones_like(mod.weight)}, (x.detach(),)).detach()
