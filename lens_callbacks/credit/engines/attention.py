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
(``enable_gqa``: the query heads of one KV head are read against it together, K and V never repeated) are
covered; a row with nothing to attend to gives zeros, as torch's math kernel does. Calls without tangents
go to torch unchanged. Attention dropout is refused by name
(:class:`~lens_callbacks.credit.engines.jvp.ForwardADUnsupportedError`): its mask cannot be replayed.

Cost per call: a block reads only the keys ``[lo, hi)`` some query of it attends to (under ``is_causal``
none after its last query, so about half the keys over the blocks; a boolean or ``-inf`` mask trims its
leading and trailing keys too). Over those keys, ``3·B·H·L·S'·E`` multiply-adds for the scores and their
tangent (``QKᵀ``, then ``Q̇Kᵀ + QK̇ᵀ`` accumulated into one buffer) and ``3·B·H·L·S'·Ev`` for the outputs
(``PV``, ``PV̇`` and ``(P ∘ Ṡ)V``, with ``ṖV = (P ∘ Ṡ)V − rowsum(P ∘ Ṡ) O``): 3 times the primal
attention's. Besides the products that write and read them, each block takes three passes over its
scores (torch's softmax in place, each row read and written once while in cache; ``P ∘ Ṡ``; its sum),
with the scale folded into the queries. The products take most of a call (84 % at ``S`` = 8192
on one CPU thread, where their blocks of queries are thinner than a fused kernel's tiles). A query the
mask leaves nothing to attend to is found from the mask, never from the scores, so a NaN from the inputs
stays NaN.

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
    if Hq != Hkv and (not enable_gqa or Hq % Hkv):
        raise ValueError(
            f"query heads ({Hq}) and key/value heads ({Hkv}) differ: pass enable_gqa=True with Hq a multiple of Hkv."
        )
    r = Hq // Hkv  # query heads per KV head, grouped onto it: K and V are never repeated
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    s = float(scale) if scale is not None else 1.0 / math.sqrt(E)
    lead = tuple(q.shape[:-3])
    n = math.prod(lead) * Hkv
    if chunk is None:
        chunk = max(1, min(L, block_elements // max(1, n * r * S)))
    if mask is not None and mask.dtype == torch.bool:
        dmask = None  # a boolean mask has no tangent

    def grouped(x: torch.Tensor, d: int) -> torch.Tensor:  # [..., Hq, l, d] -> [n, r, l, d]
        return x.reshape(n, r, x.shape[-2], d)

    def flat(x: Optional[torch.Tensor], d: int) -> Optional[torch.Tensor]:  # [..., Hkv, S, d] -> [n, S, d]
        return None if x is None else x.reshape(n, S, d)

    q3, dq3 = grouped(q, E), (grouped(dq, E) if dq is not None else None)
    k3, dk3, v3, dv3 = flat(k, E), flat(dk, E), flat(v, Ev), flat(dv, Ev)
    outs, tans = [], []
    for a in range(0, L, chunk):
        b = min(L, a + chunk)
        c = b - a
        m = None
        if mask is not None:
            m = mask.expand(*mask.shape[:-2], L, S)[..., a:b, :] if mask.shape[-2] == 1 else mask[..., a:b, :]
        # the keys some query of the block can attend to, [lo, hi): a causal block needs none after its last query
        lo, hi = 0, (min(S, b) if is_causal else S)
        live = None
        if m is not None and m.dtype == torch.bool:
            live = m[..., :hi].reshape(-1, hi).any(0)  # [hi]
        elif m is not None and dmask is None:
            live = (m[..., :hi] > float("-inf")).reshape(-1, hi).any(0)  # [hi]
        if live is not None:
            idx = live.nonzero()
            lo, hi = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
        if hi <= lo:  # no query of the block attends to anything: zeros, as torch's math kernel gives
            outs.append(q.new_zeros(*lead, Hq, c, Ev))
            tans.append(q.new_zeros(*lead, Hq, c, Ev))
            continue
        w = hi - lo
        view = (*lead, Hkv, r, c, w)  # the scores as [..., Hkv, r, c, S'], for masks that broadcast over heads
        qc = (q3[:, :, a:b] * s).reshape(n, r * c, E)  # [n, r·c, E], the scale folded in
        scores = torch.bmm(qc, k3[:, lo:hi].transpose(1, 2))  # [n, r·c, S']
        dscores = None  # s·(Q̇Kᵀ + QK̇ᵀ), accumulated in place
        if dq3 is not None:
            dscores = torch.bmm((dq3[:, :, a:b] * s).reshape(n, r * c, E), k3[:, lo:hi].transpose(1, 2))
        if dk3 is not None:
            dkT = dk3[:, lo:hi].transpose(1, 2)
            dscores = torch.bmm(qc, dkT) if dscores is None else dscores.baddbmm_(qc, dkT)
        if m is not None:
            mb = _grouped(m[..., lo:hi], Hkv, r)
            if mb.dtype == torch.bool:
                scores.view(view).masked_fill_(~mb, float("-inf"))
            else:
                scores.view(view).add_(mb)
                if dmask is not None:
                    dm = dmask.expand(*dmask.shape[:-2], L, S) if dmask.shape[-2] == 1 else dmask
                    dmb = _grouped(dm[..., a:b, lo:hi], Hkv, r)
                    if dscores is None:
                        dscores = dmb.expand(view).reshape(n, r * c, w).clone()
                    else:
                        dscores.view(view).add_(dmb)
        if is_causal and hi > a + 1:
            # only the block's own diagonal square holds keys after a query (key j > query i, i in [a, b))
            j0 = max(a + 1, lo)
            scores.view(n, r, c, w)[..., j0 - lo :].masked_fill_(_after(a, c, j0, hi - j0, q.device), float("-inf"))
        # P, normalised in place of the scores by torch's softmax (each row read and written once, in cache)
        e = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        if m is not None:  # a query with no key left to attend to: zeros, as torch's math kernel gives
            dead = _dead_rows(m[..., lo:hi], Hkv, r, a, lo, is_causal)
            if dead is not None:
                e.view(view)[dead.expand(view[:-1])] = 0
        out = torch.bmm(e, v3[:, lo:hi])  # P V  [n, r·c, Ev]
        tan = torch.bmm(e, dv3[:, lo:hi]) if dv3 is not None else None  # P V̇
        if dscores is not None:
            if dmask is not None:
                dscores = torch.where(e > 0, dscores, torch.zeros_like(dscores))  # masked entries: P = 0, Ṗ = 0
            pd = dscores.mul_(e)  # P ∘ Ṡ
            rr = pd.sum(dim=-1, keepdim=True)  # rowsum(P ∘ Ṡ)
            t = torch.bmm(pd, v3[:, lo:hi]).sub_(rr * out)  # Ṗ V = (P ∘ Ṡ) V − rowsum(P ∘ Ṡ) O
            tan = t if tan is None else tan.add_(t)
        outs.append(out.reshape(*lead, Hq, c, Ev))
        tans.append(tan.reshape(*lead, Hq, c, Ev) if tan is not None else torch.zeros_like(outs[-1]))
    return torch.cat(outs, dim=-2), torch.cat(tans, dim=-2)


def _after(a: int, c: int, lo: int, w: int, device: torch.device) -> torch.Tensor:
    """``[c, w]``: whether key ``lo + j`` comes after query ``a + i`` (what the causal mask leaves out)."""
    return torch.arange(lo, lo + w, device=device)[None, :] > torch.arange(a, a + c, device=device)[:, None]


def _dead_rows(m: torch.Tensor, n_kv: int, r: int, a: int, lo: int, is_causal: bool) -> Optional[torch.Tensor]:
    """The queries of a block ``[a, a + c)`` with no key of ``m`` (``[..., c, S']``, keys from ``lo``) left to
    attend to, as a boolean ``[..., Hkv or 1, r or 1, c]`` laid out as the grouped scores; None when there are none.

    Read off the mask itself (never the scores): a row of scores that is NaN for another reason stays NaN."""
    live = m if m.dtype == torch.bool else m > float("-inf")
    if is_causal:
        live = live & ~_after(a, m.shape[-2], lo, m.shape[-1], m.device)
    dead = ~live.any(-1)
    return _grouped(dead.unsqueeze(-1), n_kv, r).squeeze(-1) if bool(dead.any()) else None


def _grouped(m: torch.Tensor, n_kv: int, r: int) -> torch.Tensor:
    """A mask block ``[..., Hq or 1, c, S]`` laid out as the grouped scores ``[..., Hkv, r, c, S]`` (broadcasting)."""
    if m.dim() >= 3 and m.shape[-3] != 1:
        return m.unflatten(-3, (n_kv, r))
    return m.unsqueeze(-3)


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
