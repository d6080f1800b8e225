r"""Dots, squared norms and Grams of gradient pieces, accumulated in float64.

A piece's products are formed in its own dtype, block by block, and the blocks' results are summed in
float64: over a ``10⁸``-element embedding piece a float32 accumulator drifts by ~1e-5 in the shares,
while float32 products over blocks of ``2¹⁶`` elements reduced in float64 keep ~1e-8, without a float64
copy of the piece (which would cost twice its memory).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

__all__ = [
    "BLOCK",
    "inner64",
    "inners64",
    "AlongSums",
    "along_sums",
    "cache_block",
    "sq64",
    "diff_sq64",
    "diff_dot64",
    "dots64",
    "gram64",
    "row_sq64",
    "row_sum",
    "sum_dtype",
    "dot64",
    "WIDE_BLOCK",
]

# Elements per block of a float32 product; the blocks' results are summed in float64.
BLOCK = 1 << 16
# Blocks up to this many elements are reduced on a float64 copy outright (the copy costs less than the
# kernels of a blocked reduction, and float32 matrix-vector products lose ~1e-6 to cancellation).
SMALL = 1 << 20


def _blocks(n: int, block: int = BLOCK):
    return ((s, min(n, s + block)) for s in range(0, n, block))


def _split(P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[c, n]`` block as whole ``[c, nb, BLOCK]`` blocks (a view, no copy) and its ``[c, n mod BLOCK]`` tail."""
    if P.stride(1) != 1:
        P = P.contiguous()
    c, n = P.shape
    nb = n // BLOCK
    body = torch.as_strided(P, (c, nb, BLOCK), (P.stride(0), BLOCK, 1), P.storage_offset())  # [c, nb, BLOCK]
    return body, P[:, nb * BLOCK :]


def cache_block(device: torch.device) -> int:
    """Elements of one block of an elementwise pass over a parameter: :data:`BLOCK` on a CPU (256 KB in
    float32, in a core's cache while every operation on it runs), ``16·BLOCK`` elsewhere (a GPU gains
    nothing from a small block and pays a kernel launch per block and operation)."""
    return BLOCK if device.type == "cpu" else 16 * BLOCK


def inner64(a: torch.Tensor, b: "torch.Tensor | None" = None) -> torch.Tensor:
    """``Σ a·b`` (``‖a‖²`` without ``b``) as a float64 0-d tensor (read back later with the others), with no
    float64 copy of either.

    Products in the operands' dtype (the wider of the two; float32 for half precisions), a block
    (:func:`cache_block`) at a time into one reused buffer, each block summed by torch's cascade sum, the
    blocks' sums in float64: ~1e-8 relative in float32 at a third of the memory traffic of float64 products
    (:func:`dot64`).
    (``torch.linalg.vector_norm`` or a float32 ``torch.dot`` drift by ~1e-7 to ~1e-6 over ``2¹⁶`` elements:
    not used.) Float64 operands: ``torch.dot``."""
    return inners64([(a, a if b is None else b)])[0]


def inners64(pairs: "list[tuple[torch.Tensor, torch.Tensor]]") -> list[torch.Tensor]:
    """:func:`inner64` of every pair, the pairs' operands (of one size) read a block at a time together: an
    operand in several pairs is read from memory once, the other pairs find its block in cache."""
    flat = [(a.reshape(-1), b.reshape(-1)) for a, b in pairs]  # [n] each
    n = flat[0][0].numel() if flat else 0
    if any(u.numel() != n or v.numel() != n for u, v in flat):
        raise ValueError(f"`pairs` must hold operands of one size, got {[(u.numel(), v.numel()) for u, v in flat]}.")
    dts = [sum_dtype(torch.promote_types(u.dtype, v.dtype)) for u, v in flat]
    out: list[Optional[torch.Tensor]] = [
        torch.dot(u.to(dt), v.to(dt)) if dt == torch.float64 else None for (u, v), dt in zip(flat, dts)
    ]
    todo = [k for k, x in enumerate(out) if x is None]
    if todo and n <= BLOCK:  # one block: no buffer
        for k in todo:
            (u, v), dt = flat[k], dts[k]
            out[k] = (u.to(dt) * v.to(dt)).sum().double()
    elif todo:
        dev = flat[todo[0]][0].device
        step = cache_block(dev)
        # one block's products, reused: a fresh block per product is a fresh mapping on a CPU, and its page
        # faults cost more than the product
        bufs = {dt: torch.empty(min(step, n), dtype=dt, device=dev) for dt in {dts[k] for k in todo}}
        sums: dict[int, list[torch.Tensor]] = {k: [] for k in todo}
        for s, e in _blocks(n, step):
            for k in todo:
                (u, v), dt = flat[k], dts[k]
                sums[k].append(torch.mul(u[s:e].to(dt), v[s:e].to(dt), out=bufs[dt][: e - s]).sum())
        for k in todo:
            out[k] = (
                torch.stack(sums[k]).double().sum() if sums[k] else torch.zeros((), dtype=torch.float64, device=dev)
            )
    return out  # type: ignore[return-value]


