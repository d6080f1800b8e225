r"""Per-layer choice between the direct per-row product and the ghost identities.

A weight ``W`` of a ``Linear`` (or transformers' ``Conv1D``) gets from row ``k`` the piece
``g_k = L_kᵀ R_k`` with ``L_k`` ``[n, d_L]`` and ``R_k`` ``[n, d_R]`` (``Linear``: ``L = B``, the output
gradient, ``R = A``, the input; ``Conv1D``: ``L = A``, ``R = B``). Two exact ways to read it:

- **direct**: form every ``g_k`` (a batched product, ``r·n·d_L·d_R`` multiply-adds and a ``[c, d_L, d_R]``
  chunk of pieces), then ``<g_S, G>``, ``Σ_S g_S`` and the Gram ``<g_S, g_S'>`` from them (``m²·d_L·d_R``);
- **ghost**: never form a per-row piece:

  - ``<g_k, G> = Σ_t L_kt · (G R_kt)`` (one product ``R G ᵀ`` over all rows, ``r·n·d_L·d_R``),
  - ``Σ_k g_k = L_allᵀ R_all`` (one product, the same count),
  - ``<g_k, g_l> = Σ_{t,s} (L_kt·L_ls)(R_kt·R_ls)``, i.e. ``Σ (L_k L_lᵀ) ∘ (R_k R_lᵀ)``
    (``r²·n²·(d_L + d_R)``), summed per part afterwards; each part's ``‖g_S‖²`` alone
    (``readings="shares"``) needs only the pairs inside a part: ``r·n²·(d_L + d_R)`` when every part is
    one row.

The ghost Gram wins when rows are short against the layer's width (``n² (d_L + d_R) < d_L d_R``
roughly); the direct route wins on long rows, and its pieces must be recomputed for every pair of chunks
when they do not fit in one chunk of the memory budget. :func:`choose_route` compares the two counts
per parameter, including that recomputation; for projected shares alone (no Gram) the direct route is
cheaper by count unless its pieces would not fit in one chunk, where the ghost route is taken because it
holds no ``d_L × d_R`` piece per row at all (its temporaries are activation-sized).

An ``nn.Embedding`` weight ``E`` ``[V, d]`` gets from row ``k`` the piece ``Σ_t e_{id_kt} ⊗ G_kt``: the
same shape with a one-hot left factor, held as the token ids themselves. Its readings need no ``[V, d]``
piece per row: ``<g_k, W> = Σ_t G_kt · W[id_kt]`` (a gather), ``Σ_k g_k`` is one ``index_add`` and the
row pairs' left Gram is token equality, ``[id_kt = id_ls]``, so ``‖g_k‖² = Σ_{t,s: id_t = id_s} G_t·G_s``.
A tied embedding / LM head (one parameter, both uses) is read the same way with the exact cross term:
the left Gram of an embedding use against a head use is a gather of the head's output gradient,
``B_ls[id_kt]``. An embedding is always read so (the dense route would build ``[c, V, d]`` pieces).

Every dot and squared norm is accumulated in float64 (products in the pieces' dtype).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .reductions import diff_sq64, sq64
from .rules import Factors, rule_of

ROUTES = ("auto", "direct", "ghost")

# Multiply-adds one element moved through memory (written, zeroed or read) is worth on a CPU core: the
# direct route's per-row pieces are written and read several times, the ghost route's temporaries are
# activation-sized.
MOVE_COST = 8.0

# Elements of one block of a ghost dot's products (float32 products, float64 sums).
_DOT_BLOCK = 1 << 22


def _positions(u) -> int:
    """Positions per row of a use's output gradient."""
    return rule_of(u).positions(u)


def factored(u, param: torch.Tensor) -> bool:
    """Whether ``u``'s piece of ``param`` is ``Lᵀ R`` (its rule gives factors for it)."""
    return param.dim() == 2 and rule_of(u).has_factors(u, param)


def ghost_eligible(uses: Sequence, param: torch.Tensor) -> bool:
    """Every use of ``param`` is a weight read as ``Lᵀ R`` (the ghost identities apply)."""
    return bool(uses) and all(factored(u, param) for u in uses)


