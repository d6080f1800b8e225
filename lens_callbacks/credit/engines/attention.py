r"""A forward-mode rule for ``scaled_dot_product_attention``, memory-bounded, for the tangent pass.

torch's fused attention kernels have no forward-mode derivative (torch 2.13's CPU flash kernel
``_scaled_dot_product_flash_attention_for_cpu`` among them), so a stock transformers model (``sdpa``, its
default) or ``nn.MultiheadAttention`` cannot carry a tangent through attention. While
:class:`ForwardAttention` is entered, every call of ``torch.nn.functional.scaled_dot_product_attention``
whose inputs carry a forward-mode tangent is computed here instead, by math attention one block of
queries at a time:

    S = s·QKᵀ + M,  P = softmax(S),  O = P V
    Ṡ = s·(Q̇Kᵀ + QK̇ᵀ) (+ Ṁ),  Ṗ = P ∘ (Ṡ − rowsum(P ∘ Ṡ)),  Ȯ = Ṗ V + P V̇

Every line is row-wise in the queries, so a block of ``chunk`` queries needs only its own ``[chunk, S]``
slice of the scores: the peak is ``O(B·H·chunk·S)``, never ``[B, H, L, S]``. ``is_causal`` (top-left
aligned, as torch's), boolean masks (True = attend), additive float masks, ``scale`` and grouped KV heads
(``enable_gqa``) are covered; a row with nothing to attend to gives zeros, as torch's math kernel does.
Calls without tangents go to torch unchanged. Attention dropout is refused by name
(:class:`~lens_callbacks.credit.engines.jvp.ForwardADUnsupportedError`): its mask cannot be replayed.

Cost per call: ``3·B·H·L·S·E`` multiply-adds for the scores and their tangent (``QKᵀ``, ``Q̇Kᵀ``, ``QK̇ᵀ``),
``3·B·H·L·S·Ev`` for the outputs (``PV``, ``ṖV``, ``PV̇``) — 3 times the primal attention's ``2·B·H·L·S·E``
(a causal mask is applied, not skipped) — in ``⌈L/chunk⌉`` blocks. Each block also takes about 16
elementwise ops over its ``[chunk, S]`` scores (scaling, masking, the softmax and its tangent), so at long
``S`` the rule is bound by memory traffic.

Pure torch; never imports lightning.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["ForwardAttention", "attention_jvp", "DEFAULT_BLOCK_ELEMENTS", "AttentionDropoutError"]

#: Elements of one block of scores (``B·H·chunk·S``) the rule may hold: 4 Mi (16 MiB in float32).
DEFAULT_BLOCK_ELEMENTS = 1 << 22


class AttentionDropoutError(RuntimeError):
    """Attention dropout inside a forward-mode pass: its random mask cannot be replayed by the rule."""


def _split(x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    primal, tangent = fwAD.unpack_dual(x)
    return primal, tangent


def _repeat_heads(x: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    if x is None or n == 1:
        return x
    return x.repeat_interleave(n, dim=-3)


def attention_jvp(
    q: torch.Tensor,
    dq: Optional[torch.Tensor],
    k: torch.Tensor,
    dk: Optional[torch.Tensor],
    v: torch.Tensor,
    dv: Optional[torch.Tensor],
    mask: Optional[torch.Tensor] = None,
    dmask: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    chunk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, Ȯ)`` of ``scaled_dot_product_attention`` at ``(q, k, v)`` along ``(dq, dk, dv)`` (None: zero).

    Shapes as torch's: ``q [..., Hq, L, E]``, ``k [..., Hkv, S, E]``, ``v [..., Hkv, S, Ev]``; ``mask`` broadcast to
    ``[..., Hq, L, S]``. ``chunk`` (queries per block) defaults to what ``block_elements`` allows.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v, dq = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(4))
        >>> out, tan = attention_jvp(q, dq, k, None, v, None, is_causal=True, chunk=2)
        >>> ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> bool(torch.allclose(out, ref, atol=1e-12))
        True
    """
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if Hq != Hkv:
        if not enable_gqa or Hq % Hkv:
            raise ValueError(
                f"query heads ({Hq}) and key/value heads ({Hkv}) differ: pass enable_gqa=True with Hq a multiple of Hkv."
            )
        r = Hq // Hkv
        k, dk, v, dv = _repeat_heads(k, r), _repeat_heads(dk, r), _repeat_heads(v, r), _repeat_heads(dv, r)
    L, S = q.shape[-2], k.shape[-2]
    s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    lead = q.shape[:-2]  # [..., H]
    if chunk is None:
        per_query = max(1, math.prod(lead) * S)
        chunk = max(1, min(L, block_elements // per_query))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        dmask = None
    kT = k.transpose(-2, -1)  # [..., E, S]
    dkT = dk.transpose(-2, -1) if dk is not None else None
    outs, tans = [], []
    cols = torch.arange(S, device=q.device)
    for a in range(0, L, chunk):
        b = min(L, a + chunk)
        qc = q[..., a:b, :]  # [..., c, E]
        scores = torch.matmul(qc, kT) * s  # [..., c, S]
        dscores = None
        if dq is not None:
            dscores = torch.matmul(dq[..., a:b, :], kT) * s
        if dkT is not None:
            t = torch.matmul(qc, dkT) * s
            dscores = t if dscores is None else dscores + t
        if mask is not None:
            m = mask.expand(*mask.shape[:-2], L, S)[..., a:b, :] if mask.shape[-2] == 1 else mask[..., a:b, :]
            scores = scores + m
            if dmask is not None:
                dm = dmask.expand(*dmask.shape[:-2], L, S)[..., a:b, :] if dmask.shape[-2] == 1 else dmask[..., a:b, :]
                dscores = dm if dscores is None else dscores + dm
        if is_causal:
            keep = cols[None, :] <= torch.arange(a, b, device=q.device)[:, None]  # [c, S], top-left aligned
            scores = scores.masked_fill(~keep, float("-inf"))
        # a row with nothing to attend to reads zeros (torch's math kernel does the same)
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        e = torch.exp(scores - top)
        z = e.sum(dim=-1, keepdim=True)
        p = torch.where(z > 0, e / torch.where(z > 0, z, torch.ones_like(z)), torch.zeros_like(e))  # [..., c, S]
        outs.append(torch.matmul(p, v))
        tan = None
        if dscores is not None:
            dscores = torch.where(p > 0, dscores, torch.zeros_like(dscores))  # masked entries: P = 0, Ṗ = 0
            dp = p * (dscores - (p * dscores).sum(dim=-1, keepdim=True))
            tan = torch.matmul(dp, v)
        if dv is not None:
            t = torch.matmul(p, dv)
            tan = t if tan is None else tan + t
        tans.append(tan if tan is not None else torch.zeros_like(outs[-1]))
    return torch.cat(outs, dim=-2), torch.cat(tans, dim=-2)


_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's own, whatever F's attribute points at


class ForwardAttention(TorchFunctionMode):
    """While entered, ``scaled_dot_product_attention`` with forward-mode tangents is computed by :func:`attention_jvp`.

    Two doors, one rule: the mode sees direct calls of torch's function, and ``F.scaled_dot_product_attention``
    points at the rule while the mode is entered, so that calls from inside composite functions (whose
    inner calls a mode does not see, e.g. ``F.multi_head_attention_forward`` under ``nn.MultiheadAttention``)
    take it too. ``chunk`` fixes the queries per block (default: as many as ``block_elements`` allows).
    ``calls`` counts the calls the rule computed.
    """

    def __init__(self, block_elements: int = DEFAULT_BLOCK_ELEMENTS, chunk: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(block_elements, int) or block_elements < 1:
            raise ValueError(f"`block_elements` must be a positive int, got {block_elements!r}.")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"`chunk` must be a positive int or None, got {chunk!r}.")
        self.block_elements, self.chunk, self.calls = block_elements, chunk, 0
        self._before: Any = None

    def __enter__(self) -> "ForwardAttention":
        self._before = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            F.scaled_dot_product_attention = self._before  # type: ignore[assignment]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not _SDPA:
            return func(*args, **(kwargs or {}))
        return self._sdpa(*args, **(kwargs or {}))

    def _sdpa(self, *args: Any, **kwargs: Any) -> Any:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        call = dict(zip(names, args))
        call.update(kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        mask = call.get("attn_mask")
        (qp, dq), (kp, dk), (vp, dv) = _split(q), _split(k), _split(v)
        mp, dm = _split(mask) if isinstance(mask, torch.Tensor) else (mask, None)
        if dq is None and dk is None and dv is None and dm is None:
            return _SDPA(*args, **kwargs)
        if float(call.get("dropout_p", 0.0) or 0.0) > 0.0:
            raise AttentionDropoutError(
                f"scaled_dot_product_attention with dropout_p={call['dropout_p']!r} inside a forward-mode pass: the "
                "dropout mask cannot be replayed. Put the attention in eval mode for the audit (attention_dropout=0), "
                "or audit with the reference engine."
            )
        self.calls += 1
        out, tan = attention_jvp(
            qp,
            dq,
            kp,
            dk,
            vp,
            dv,
            mp,
            dm,
            is_causal=bool(call.get("is_causal", False)),
            scale=call.get("scale"),
            enable_gqa=bool(call.get("enable_gqa", False)),
            block_elements=self.block_elements,
            chunk=self.chunk,
        )
        return fwAD.make_dual(out, tan)
