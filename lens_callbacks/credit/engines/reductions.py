r"""Dots, squared norms and Grams of gradient pieces, accumulated in float64.

A piece's products are formed in its own dtype, block by block, and the blocks' results are summed in
float64: over a ``10⁸``-element embedding piece a float32 accumulator drifts by ~1e-5 in the shares,
while float32 products over blocks of ``2¹⁶`` elements reduced in float64 keep ~1e-8, without a float64
copy of the piece (which would cost twice its memory).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "sq64", "diff_sq64", "dots64", "gram64", "row_sq64", "row_sum", "sum_dtype", "dot64", "WIDE_BLOCK"]

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


def sq64(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖²`` as a float64 0-d tensor (read back later with the others); no float64 copy of ``x``.

    Squares summed in ``x``'s dtype over blocks (torch's cascade sum), the blocks' sums in float64.
    (``torch.linalg.vector_norm`` in float32 drifts by ~1e-6 over ``2¹⁶`` elements: not used.)"""
    v = x.reshape(-1)  # [n]
    if v.dtype == torch.float64:
        return torch.dot(v, v)
    step = 16 * BLOCK
    if v.numel() <= step:
        return (v * v).sum().double()
    return torch.stack([(v[s:e] * v[s:e]).sum() for s, e in _blocks(v.numel(), step)]).double().sum()


def diff_sq64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``‖a − b‖²`` in float64, block by block (no parameter-sized difference is formed); the difference is
    taken in the wider of the two dtypes, so neither side is rounded to the other's precision first."""
    dt = torch.promote_types(a.dtype, b.dtype)
    u, v = a.reshape(-1), b.reshape(-1)  # [n]
    if u.numel() <= 4 * BLOCK:
        return sq64(u.to(dt) - v.to(dt))
    out = torch.zeros((), dtype=torch.float64, device=u.device)
    step = 16 * BLOCK
    for s, e in _blocks(u.numel(), step):
        out += sq64(u[s:e].to(dt) - v[s:e].to(dt))
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
    out = (Pt @ Qt.T).double()  # [c, c']
    if Pb.shape[1]:
        out += torch.bmm(Pb.transpose(0, 1), Qb.transpose(0, 1).transpose(1, 2)).double().sum(0)
    return out


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


def dot64(a: torch.Tensor, b: torch.Tensor, c: "torch.Tensor | None" = None, exact: bool = True) -> torch.Tensor:
    """``Σ a·b`` (``Σ a·b·c`` with ``c``) as a float64 0-d tensor, without a float64 copy of the operands.

    ``exact`` (default): every product taken in float64, block by block (:data:`WIDE_BLOCK` elements) — the
    products of float32 values are exact in float64. ``exact=False``: products in the operands' dtype, one
    ``torch.dot`` per block of :data:`BLOCK` elements, the blocks summed in float64 (~1e-7 relative; several
    times faster). A 0-d (scalar) operand is broadcast.
    """
    n = max(a.numel(), b.numel(), 0 if c is None else c.numel())
    dev = a.device if a.numel() == n else b.device

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(dev) if x.numel() == n else x.reshape(()).to(dev).expand(n)

    u, v, w = flat(a), flat(b), None if c is None else flat(c)
    if not exact and u.dtype == v.dtype and (w is None or w.dtype == u.dtype) and u.dtype != torch.float64:
        parts = []
        for s, e in _blocks(n, 16 * BLOCK):
            x = u[s:e] if w is None else u[s:e] * w[s:e]
            y = v[s:e]
            if x.stride(0) == 0 or y.stride(0) == 0:  # a broadcast scalar: a plain sum of products
                parts.append((x * y).sum())
            else:
                parts.append(
                    torch.stack([torch.dot(x[i:j], y[i:j]) for i, j in _blocks(e - s)]).sum(dtype=torch.float64)
                    if e - s > BLOCK
                    else torch.dot(x, y)
                )
        return (
            torch.stack([q.double() for q in parts]).sum()
            if parts
            else torch.zeros((), dtype=torch.float64, device=dev)
        )
    out = torch.zeros((), dtype=torch.float64, device=dev)
    for s, e in _blocks(n, WIDE_BLOCK):
        prod = u[s:e].double() * v[s:e].double()
        if w is not None:
            prod *= w[s:e].double()
        out += prod.sum()
    return out