def sparse_only(uses: Sequence, param: torch.Tensor) -> bool:
    """``param`` has a use whose rule reads it only by factors (an embedding: no ``[c, V, d]`` pieces)."""
    return any(rule_of(u).factors_only and rule_of(u).has_factors(u, param) for u in uses)


def route_costs(
    uses: Sequence, param: torch.Tensor, rows: int, m: int, n_chunks: int, gram: bool, diag: bool = False
) -> tuple[float, float]:
    """Cost of the (direct, ghost) routes for one parameter: multiply-adds plus ``MOVE_COST`` per element
    the route moves through memory beyond the activations.

    Args:
        uses: the parameter's captured uses (all eligible).
        param: the weight, ``[d_L, d_R]``.
        rows: rows that belong to some part.
        m: number of parts.
        n_chunks: chunks of parts the direct route needs under the memory budget.
        gram: whether the Gram is wanted (``readings="all"``).
        diag: whether each part's squared norm alone is wanted (``readings="shares"``).
    """
    dL, dR = param.shape
    P = dL * dR
    ns = [_positions(u) for u in uses if u.b is not None]
    prod = float(sum(rows * n * P for n in ns))
    # With the Gram, chunk i's pieces are built once and then once more for every later chunk j.
    redo = (n_chunks + 1) / 2 if gram and n_chunks > 1 else 1.0
    direct = prod * redo + 2.0 * m * P + (float(m) * m * P if gram else 0.0) + (float(m) * P if diag else 0.0)
    # pieces written (and zeroed when rows share a part), read for the dots, the sum, and the norms
    moved = float(len(ns)) * rows * P * redo + (m * P if rows != m else 0.0) + 2.0 * m * P + (m * P if gram or diag else 0.0)
    direct += MOVE_COST * moved
    pairs = 0.0
    if gram or (diag and rows != m):  # several rows to a part: every row pair is formed, then summed per part
        pairs = float(sum(rows * rows * a * b * (dL + dR + 1) for a in ns for b in ns))
    elif diag:  # one row to a part: the pairs of a row with itself
        pairs = float(sum(rows * a * b * (dL + dR + 1) for a in ns for b in ns))
    ghost = 2.0 * prod + pairs + MOVE_COST * 2.0 * P  # Σ_S g_S written and read once
    return direct, ghost


def choose_route(
    uses: Sequence, param: torch.Tensor, rows: int, m: int, n_chunks: int, gram: bool, route: str, diag: bool = False
) -> str:
    """``"direct"`` or ``"ghost"`` for this parameter (``route`` forces one where the ghost identities apply;
    a parameter with an embedding use is always read by the ghost route)."""
    if not ghost_eligible(uses, param):
        return "direct"
    if sparse_only(uses, param):
        return "ghost"
    if route in ("direct", "ghost"):
        return route
    if not gram and not diag and n_chunks > 1:
        return "ghost"  # the pieces do not fit one chunk: read the layer without forming any
    direct, ghost = route_costs(uses, param, rows, m, n_chunks, gram, diag)
    return "ghost" if ghost < direct else "direct"


def _factors(u, param: torch.Tensor, sel: torch.Tensor, B: int) -> Optional[Factors]:
    """One use's factors on the selected rows (the piece is ``Lᵀ R``)."""
    if u.b is None:
        return None
    return rule_of(u).factors(u, param, sel, B)


