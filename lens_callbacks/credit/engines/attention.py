r"""A forward-mode rule for ``scaled_dot_product_attention``, memory-bounded, for the tangent pass.

torch's fused attention kernels have no forward-mode derivative (torch 2.13's CPU flash kernel
``_scaled_dot_product_flash_attention_for_cpu`` among them), so a stock transformers model (``sdpa``, its
default) or ``nn.MultiheadAttention`` cannot carry a tangent through attention. While
:class:`ForwardAttention` is entered, every call of ``torch.nn.functional.scaled_dot_product_attention``
whose inputs carry a forward-mode tangent is computed here instead, by math attention one block of
queries at a time:

    S = s·QKᵀ + M,  P = softmax(S),  O = P V
    Ṡ = s·(Q̇Kᵀ + QK̇ᵀ) (+ Ṁ),  Ṗ = P ∘ (Ṡ − rowsum(P ∘ Ṡ)),  Ȯ = Ṗ V + P V̇

Every line is row-wise in the queries, and over the keys it is sums, so the rule reads a block of
``chunk`` queries against one tile of ``key_chunk`` keys at a time, with flash attention's online softmax
(the running row maximum rescales what the earlier tiles summed; see :class:`_Online`): the peak is one
tile, ``O(B·H·chunk·key_chunk)`` (at most 16 MiB by default), never ``[B, H, L, S]`` and not even a block's
``[chunk, S]`` row of scores, and each tile is read and written while it is in cache. ``is_causal``
(top-left aligned, as torch's), boolean masks (True = attend), additive float masks with or without their
own tangent, ``scale`` and grouped KV heads (``enable_gqa``: the query heads of one KV head are read against
it together, K and V never repeated) are covered; a row with nothing to attend to gives zeros, as torch's
math kernel does, while a NaN from the inputs stays NaN. Half-precision inputs are summed in float32 and
the outputs given in their dtype; under autocast the inputs are first cast to autocast's dtype, as torch's
attention is. Calls without tangents go to torch unchanged.
Attention dropout is refused by name
(:class:`~lens_callbacks.credit.engines.jvp.ForwardADUnsupportedError`): its mask cannot be replayed.

Cost per call: a block reads only the keys ``[lo, hi)`` some query of it attends to (under ``is_causal``
none after its last query, so about half the keys over the blocks; a boolean or ``-inf`` mask trims its
leading and trailing keys too). Over those keys, ``3·B·H·L·S'·E`` multiply-adds for the scores and their
tangent (``QKᵀ``, then ``Q̇Kᵀ + QK̇ᵀ`` accumulated into one buffer) and ``3·B·H·L·S'·Ev`` for the outputs
(``PV``, ``PV̇`` and ``(P ∘ Ṡ)V``, with ``ṖV = (P ∘ Ṡ)V − rowsum(P ∘ Ṡ) O``): 3 times the primal
attention's, about what a fused forward and backward take (7 products, the scores recomputed). Besides the
products, each tile takes a few passes in cache (its maximum, ``exp``, ``P ∘ Ṡ`` and two row sums), with
the scale folded into the queries; ``benchmarks/attention_rule_cost.py`` clocks a call against torch's
fused kernel.

Pure torch; never imports lightning.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "ForwardAttention",
    "attention_jvp",
    "DEFAULT_BLOCK_ELEMENTS",
    "DEFAULT_CHUNK",
    "DEFAULT_KEY_CHUNK",
    "DEFAULT_ROWS",
    "AttentionDropoutError",
]

#: Elements of one tile of scores (``B·H·chunk·key_chunk``) the rule may hold: 4 Mi (16 MiB in float32).
DEFAULT_BLOCK_ELEMENTS = 1 << 22
#: Keys per tile, and queries per block at most: one head's tile of 128 × 512 float32 scores (256 KiB) stays
#: in a core's cache while its products and passes read and write it.
DEFAULT_KEY_CHUNK, DEFAULT_CHUNK = 512, 128
#: Query rows of one grouped product at most (``chunk`` × the query heads of one KV head): with grouped heads
#: the default block is ``DEFAULT_ROWS // r`` queries (Qwen2's 7 heads a KV head: 27), so that a tile and its
#: tangent stay in cache and the diagonal block under a causal mask wastes fewer products. One thread, causal,
#: Qwen2's 14 heads on 2: 0.84–0.88 → 0.71–0.74 of torch's fused forward and backward at 2 × 1024, 1.00 → 0.88 at
#: 1 × 4096 (``benchmarks/attention_rule_cost.py --kv-heads 2 --compare-chunk 128``); one head a KV head: as before.
DEFAULT_ROWS = 192


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
    key_chunk: int = DEFAULT_KEY_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, Ȯ)`` of ``scaled_dot_product_attention`` at ``(q, k, v)`` along ``(dq, dk, dv)`` (None: zero).

    Shapes as torch's: ``q [..., Hq, L, E]``, ``k [..., Hkv, S, E]``, ``v [..., Hkv, S, Ev]``; ``mask`` broadcast to
    ``[..., Hq, L, S]``. Keys are read ``key_chunk`` at a time; ``chunk`` (queries per block) defaults to
    ``DEFAULT_CHUNK``, ``DEFAULT_ROWS // r`` with ``r`` query heads a KV head where that is fewer, or fewer
    still where ``block_elements`` allows less for a tile of ``[B·H, chunk, key_chunk]`` scores.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v, dq = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(4))
        >>> out, tan = attention_jvp(q, dq, k, None, v, None, is_causal=True, chunk=2)
        >>> ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> bool(torch.allclose(out, ref, atol=1e-12))
        True
    """
    work = torch.promote_types(q.dtype, torch.float32)  # half precision: float32 sums, as the fused kernels keep
    given = (q, dq, k, dk, v, dv, mask, dmask)
    if any(x is not None and x.is_floating_point() and x.dtype != work for x in given):
        up = [x.to(work) if x is not None and x.is_floating_point() else x for x in given]
        out, tan = attention_jvp(
            *up,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            block_elements=block_elements,
            chunk=chunk,
            key_chunk=key_chunk,
        )
        return out.to(q.dtype), tan.to(q.dtype)
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
    kc = max(1, min(S, key_chunk))
    if chunk is None:
        chunk = max(1, min(L, DEFAULT_CHUNK, DEFAULT_ROWS // r, block_elements // max(1, n * r * kc)))
    if mask is not None and mask.dtype == torch.bool:
        dmask = None  # a boolean mask has no tangent

    def grouped(x: torch.Tensor, d: int) -> torch.Tensor:  # [..., Hq, l, d] -> [n, r, l, d]
        return x.reshape(n, r, x.shape[-2], d)

    def flat(x: Optional[torch.Tensor], d: int) -> Optional[torch.Tensor]:  # [..., Hkv, S, d] -> [n, S, d]
        return None if x is None else x.reshape(n, S, d)

    q3, dq3 = grouped(q, E), (grouped(dq, E) if dq is not None else None)
    k3, dk3, v3, dv3 = flat(k, E), flat(dk, E), flat(v, Ev), flat(dv, Ev)
    mask_tangent = dmask is not None
    if mask_tangent and dmask.shape[-2] == 1:
        dmask = dmask.expand(*dmask.shape[:-2], L, S)
    out, tan = q.new_empty(n, r, L, Ev), q.new_empty(n, r, L, Ev)  # written a block at a time
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
        elif m is not None and not mask_tangent:
            live = (m[..., :hi] > float("-inf")).reshape(-1, hi).any(0)  # [hi]
        if live is not None:
            idx = live.nonzero()
            lo, hi = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
        if hi <= lo:  # no query of the block attends to anything: zeros, as torch's math kernel gives
            out[:, :, a:b] = 0
            tan[:, :, a:b] = 0
            continue
        qc = (q3[:, :, a:b] * s).reshape(n, r * c, E)  # [n, r·c, E], the scale folded in
        dqc = (dq3[:, :, a:b] * s).reshape(n, r * c, E) if dq3 is not None else None
        acc = _Online(n, r * c, Ev, q)
        for j0 in range(lo, hi, kc):
            j1 = min(hi, j0 + kc)
            w = j1 - j0
            view = (*lead, Hkv, r, c, w)  # the scores as [..., Hkv, r, c, w], for masks that broadcast over heads
            kT = k3[:, j0:j1].transpose(1, 2)
            scores = torch.bmm(qc, kT)  # [n, r·c, w]
            dscores = None  # s·(Q̇Kᵀ + QK̇ᵀ) (+ Ṁ), accumulated in place
            if dqc is not None:
                dscores = torch.bmm(dqc, kT)
            if dk3 is not None:
                dkT = dk3[:, j0:j1].transpose(1, 2)
                dscores = torch.bmm(qc, dkT) if dscores is None else dscores.baddbmm_(qc, dkT)
            if m is not None:
                mb = _grouped(m[..., j0:j1], Hkv, r)
                if mb.dtype == torch.bool:
                    scores.view(view).masked_fill_(~mb, float("-inf"))
                else:
                    scores.view(view).add_(mb)
                    if mask_tangent:
                        dmb = _grouped(dmask[..., a:b, j0:j1], Hkv, r)
                        if dscores is None:
                            dscores = dmb.expand(view).reshape(n, r * c, w).clone()
                        else:
                            dscores.view(view).add_(dmb)
            if is_causal and j1 > a + 1:
                # only the block's own diagonal holds keys after a query (key j > query i, i in [a, b))
                jj = max(a + 1, j0)
                if jj < j1:
                    scores.view(n, r, c, w)[..., jj - j0 :].masked_fill_(
                        _after(a, c, jj, j1 - jj, q.device), float("-inf")
                    )
            acc.add(scores, dscores, v3[:, j0:j1], dv3[:, j0:j1] if dv3 is not None else None, mask_tangent)
        o, t = acc.result()
        out[:, :, a:b] = o.view(n, r, c, Ev)
        tan[:, :, a:b] = t.view(n, r, c, Ev)
    return out.reshape(*lead, Hq, L, Ev), tan.reshape(*lead, Hq, L, Ev)


class _Online:
    """One block of queries' value and tangent, accumulated over tiles of keys (flash attention's online softmax).

    With the running row maximum ``μ``, over the tiles so far: ``ℓ = Σ eˢ⁻ᵘ``, ``o = Σ eˢ⁻ᵘ V``,
    ``t = Σ eˢ⁻ᵘ (V̇ + Ṡ V)`` and ``ρ = Σ eˢ⁻ᵘ Ṡ``, each rescaled by ``e^(μ_old − μ_new)`` when the maximum
    grows; then ``O = o / ℓ`` and ``Ȯ = t / ℓ − (ρ / ℓ) O``. A row with no key to attend to has ``ℓ = 0``
    exactly and reads zeros, as torch's math kernel gives; a NaN from the inputs makes ``ℓ`` NaN and stays NaN.
    """

    def __init__(self, n: int, rows: int, ev: int, like: torch.Tensor) -> None:
        self.m = like.new_full((n, rows, 1), float("-inf"))
        self.l, self.rho = like.new_zeros(n, rows, 1), like.new_zeros(n, rows, 1)
        self.o, self.t = like.new_zeros(n, rows, ev), like.new_zeros(n, rows, ev)

    def add(
        self,
        scores: torch.Tensor,
        dscores: Optional[torch.Tensor],
        v: torch.Tensor,
        dv: Optional[torch.Tensor],
        guard: bool,
    ) -> None:
        """Take one tile ``[n, rows, w]`` of masked scores (overwritten) and their tangent, with its keys' ``v``, ``dv``."""
        top = torch.maximum(self.m, scores.amax(-1, keepdim=True))
        shift = top.masked_fill(top == float("-inf"), 0.0)  # a row with nothing yet: exp(-inf) = 0, never NaN
        alpha = (self.m - shift).exp_()
        self.m = top
        e = scores.sub_(shift).exp_()  # the tile's unnormalised P, in place of its scores
        self.l.mul_(alpha).add_(e.sum(-1, keepdim=True))
        self.o.mul_(alpha).baddbmm_(e, v)  # Σ P V
        self.t.mul_(alpha)
        if dv is not None:
            self.t.baddbmm_(e, dv)  # Σ P V̇
        if dscores is not None:
            if guard:  # a tangent on a masked entry (P = 0) moves nothing, even when it is not finite
                dscores = torch.where(e > 0, dscores, torch.zeros_like(dscores))
            pd = dscores.mul_(e)  # P ∘ Ṡ
            self.rho.mul_(alpha).add_(pd.sum(-1, keepdim=True))
            self.t.baddbmm_(pd, v)  # Σ (P ∘ Ṡ) V

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.l.reciprocal().masked_fill_(self.l == 0, 0.0)
        out = self.o.mul_(inv)
        return out, self.t.mul_(inv).sub_(self.rho.mul_(inv) * out)


def _after(a: int, c: int, lo: int, w: int, device: torch.device) -> torch.Tensor:
    """``[c, w]``: whether key ``lo + j`` comes after query ``a + i`` (what the causal mask leaves out)."""
    return torch.arange(lo, lo + w, device=device)[None, :] > torch.arange(a, a + c, device=device)[:, None]


def _grouped(m: torch.Tensor, n_kv: int, r: int) -> torch.Tensor:
    """A mask block ``[..., Hq or 1, c, S]`` laid out as the grouped scores ``[..., Hkv, r, c, S]`` (broadcasting)."""
    if m.dim() >= 3 and m.shape[-3] != 1:
        return m.unflatten(-3, (n_kv, r))
    return m.unsqueeze(-3)


def _cast_by_autocast(x: torch.Tensor) -> bool:
    """Whether autocast casts ``x`` for an op of its lower-precision list: floating point, float64 excepted."""
    return x.is_floating_point() and x.dtype != torch.float64


_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's own, whatever F's attribute points at


class ForwardAttention(TorchFunctionMode):
    """While entered, ``scaled_dot_product_attention`` with forward-mode tangents is computed by :func:`attention_jvp`.

    Two doors, one rule: the mode sees direct calls of torch's function, and ``F.scaled_dot_product_attention``
    points at the rule while the mode is entered, so that calls from inside composite functions (whose
    inner calls a mode does not see, e.g. ``F.multi_head_attention_forward`` under ``nn.MultiheadAttention``)
    take it too. ``chunk`` fixes the queries per block (default: as :func:`attention_jvp` picks it),
    ``key_chunk`` the keys per tile.
    ``calls`` counts the calls the rule computed.
    """

    def __init__(
        self,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        chunk: Optional[int] = None,
        key_chunk: int = DEFAULT_KEY_CHUNK,
    ) -> None:
        super().__init__()
        if not isinstance(block_elements, int) or block_elements < 1:
            raise ValueError(f"`block_elements` must be a positive int, got {block_elements!r}.")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"`chunk` must be a positive int or None, got {chunk!r}.")
        if not isinstance(key_chunk, int) or key_chunk < 1:
            raise ValueError(f"`key_chunk` must be a positive int, got {key_chunk!r}.")
        self.block_elements, self.chunk, self.key_chunk, self.calls = block_elements, chunk, key_chunk, 0
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
        given = (qp, dq, kp, dk, vp, dv, mp, dm)
        device = qp.device.type
        autocast = torch.is_autocast_enabled(device)
        if autocast:  # as autocast casts torch's attention: floating inputs but float64 to autocast's dtype
            low = torch.get_autocast_dtype(device)
            given = tuple(x.to(low) if isinstance(x, torch.Tensor) and _cast_by_autocast(x) else x for x in given)
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            out, tan = attention_jvp(
                *given,
                is_causal=bool(call.get("is_causal", False)),
                scale=call.get("scale"),
                enable_gqa=bool(call.get("enable_gqa", False)),
                block_elements=self.block_elements,
                chunk=self.chunk,
                key_chunk=self.key_chunk,
            )
        return fwAD.make_dual(out, tan)