class AlongSums(NamedTuple):
    """The parameter-wide sums a check along ``v`` takes (float64, by :func:`inners64`): what a reading along
    ``v`` needs besides the parts' dots."""

    full_sq: float  # ‖g_full‖²
    full_dot: float  # <g_full, v>
    onto_sq: float  # ‖v‖²


def along_sums(g_full: Sequence[torch.Tensor], onto: Sequence[torch.Tensor]) -> AlongSums:
    """``‖g_full‖²``, ``<g_full, v>`` and ``‖v‖²`` over parameter lists, each parameter's two operands read once."""
    sums = [torch.stack(inners64([(g, g), (g, v), (v, v)])).cpu() for g, v in zip(g_full, onto)]  # [3] each
    if not sums:
        return AlongSums(0.0, 0.0, 0.0)
    return AlongSums(*(math.fsum(col) for col in torch.stack(sums).T.tolist()))


def sq64(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖²`` as a float64 0-d tensor: :func:`inner64` of ``x`` with itself."""
    return inner64(x)


def diff_sq64(a: torch.Tensor, b: torch.Tensor, scratch: "torch.Tensor | None" = None) -> torch.Tensor:
    """``‖a − b‖²`` in float64, block by block (no parameter-sized difference is formed); the difference is
    taken in the wider of the two dtypes, so neither side is rounded to the other's precision first.
    ``scratch`` (1-d, that dtype): a buffer the caller reuses for the blocks' differences (else one is made:
    a fresh block per difference is a fresh mapping on a CPU, and its page faults cost more than the sum)."""
    dt = torch.promote_types(a.dtype, b.dtype)
    u, v = a.reshape(-1), b.reshape(-1)  # [n]
    step = 16 * BLOCK
    if scratch is None or scratch.dtype != dt or scratch.device != u.device or scratch.numel() < min(step, u.numel()):
        scratch = torch.empty(min(step, u.numel()), dtype=dt, device=u.device)
    out = torch.zeros((), dtype=torch.float64, device=u.device)
    for s, e in _blocks(u.numel(), step):
        d = torch.sub(u[s:e].to(dt), v[s:e].to(dt), out=scratch[: e - s])
        if dt == torch.float64:
            out += torch.dot(d, d)
        else:
            out += torch.mul(d, d, out=d).sum().double()  # squares in place, a cascade sum per block
    return out


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of pieces in ``dtype`` is kept in: float32 for half precisions (their pieces come
    from autocast; ``Σ_S g_S`` is held against a float32 gradient), else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def row_sum(P: torch.Tensor) -> torch.Tensor:
    """``P.sum(0)`` of a ``[c, n]`` block in :func:`sum_dtype`: a matrix-vector product where the dtype
    stays (a column sum strides badly on a CPU), accumulated and kept in float32 for half precisions."""
    if sum_dtype(P.dtype) != P.dtype:
        return P.sum(0, dtype=sum_dtype(P.dtype))  # [n]
    return torch.ones(P.shape[0], dtype=P.dtype, device=P.device) @ P  # [n]


def dots64(P: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``P @ t`` for a ``[c, n]`` block of pieces and an ``[n]`` vector, float64 ``[c]``.

    Products in ``P``'s dtype over column blocks of ``BLOCK`` (a float32 matrix-vector product sums
    sequentially: over ``2²⁰`` columns it drifts by ~1e-7), their results summed in float64."""
    t = t.reshape(-1).to(P.dtype)  # [n]
    if P.dtype == torch.float64 or P.numel() <= SMALL:
        return P.double() @ t.double()
    step = BLOCK
    if P.shape[1] <= step:
        return (P @ t).double()
    return torch.stack([P[:, s:e] @ t[s:e] for s, e in _blocks(P.shape[1], step)], 1).double().sum(1)  # [c]