def _row_dot(f: Factors, W: torch.Tensor) -> torch.Tensor:
    """``<L_kᵀ R_k, W>`` of every row, float64 ``[r]``.

    ``<Lᵀ R, W> = Σ_t L_t · (W R_t)``: the product is contracted over the narrower side of ``W`` (short
    float32 sums), then multiplied elementwise with the other factor and summed in float64, block by block
    over the wider side. Contracting over a vocabulary in float32 instead loses ~1e-6: a head's output
    gradient ``p − e_y`` nearly cancels against ``W``'s rows."""
    L, R = f.L, f.R
    r, n, dR = R.shape
    if f.index:  # Σ_t R_t · W[id_t]: a gather of the rows the tokens touch
        return (W[L].double() * R.double()).sum((1, 2))
    dL = W.shape[0]
    L2, R2 = L.reshape(-1, dL), R.reshape(-1, dR)  # [r·n, d_L], [r·n, d_R]
    # X = R Wᵀ ([r·n, d_L], contracted over d_R) when d_R is the narrower side, else L W ([r·n, d_R])
    narrow, other, Wt = (R2, L2, W.T) if dR <= dL else (L2, R2, W)
    wide = other.shape[1]
    step = max(1, _DOT_BLOCK // max(1, narrow.shape[0]))
    out = torch.zeros(narrow.shape[0], dtype=torch.float64, device=W.device)  # [r·n]
    for s in range(0, wide, step):
        e = min(wide, s + step)
        X = narrow @ Wt[:, s:e]  # [r·n, e-s]
        out += X.mul_(other[:, s:e]).sum(1).double()  # a block's cascade sum in float32, blocks in float64
    return out.view(r, n).sum(1)


def _total(facs: Sequence[Factors], like: torch.Tensor) -> torch.Tensor:
    """``Σ_u Σ_k L_ukᵀ R_uk``: the dense uses' products first (the first one allocates the sum, the others
    add into it), the token-id uses by ``index_add``; a parameter-sized zero-fill only when no use is dense."""
    total: Optional[torch.Tensor] = None
    for f in facs:
        if f.index:
            continue
        L2, R2 = f.L.reshape(-1, f.L.shape[-1]), f.R.reshape(-1, f.R.shape[-1])  # [r·n, d_L], [r·n, d_R]
        if total is None:
            total = (L2.T @ R2).to(like.dtype)  # [d_L, d_R]
        elif L2.dtype == total.dtype:
            total.addmm_(L2.T, R2)
        else:
            total += (L2.T @ R2).to(total.dtype)
    if total is None:
        total = torch.zeros_like(like)
    for f in facs:
        if f.index:
            total.index_add_(0, f.L.reshape(-1), f.R.reshape(-1, f.R.shape[-1]).to(total.dtype))
    return total


def _left_pairs(u: Factors, v: Factors, k0: int, k1: int) -> torch.Tensor:
    """``L_u L_vᵀ`` of rows ``k0:k1`` of ``u`` against every row of ``v``: ``[kb·n_u, r·n_v]``."""
    if u.index and v.index:
        return (u.L[k0:k1].reshape(-1, 1) == v.L.reshape(1, -1)).to(u.R.dtype)
    if u.index:  # one-hot against dense: the dense factor's entries at u's tokens
        return v.L.reshape(-1, v.L.shape[-1])[:, u.L[k0:k1].reshape(-1)].T
    if v.index:
        return u.L[k0:k1].reshape(-1, u.L.shape[-1])[:, v.L.reshape(-1)]
    return u.L[k0:k1].reshape(-1, u.L.shape[-1]) @ v.L.reshape(-1, v.L.shape[-1]).T


def _left_pairs_rowwise(u: Factors, v: Factors, k0: int, k1: int) -> torch.Tensor:
    """``L_{u,k} L_{v,k}ᵀ`` of each row ``k`` in ``k0:k1`` with itself: ``[kb, n_u, n_v]``."""
    if u.index and v.index:
        return (u.L[k0:k1, :, None] == v.L[k0:k1, None, :]).to(u.R.dtype)
    if u.index:
        ids = u.L[k0:k1]  # [kb, n_u]
        return torch.gather(v.L[k0:k1], 2, ids[:, None, :].expand(-1, v.L.shape[1], -1)).transpose(1, 2)
    if v.index:
        ids = v.L[k0:k1]  # [kb, n_v]
        return torch.gather(u.L[k0:k1], 2, ids[:, None, :].expand(-1, u.L.shape[1], -1))
    return torch.bmm(u.L[k0:k1], v.L[k0:k1].transpose(1, 2))


def ghost_param(
    uses: Sequence,
    g_full: torch.Tensor,
    sel: torch.Tensor,
    dst: torch.Tensor,
    B: int,
    dots: torch.Tensor,
    gram: Optional[torch.Tensor],
    budget: int,
    sq: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    param: Optional[torch.Tensor] = None,
    keep_total: bool = True,
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """One weight read by the ghost identities; adds into ``dots`` ``[m]`` and ``gram`` ``[m, m]`` in place.

    Args:
        uses: the weight's uses (all :func:`ghost_eligible`).
        g_full: the weight's full gradient, ``[d_L, d_R]``.
        sel: ``[r]`` rows that belong to some part; ``dst``: ``[r]`` their part.
        B: rows of the batch.
        dots: float64 ``<g_S, g_full>`` accumulator.
        gram: float64 Gram accumulator, or None (projected shares only).
        budget: elements one block of row-pair products may hold.
        sq: float64 ``[m]`` accumulator of each part's ``‖g_S‖²`` (``readings="shares"``), or None.
        target: what the parts are dotted with instead of ``g_full`` (``project_onto``), or None.
        param: the parameter (default: the first use's weight).
        keep_total: return ``Σ_S g_S`` (else None: the difference is then formed in its place).

    Returns:
        ``(Σ_S g_S, ‖Σ_S g_S − g_full‖²)``: the parts' sum assembled from the captured factors (float64 0-d
        tensor for the second, read back later with the others).
    """
    param = uses[0].weight if param is None else param
    facs = [f for f in (_factors(u, param, sel, B) for u in uses) if f is not None]
    r = int(sel.numel())
    if r == 0 or not facs:
        return (torch.zeros_like(g_full) if keep_total else None), sq64(g_full)
    row_dot = torch.zeros(r, dtype=torch.float64, device=g_full.device)  # [r]
    W = (g_full if target is None else target).to(facs[0].R.dtype)
    for f in facs:
        row_dot += _row_dot(f, W)
    dots.index_add_(0, dst, row_dot)

    def summed() -> tuple[Optional[torch.Tensor], torch.Tensor]:
        total = _total(facs, g_full)
        if keep_total:
            return total, diff_sq64(total, g_full)
        return None, sq64(total.sub_(g_full.to(total.dtype)))  # the difference in the sum's own buffer

    if gram is None and sq is not None and bool((torch.bincount(dst) <= 1).all()):
        # one row to a part: ‖g_k‖² = Σ (L_k L_kᵀ) ∘ (R_k R_kᵀ), row by row, no pair of rows formed
        row_sq = torch.zeros(r, dtype=torch.float64, device=g_full.device)  # [r]
        for u in facs:
            for v in facs:
                nu, nv = u.R.shape[1], v.R.shape[1]
                kb = max(1, min(r, budget // max(1, 2 * nu * nv)))  # rows per block
                for k0 in range(0, r, kb):
                    k1 = min(r, k0 + kb)
                    pair = _left_pairs_rowwise(u, v, k0, k1)  # [kb, nu, nv]
                    pair = pair * torch.bmm(u.R[k0:k1], v.R[k0:k1].transpose(1, 2))
                    row_sq[k0:k1] += pair.sum(2).double().sum(1)
        sq.index_add_(0, dst, row_sq)
        return summed()
    if gram is not None or sq is not None:
        rg = torch.zeros(r, r, dtype=torch.float64, device=g_full.device)  # [r, r] row Gram
        for u in facs:
            nu = u.R.shape[1]
            for v in facs:
                nv = v.R.shape[1]
                Rv2 = v.R.reshape(-1, v.R.shape[-1])  # [r·nv, d_R]
                kb = max(1, min(r, budget // max(1, 2 * nu * r * nv)))  # rows per block of pair products
                for k0 in range(0, r, kb):
                    k1 = min(r, k0 + kb)
                    pair = _left_pairs(u, v, k0, k1)  # [kb·nu, r·nv]
                    pair = pair * (u.R[k0:k1].reshape(-1, u.R.shape[-1]) @ Rv2.T)
                    rg[k0:k1] += pair.view(k1 - k0, nu, r, nv).sum(3).double().sum(1)
        m = dots.shape[0]
        by_part = torch.zeros(m, r, dtype=torch.float64, device=dots.device).index_add_(0, dst, rg)  # [m, r]
        if gram is not None:
            gram.index_add_(1, dst, by_part)
        else:  # each part's pairs of its own rows: Σ_{k,l ∈ S} <g_k, g_l>
            sq.index_add_(0, dst, by_part[dst, torch.arange(r, device=dst.device)])
    return summed()
