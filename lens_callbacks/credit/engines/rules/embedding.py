r"""``nn.Embedding``: a row's gradient lives on its own token ids.

``g_k(E) = Σ_t e_{id_kt} ⊗ B_kt`` (``padding_idx`` positions add nothing, as in ``F.embedding``'s
backward): factors with the token ids as the one-hot left factor. Its readings never form a ``[V, d]``
piece per row: dots are gathers ``Σ_t B_kt · W[id_kt]``, norms the token-equality Gram
``Σ_{t,s: id_t = id_s} B_t · B_s``, the parts' sum one ``index_add`` (see :mod:`..ghost_routes`), hence
``factors_only``. ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` embeddings are not covered (the
fallback reads them).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import Factors, Rule, Use, forward_is, take


class EmbeddingRule(Rule):
    name = "embedding"
    factors_only = True
    expands_broadcast = True

    def matches(self, mod: nn.Module) -> bool:
        return forward_is(mod, nn.Embedding) and mod.max_norm is None and not mod.scale_grad_by_freq and not mod.sparse

    def has_factors(self, use: Use, param: torch.Tensor) -> bool:
        return param is use.weight

    def factors(self, use: Use, param: torch.Tensor, sel: torch.Tensor, B: int) -> Optional[Factors]:
        if use.b is None or param is not use.weight:
            return None
        g = take(use.b, sel, B)  # [r, n, d]
        ids = use.a.reshape(B, -1)  # [B, n]
        ids = ids if sel.numel() == B else ids[sel]  # [r, n]
        pad = use.module.padding_idx
        if pad is not None:  # the padding row gets no gradient, as in F.embedding's backward
            g = g.masked_fill((ids == pad)[..., None], 0)
        return Factors(ids, g, True)