def gram64(P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """``P @ Qᵀ`` for ``[c, n]`` and ``[c', n]`` blocks, float64 ``[c, c']`` (blocked products, float64 sum)."""
    if P.dtype == torch.float64 or P.numel() + Q.numel() <= SMALL:
        return P.double() @ Q.double().T
    (Pb, Pt), (Qb, Qt) = _split(P), _split(Q)  # [c, nb, BLOCK], [c, tail]
    if not Pb.shape[1]:
        return (Pt @ Qt.T).double()  # [c, c']
    out = torch.bmm(Pb.transpose(0, 1), Qb.transpose(0, 1).transpose(1, 2)).double().sum(0)  # [c, c']
    return out if Pt.shape[1] == 0 else out + (Pt @ Qt.T).double()


def row_sq64(P: torch.Tensor) -> torch.Tensor:
    """``‖P_i‖²`` of every row of a ``[c, n]`` block, float64 ``[c]`` (squares summed per column block in
    ``P``'s dtype, the blocks in float64; the temporaries are one block, never a copy of ``P``)."""
    if P.dtype == torch.float64 or P.numel() <= SMALL:
        P = P.double()
        return (P * P).sum(1)
    step = max(BLOCK, (16 * BLOCK) // max(1, P.shape[0]))
    out = torch.zeros(P.shape[0], dtype=torch.float64, device=P.device)
    for s, e in _blocks(P.shape[1], step):
        blk = P[:, s:e]  # [c, e-s]
        out += (blk * blk).sum(1).double()
    return out


#: Elements per block where products are taken in float64 (:func:`dot64`): 8 MiB of float64 at a time.
WIDE_BLOCK = 1 << 20


def diff_dot64(
    a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, scratch: "torch.Tensor | None" = None
) -> torch.Tensor:
    """``<a − b, w>`` in float64, block by block as :func:`diff_sq64` (no difference of the operands' size is
    formed); the difference is taken in the wider of the operands' dtypes and float32 (exact for two nearby
    values of a half or single precision), the products in that dtype, each block summed in float64.
    ``scratch``: a 1-d buffer of that dtype the caller reuses."""
    dt = sum_dtype(
        torch.promote_types(torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32), w.dtype)
    )
    u, v, x = a.reshape(-1), b.reshape(-1), w.reshape(-1)  # [n]
    step = cache_block(u.device)
    if scratch is None or scratch.dtype != dt or scratch.device != u.device or scratch.numel() < min(step, u.numel()):
        scratch = torch.empty(min(step, u.numel()), dtype=dt, device=u.device)
    out = torch.zeros((), dtype=torch.float64, device=u.device)
    for s, e in _blocks(u.numel(), step):
        d = torch.sub(u[s:e].to(dt), v[s:e].to(dt), out=scratch[: e - s])
        out += torch.dot(d, x[s:e].to(dt)) if dt == torch.float64 else d.mul_(x[s:e].to(dt)).sum().double()
    return out


def dot64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ a·b`` as a float64 0-d tensor, every product taken in float64 (exact for float32 values), block by
    block (:data:`WIDE_BLOCK` elements): no float64 copy of the operands. :func:`inner64` takes the products
    in the operands' dtype, at a third of the memory traffic."""
    u, v = a.reshape(-1), b.reshape(-1)  # [n]
    if u.numel() != v.numel():
        raise ValueError(f"`a` and `b` must have one size, got {u.numel()} and {v.numel()} elements.")
    out = torch.zeros((), dtype=torch.float64, device=u.device)
    for s, e in _blocks(u.numel(), WIDE_BLOCK):
        out += (u[s:e].double() * v[s:e].double()).sum()
    return out
