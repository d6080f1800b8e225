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
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

ROUTES = ("auto", "direct", "ghost")


def _sq(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖²`` in float64 as a 0-d tensor (read back later with the others)."""
    x = x.reshape(-1).double()  # [n]
    return torch.dot(x, x)


def _positions(u) -> int:
    """Positions per row of a use's output gradient."""
    b = u.b
    return int(b.numel() // (b.shape[0] * b.shape[-1])) if b.numel() else 0


def ghost_eligible(uses: Sequence, param: torch.Tensor) -> bool:
    """Every use of ``param`` is the weight of a ``Linear``/``Conv1D`` (the ghost identities apply)."""
    return bool(uses) and param.dim() == 2 and all(u.rule in ("linear", "conv1d") and param is u.weight for u in uses)


def route_costs(
    uses: Sequence, param: torch.Tensor, rows: int, m: int, n_chunks: int, gram: bool, diag: bool = False
) -> tuple[float, float]:
    """Multiply-adds of the (direct, ghost) routes for one parameter.

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
    pairs = 0.0
    if gram or (diag and rows != m):  # several rows to a part: every row pair is formed, then summed per part
        pairs = float(sum(rows * rows * a * b * (dL + dR + 1) for a in ns for b in ns))
    elif diag:  # one row to a part: the pairs of a row with itself
        pairs = float(sum(rows * a * b * (dL + dR + 1) for a in ns for b in ns))
    return direct, 2.0 * prod + pairs


def choose_route(
    uses: Sequence, param: torch.Tensor, rows: int, m: int, n_chunks: int, gram: bool, route: str, diag: bool = False
) -> str:
    """``"direct"`` or ``"ghost"`` for this parameter (``route`` forces one where the ghost identities apply)."""
    if route == "direct" or not ghost_eligible(uses, param):
        return "direct"
    if route == "ghost":
        return "ghost"
    if not gram and not diag and n_chunks > 1:
        return "ghost"  # the pieces do not fit one chunk: read the layer without forming any
    direct, ghost = route_costs(uses, param, rows, m, n_chunks, gram, diag)
    return "ghost" if ghost < direct else "direct"


def _factors(u, sel: torch.Tensor, B: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(L, R)`` of one use on the selected rows, ``[r, n, d_L]`` and ``[r, n, d_R]``: the piece is ``Lᵀ R``."""
    if u.b is None:
        return None
    g = u.b.reshape(B, -1, u.b.shape[-1])  # [B, n, out]
    a = u.a.reshape(B, -1, u.a.shape[-1]).to(g.dtype)  # [B, n, in]
    if sel.numel() != B:
        g, a = g[sel], a[sel]
    return (g, a) if u.rule == "linear" else (a, g)


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
) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns:
        ``(Σ_S g_S, ‖Σ_S g_S − g_full‖²)``: the parts' sum assembled from the captured factors (float64 0-d
        tensor for the second, read back later with the others).
    """
    dL, dR = g_full.shape
    total = torch.zeros_like(g_full)
    facs = [f for f in (_factors(u, sel, B) for u in uses) if f is not None]
    r = int(sel.numel())
    if r == 0 or not facs:
        return total, _sq(total - g_full)
    row_dot = torch.zeros(r, dtype=g_full.dtype, device=g_full.device)  # [r]
    W = (g_full if target is None else target).to(facs[0][0].dtype)
    for L, R in facs:
        n = L.shape[1]
        # <Lᵀ R, W> = Σ_t L_t · (W R_t): multiply on the wider side, take the elementwise product on the narrower.
        if dL <= dR:
            row_dot += ((R.reshape(-1, dR) @ W.T).view(r, n, dL) * L).sum((1, 2)).to(row_dot.dtype)
        else:
            row_dot += ((L.reshape(-1, dL) @ W).view(r, n, dR) * R).sum((1, 2)).to(row_dot.dtype)
        total += (L.reshape(-1, dL).T @ R.reshape(-1, dR)).to(total.dtype)  # [d_L, d_R]
    dots.index_add_(0, dst, row_dot.double())
    if gram is None and sq is not None and bool((torch.bincount(dst) <= 1).all()):
        # one row to a part: ‖L_kᵀ R_k‖² = Σ (L_k L_kᵀ) ∘ (R_k R_kᵀ), row by row, no pair of rows formed
        row_sq = torch.zeros(r, dtype=torch.float64, device=g_full.device)  # [r]
        for Lu, Ru in facs:
            for Lv, Rv in facs:
                kb = max(1, min(r, budget // max(1, 2 * Lu.shape[1] * Lv.shape[1])))  # rows per block
                for k0 in range(0, r, kb):
                    k1 = min(r, k0 + kb)
                    pair = torch.bmm(Lu[k0:k1], Lv[k0:k1].transpose(1, 2))  # [kb, nu, nv]
                    pair.mul_(torch.bmm(Ru[k0:k1], Rv[k0:k1].transpose(1, 2)))
                    row_sq[k0:k1] += pair.sum((1, 2)).double()
        sq.index_add_(0, dst, row_sq)
        return total, _sq(total - g_full)
    if gram is not None or sq is not None:
        rg = torch.zeros(r, r, dtype=facs[0][0].dtype, device=g_full.device)  # [r, r] row Gram
        for Lu, Ru in facs:
            nu = Lu.shape[1]
            for Lv, Rv in facs:
                nv = Lv.shape[1]
                Lv2, Rv2 = Lv.reshape(-1, dL), Rv.reshape(-1, dR)  # [r·nv, d]
                kb = max(1, min(r, budget // max(1, 2 * nu * r * nv)))  # rows per block of pair products
                for k0 in range(0, r, kb):
                    k1 = min(r, k0 + kb)
                    pair = Lu[k0:k1].reshape(-1, dL) @ Lv2.T  # [kb·nu, r·nv]
                    pair.mul_(Ru[k0:k1].reshape(-1, dR) @ Rv2.T)
                    rg[k0:k1] += pair.view(k1 - k0, nu, r, nv).sum((1, 3))
        m = dots.shape[0]
        by_part = torch.zeros(m, r, dtype=torch.float64, device=dots.device).index_add_(0, dst, rg.double())  # [m, r]
        if gram is not None:
            gram.index_add_(1, dst, by_part)
        else:  # each part's pairs of its own rows: Σ_{k,l ∈ S} <g_k, g_l>
            sq.index_add_(0, dst, by_part[dst, torch.arange(r, device=dst.device)])
    return total, _sq(total - g_full)
