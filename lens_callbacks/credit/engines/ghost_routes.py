r"""Per-layer choice between the direct per-row product and the ghost identities.

A weight ``W`` of a ``Linear`` (or transformers' ``Conv1D``) gets from row ``k`` the piece
``g_k = L_kᵀ R_k`` with ``L_k`` ``[n, d_L]`` and ``R_k`` ``[n, d_R]`` (``Linear``: ``L = B``, the output
gradient, ``R = A``, the input; ``Conv1D``: ``L = A``, ``R = B``). Two exact ways to read it:

- **direct**: form every part's ``g_S`` a block of ``W``'s rows at a time (a batched product over the
  block, ``r·n·d_L·d_R`` multiply-adds in all; a block holds a few MB, more on long rows, and at most
  ``W``'s own size), and read ``<g_S, G>``, ``Σ_S g_S − g_full`` and the norms or the Gram (``m²·d_L·d_R``) from
  the block while it is in cache; no ``[m, d_L, d_R]`` buffer exists and no piece is formed twice. On a
  CPU, without the Gram, one part's piece of a block (about 1 MB) is formed and reduced at a time, so
  that it is read back from the core's own cache. Positions at either end of a row whose term is zero
  (the prompt and the padding at an LM head, whose output gradient is zero there) are not multiplied;
- **ghost**: never form a per-row piece:

  - ``<g_k, G> = Σ_t L_kt · (G R_kt)`` (one product ``R G ᵀ`` over all rows, ``r·n·d_L·d_R``),
  - ``Σ_k g_k = L_allᵀ R_all`` (one product, the same count),
  - ``<g_k, g_l> = Σ_{t,s} (L_kt·L_ls)(R_kt·R_ls)``, i.e. ``Σ (L_k L_lᵀ) ∘ (R_k R_lᵀ)``
    (``r²·n²·(d_L + d_R)``), summed per part afterwards; each part's ``‖g_S‖²`` alone
    (``readings="shares"``) needs only the pairs inside a part: ``r·n²·(d_L + d_R)`` when every part is
    one row.

The ghost Gram wins when rows are short against the layer's width (``n² (d_L + d_R) < d_L d_R``
roughly); the direct route wins on long rows, where it costs one product where the ghost route costs two
(its dots and its ``Σ_S g_S``). :func:`choose_route` compares the two counts per parameter.

An ``nn.Embedding`` weight ``E`` ``[V, d]`` gets from row ``k`` the piece ``Σ_t e_{id_kt} ⊗ G_kt``: the
same shape with a one-hot left factor, held as the token ids themselves. Its readings need no ``[V, d]``
piece per row: ``<g_k, W> = Σ_t G_kt · W[id_kt]`` (a gather), ``Σ_k g_k`` is one ``index_add`` and the
row pairs' left Gram is token equality, ``[id_kt = id_ls]``, so ``‖g_k‖² = Σ_{t,s: id_t = id_s} G_t·G_s``.
A tied embedding / LM head (one parameter, both uses) is read either way: on the ghost route with the
exact cross term (the left Gram of an embedding use against a head use is a gather of the head's output
gradient, ``B_ls[id_kt]``), on the direct route by adding each block's tokens into the head's block of
pieces (``index_add``). An embedding alone is always read by the ghost route (a gather per token).

Every dot and squared norm is accumulated in float64 (products in the pieces' dtype).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .reductions import diff_sq64, row_sum, sq64, sum_dtype
from .rules import Factors, rule_of

ROUTES = ("auto", "direct", "ghost")

# Multiply-adds one element moved through memory (written, zeroed or read) is worth on a CPU core: a
# parameter-sized sum out of cache (MOVE_COST), a block of pieces still in cache (BLOCK_MOVE_COST).
MOVE_COST = 8.0
BLOCK_MOVE_COST = 2.0

# Elements of one block of a ghost dot's products (float32 products, float64 sums).
_DOT_BLOCK = 1 << 22

# Elements of one block of every part's pieces on the direct route (a few MB: formed, reduced and
# dropped while they are still in cache).
_PIECE_BLOCK = 1 << 21
_SMALL_BLOCK = 1 << 18  # a small weight's pieces are formed whole, whatever its size against the block
#: Every part's pieces of an embedding together at most this many elements: read densely (the direct route).
SMALL_PIECES = 1 << 20
_MIN_ROWS = 128  # weight rows per block below which the per-part products lose their rate
# Products (rows × positions × weight elements) below which the dead ends are not looked for: finding them
# costs a few dozen small kernels, more than the products over a toy head's prompt positions they would save.
_CUT_MIN = 1 << 28


def _positions(u) -> int:
    """Positions per row of a use's output gradient (a use seen by parts says it without regrouping)."""
    n = getattr(u, "part_positions", None)
    return rule_of(u).positions(u) if n is None else n


def _grad_held(u) -> bool:
    """Whether the backward reached ``u``'s output (read off the batch's own rows: nothing regrouped)."""
    return getattr(u, "raw", u).b is not None


def factored(u, param: torch.Tensor) -> bool:
    """Whether ``u``'s piece of ``param`` is ``Lᵀ R`` (its rule gives factors for it)."""
    return param.dim() == 2 and rule_of(u).has_factors(u, param)


def ghost_eligible(uses: Sequence, param: torch.Tensor) -> bool:
    """Every use of ``param`` is a weight read as ``Lᵀ R`` (the ghost identities apply)."""
    return bool(uses) and all(factored(u, param) for u in uses)


def _index_use(u, param: torch.Tensor) -> bool:
    """Whether ``u``'s factors of ``param`` are token ids (an embedding use)."""
    return rule_of(u).factors_only and rule_of(u).has_factors(u, param)


def sparse_only(uses: Sequence, param: torch.Tensor) -> bool:
    """``param`` has a use whose rule reads it only by factors (an embedding: no ``[c, V, d]`` pieces)."""
    return any(_index_use(u, param) for u in uses)


def route_costs(
    uses: Sequence, param: torch.Tensor, rows: int, m: int, gram: bool, diag: bool = False, total: bool = True
) -> tuple[float, float]:
    """Cost of the (direct, ghost) routes for one parameter: multiply-adds plus a cost per element the
    route moves through memory beyond the activations.

    The direct route forms every part's pieces a block of the weight's rows at a time (see
    :func:`direct_param`): each piece is written once and read while in cache (``BLOCK_MOVE_COST`` per
    element), and no piece is formed twice, whatever the Gram or the memory budget.

    Args:
        uses: the parameter's captured uses (all eligible).
        param: the weight, ``[d_L, d_R]``.
        rows: rows that belong to some part.
        m: number of parts.
        gram: whether the Gram is wanted (``readings="all"``).
        diag: whether each part's squared norm alone is wanted (``readings="shares"``).
        total: whether ``Σ_S g_S`` is formed (the conservation check against ``g_full``); without it the
            ghost route's dots are its only products.
    """
    dL, dR = param.shape
    P = dL * dR
    live = [u for u in uses if _grad_held(u)]
    dense = [_positions(u) for u in live if not _index_use(u, param)]
    index = [_positions(u) for u in live if _index_use(u, param)]
    prod = float(sum(rows * n * P for n in dense))  # the per-row products of the dense uses
    scatter = float(sum(rows * n * dR for n in index))  # a token-id use: one d_R-row per token
    reads = 2.0 * m * P + (float(m) * m * P if gram else 0.0) + (float(m) * P if diag else 0.0)
    direct = prod + scatter + reads
    written = float(len(dense)) * rows * P + (m * P if rows != m or index or not dense else 0.0)
    direct += BLOCK_MOVE_COST * (written + 2.0 * m * P + (m * P if gram or diag else 0.0))
    pairs = 0.0
    ns = dense + index
    width = [dL + dR + 1] * len(dense) + [dR + 1] * len(index)  # a token-id left Gram is an equality test
    if gram or (diag and rows != m):  # several rows to a part: every row pair is formed, then summed per part
        pairs = float(sum(rows * rows * a * b * min(wa, wb) for a, wa in zip(ns, width) for b, wb in zip(ns, width)))
    elif diag:  # one row to a part: the pairs of a row with itself
        pairs = float(sum(rows * a * b * min(wa, wb) for a, wa in zip(ns, width) for b, wb in zip(ns, width)))
    # the dots (one product per dense use, a gather per token-id use) and Σ_S g_S (the same again)
    ghost = (prod + scatter) + pairs
    if total:
        ghost += prod + scatter + MOVE_COST * 2.0 * P  # Σ_S g_S formed, written and read once
    return direct, ghost


def choose_route(
    uses: Sequence,
    param: torch.Tensor,
    rows: int,
    m: int,
    gram: bool,
    route: str,
    diag: bool = False,
    total: bool = True,
) -> str:
    """``"direct"`` or ``"ghost"`` for this parameter (``route`` forces one where the ghost identities apply;
    a parameter whose every use is an embedding's is read by the ghost route, a gather per token, unless every
    part's dense piece of it together is small: a position embedding's ``m × [T, d]`` pieces cost less than the
    token-equality Gram of its ``m·T`` positions)."""
    if not ghost_eligible(uses, param):
        return "direct"
    if all(_index_use(u, param) for u in uses):
        return "direct" if m * param.numel() <= SMALL_PIECES and route != "ghost" else "ghost"
    if route in ("direct", "ghost"):
        return route
    direct, ghost = route_costs(uses, param, rows, m, gram, diag, total)
    return "ghost" if ghost < direct else "direct"


def use_factors(u, param: torch.Tensor, sel: torch.Tensor, B: int, runs: bool = False) -> Optional[Factors]:
    """One use's factors on the selected rows (the piece is ``Lᵀ R``). With ``runs``, a use whose parts are
    runs of the batch's positions (packed rollouts of unequal lengths) gives them in place, flat, with
    :attr:`Factors.runs` (see :func:`_run_factors`)."""
    if runs and getattr(u, "runs", None) is not None:
        f = _run_factors(u.raw, u.runs, param, sel)
        if f is not None or not _grad_held(u):
            return f
    if u.b is None:
        return None
    return rule_of(u).factors(u, param, sel, B)


def _run_factors(raw, runs: Sequence[tuple[int, int]], param: torch.Tensor, sel: torch.Tensor) -> Optional[Factors]:
    """``raw``'s factors on every row of the batch, flattened to ``[B·T, ...]`` positions, with the runs of
    the parts ``sel``; None when its positions are not the batch's ``B·T`` (the regrouped copy reads it)."""
    if raw.b is None or raw.a is None:
        return None
    B = int(raw.a.shape[0])
    f = rule_of(raw).factors(raw, param, torch.arange(B, device=raw.a.device), B)  # [B, n, ...]
    N = B * int(raw.a.shape[1])  # the positions the runs count in
    if f is None or f.R.shape[0] * f.R.shape[1] != N:
        return None
    L = f.L.reshape(N) if f.index else f.L.reshape(N, f.L.shape[-1])
    return Factors(L, f.R.reshape(N, f.R.shape[-1]), f.index, tuple(runs[k] for k in sel.tolist()))


def _live(sides: Sequence[torch.Tensor], rows: Optional[torch.Tensor], p: int, q: int) -> torch.Tensor:
    """``[u, q-p]``: whether positions ``p:q`` of ``rows`` (every row with None) are nonzero on every side.
    amax and amin apart: no temporary of the slice's size, and on a CPU each is ~9× faster than aminmax."""
    live = None
    for t in sides:
        x = t[:, p:q] if rows is None else t[rows, p:q]  # [u, q-p, d]
        y = x.amax(-1).ne(0) | x.amin(-1).ne(0)  # a NaN is live
        live = y if live is None else live & y
    return live


def _dead_run(
    sides: Sequence[torch.Tensor], r: int, n: int, from_end: bool, runs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``[r]``: how many positions at the start (``from_end``: at the end) of each row are dead, read inward
    in chunks of 1, 2, 4, … positions and only for the rows not yet past their dead run, so a row is read
    at most to twice its run and a live end costs one position. With ``runs`` (``[r, 2]``: each row's first
    position and length in the flat ``sides``, ``n`` the longest), row ``k`` is its own run."""
    dev = sides[0].device
    run = torch.full((r,), n, dtype=torch.long, device=dev) if runs is None else runs[:, 1].clone()  # [r]
    every = torch.arange(r, device=dev)  # [r]
    todo: Optional[torch.Tensor] = None  # every row
    done, c = 0, 1
    while done < n:
        k = min(n, done + c)
        idx = every if todo is None else todo
        if runs is None:
            p, q = (n - k, n - done) if from_end else (done, k)
            live = _live(sides, todo, p, q)  # [u, q-p]
            if from_end:
                live = live.flip(1)
        else:
            live = _live_runs(sides, runs[idx], done, k, from_end)  # [u, k-done]
        hit = live.any(1)  # [u]
        run[idx[hit]] = done + live[hit].int().argmax(1)  # the first live position, counted inward
        todo = idx[~hit]
        if runs is not None:
            todo = todo[runs[todo, 1] > k]  # a run no longer than this is dead throughout: its length
        if todo.numel() == 0:
            break
        done, c = k, 2 * c
    return run


def _live_runs(sides: Sequence[torch.Tensor], runs: torch.Tensor, p: int, q: int, from_end: bool) -> torch.Tensor:
    """``[u, q-p]``: whether the ``p``-th to ``q``-th positions counted inward from each run's start (its end
    with ``from_end``) are nonzero on every side, False past the run's length (``runs`` ``[u, 2]``)."""
    j = torch.arange(p, q, device=runs.device)  # [q-p]
    first, length = runs[:, :1], runs[:, 1:]  # [u, 1]
    inside = j < length  # [u, q-p]
    at = first + (length - 1 - j if from_end else j).clamp(min=0)  # [u, q-p] flat positions
    at = torch.where(inside, at, first)  # past the run: any position of it, masked below
    live = inside
    for t in sides:
        x = t[at]  # [u, q-p, d]
        live = live & (x.amax(-1).ne(0) | x.amin(-1).ne(0))  # a NaN is live
    return live


def _spans(f: Factors) -> Optional[torch.Tensor]:
    """``[r, 2]``: each row's first and past-last position whose term ``L_t ⊗ R_t`` may be nonzero (first
    ≥ past-last for a row with none), or None when every row's first and last positions are live.

    A policy's loss leaves the prompt's and the padding's positions without an output gradient at the LM
    head (and every layer's last position, whose next token is not scored): their terms are exact zeros,
    and cutting them off the ends of a row drops that share of the products (at the head an eighth at
    T = 128 with an eighth of each row prompt; half with prompts as long as the answers) and nothing else.
    A NaN or an infinity counts as live. Only the dead ends are read (:func:`_dead_run`), not the factors.
    With :attr:`Factors.runs`, positions count from each run's first."""
    sides = [f.R] if f.index else [f.L, f.R]
    if f.runs is not None:
        runs = torch.tensor(f.runs, dtype=torch.long, device=f.R.device).reshape(-1, 2)  # [r, 2]
        r, n = runs.shape[0], int(runs[:, 1].max()) if len(f.runs) else 0
        ends = runs[:, 1]
    else:
        runs, (r, n) = None, (f.R.shape[0], f.R.shape[1])
        ends = torch.full((r,), n, dtype=torch.long, device=f.R.device)
    if r == 0 or n == 0:
        return None
    head = _dead_run(sides, r, n, from_end=False, runs=runs)  # [r]
    tail = _dead_run(sides, r, n, from_end=True, runs=runs)  # [r]
    if not bool((head > 0).any() or (tail > 0).any()):
        return None
    return torch.stack([head, ends - tail], 1)  # a row with none live: head = its length, its end - tail = 0


def _cut(f: Factors) -> tuple[Factors, Optional[list]]:
    """``f`` on the positions between the first and the last live one of any row (views, no copy), and each
    row's own ``(first, past-last)`` within that span (None when nothing was cut). See :func:`_spans`.
    Factors with :attr:`Factors.runs` are returned whole, the spans counted within each run."""
    sp = _spans(f)
    if sp is None:
        return f, None
    if f.runs is not None:
        return f, [(x, max(x, y)) for x, y in sp.tolist()]
    a = int(sp[:, 0].min())
    b = max(a, int(sp[:, 1].max()))
    rows = [(x - a, max(0, y - a)) for x, y in sp.tolist()]  # a row with none: first ≥ past-last
    return Factors(f.L[:, a:b], f.R[:, a:b], f.index), rows


def widened(f: Factors) -> Factors:
    """``f`` in one dtype, float32 at least. Under autocast the factors are half precision (or one is and
    the other not): the ghost identities' products and dots are then taken in float32, against a g_full
    that is not rounded to half precision first (the direct route forms its pieces in the factors' dtype
    and sums them in float32)."""
    dt = sum_dtype(f.R.dtype if f.index else torch.promote_types(f.L.dtype, f.R.dtype))
    if f.R.dtype == dt and (f.index or f.L.dtype == dt):
        return f
    return Factors(f.L if f.index else f.L.to(dt), f.R.to(dt), f.index)


def row_dot(f: Factors, W: torch.Tensor) -> torch.Tensor:
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
    buf = torch.empty(narrow.shape[0] * min(step, wide), dtype=narrow.dtype, device=W.device)  # mm takes one dtype
    for s in range(0, wide, step):
        e = min(wide, s + step)
        # into one buffer: a fresh block of this size per product costs its page faults again each time
        X = torch.mm(narrow, Wt[:, s:e], out=buf[: narrow.shape[0] * (e - s)].view(-1, e - s))  # [r·n, e-s]
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


_COLS = 1 << 10


def _col_blocks(P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[m, N]`` block as ``[nb, m, 2¹⁰]`` column blocks (a view of the contiguous block) and its ``[m, N mod 2¹⁰]`` tail."""
    m, N = P.shape
    nb = N // _COLS
    P = P.contiguous()
    return P[:, : nb * _COLS].view(m, nb, _COLS).transpose(0, 1), P[:, nb * _COLS :]


_DOT_COLS = 1 << 8


def _fine_dots(P: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``P w`` of a contiguous ``[m, N]`` block, float64 ``[m]``: float32 products over ``2⁸`` columns at a
    time summed in float64, as one batched product ``w_b P_bᵀ`` over the column blocks ``b`` (``[1, 2⁸]`` by
    ``[2⁸, m]``: the layout a batched product reads at the rate of a matrix-vector product; a block's rows
    as the left side took up to 3 times as long at m = 8)."""
    m, N = P.shape
    nb, end = N // _DOT_COLS, N - N % _DOT_COLS
    w = w.contiguous()
    if not nb:  # under one block (no columns: zeros)
        return (P @ w).double()
    body = P[:, :end].view(m, nb, _DOT_COLS).permute(1, 2, 0)  # [nb, cols, m]
    dots = torch.bmm(w[:end].view(nb, 1, _DOT_COLS), body)[:, 0, :].double().sum(0)  # [m]
    return dots if end == N else dots + (P[:, end:] @ w[end:]).double()


def fine_products(
    P: torch.Tensor, w: torch.Tensor, gram: bool, diag: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``P w`` (``[m]``) and ``P Pᵀ`` (``[m, m]``, or its diagonal with ``diag``; None with neither) of a
    ``[m, N]`` block, float64: float32 products over ``2⁸`` columns (the Gram and norms: ``2¹⁰``) at a
    time, summed in float64.

    Matrix products and norms read the block without writing a temporary of its size; a float32 product
    over the whole block would drift by ~1e-7 (a head's rows nearly cancel against ``g_full``: ``p − e_y``).
    """
    if P.dtype == torch.float64:
        G = P @ P.T if gram or diag else None
        return P @ w.reshape(-1), (G.diagonal().clone() if diag and G is not None else G)
    P = P.contiguous()
    dots = _fine_dots(P, w.reshape(-1).to(P.dtype))  # [m]
    if not gram and not diag:
        return dots, None
    if P.shape[1] <= _COLS:  # one block of columns: a single product
        return dots, P.double().pow(2).sum(1) if diag else (P @ P.T).double()
    body, tail = _col_blocks(P)  # [nb, m, cols], [m, tail]
    if diag:  # each row's norm per column block (a reduction: no temporary of the block's size)
        sq = torch.linalg.vector_norm(body, dim=2).double().pow(2).sum(0)  # [m]
        return dots, sq if tail.shape[1] == 0 else sq + tail.double().pow(2).sum(1)
    G = torch.bmm(body, body.transpose(1, 2)).double().sum(0)  # [m, m]
    return dots, G if tail.shape[1] == 0 else G + (tail @ tail.T).double()


def _sorted_tokens(
    f: Factors, dst: torch.Tensor, starts: list, dL: int, dtype: torch.dtype, m: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """A token-id use's tokens sorted by id (with ``m``: by part, then id), for adding a block of weight
    rows at a time: ``(ids [r·n], values [r·n, d_R] in dtype, parts [r·n], edges)``, where ``edges[j]`` is
    the first token of block ``j`` (with ``m``: of part ``i``'s block ``j`` at ``i·len(starts) + j``)."""
    if f.runs is None:
        ids, vals = f.L.reshape(-1), f.R.reshape(-1, f.R.shape[-1])  # [r·n], [r·n, d_R]
        part = dst.repeat_interleave(f.L.shape[1])  # [r·n]
    else:  # the runs' positions only
        at = torch.cat([torch.arange(a, a + n, device=f.L.device) for a, n in f.runs])  # [Σ n]
        ids, vals = f.L[at], f.R[at]
        part = dst.repeat_interleave(torch.tensor([n for _, n in f.runs], device=dst.device))  # [Σ n]
    if m is None and len(starts) == 1:  # one block of rows: every token is in it, no order needed
        return ids, vals.to(dtype), part, [0, int(ids.numel())]
    key = ids if m is None else part * dL + ids
    order = torch.argsort(key, stable=True)
    bounds = starts + [dL] if m is None else [i * dL + s for i in range(m) for s in starts] + [m * dL]
    edges = torch.searchsorted(key[order], torch.tensor(bounds, device=ids.device)).tolist()
    return ids[order], vals[order].to(dtype), part[order], edges


def direct_param(
    uses: Sequence,
    g_full: torch.Tensor,
    sel: torch.Tensor,
    dst: torch.Tensor,
    m: int,
    B: int,
    dots: torch.Tensor,
    gram: Optional[torch.Tensor],
    budget: int,
    sq: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    param: Optional[torch.Tensor] = None,
    keep_total: bool = True,
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """One ``Lᵀ R`` weight read by the direct route, a block of the weight's rows at a time.

    Every part's piece of rows ``lo:hi`` (``[m, hi-lo, d_R]``: a batched product per dense use, an
    ``index_add`` of the tokens in ``lo:hi`` per token-id use) is formed, reduced (dots, norms or Gram,
    its share of ``Σ_S g_S − g_full``) while it is small enough to stay in cache, and overwritten by the
    next block's, in the same buffer: no ``[m, d_L, d_R]`` buffer, and no piece built twice for the
    Gram, whatever ``m``. Same arguments and return as :func:`ghost_param` (``m``: the number of parts).
    """
    param = uses[0].weight if param is None else param
    by_part = gram is None and _by_part(g_full.device, param.numel())
    facs = [f for f in (use_factors(u, param, sel, B, runs=by_part) for u in uses) if f is not None]
    r = int(sel.numel())
    if r == 0 or not facs:
        return (torch.zeros_like(g_full) if keep_total else None), sq64(g_full)
    W = g_full if target is None else target
    # positions without a term (a head's prompt) are not multiplied, where that saves more than it costs
    products = r * max(_row_positions(f) for f in facs) * param.numel()
    cut = [_cut(f) if products >= _CUT_MIN else (f, None) for f in facs]
    facs = [f for f, _ in cut]
    if by_part:
        return _direct_by_part(facs, g_full, W, dst, m, dots, sq, keep_total, [rows for _, rows in cut])
    dL, dR = param.shape
    dtype = facs[0].R.dtype
    in_order = r == m and bool((dst == torch.arange(m, device=dst.device)).all())
    dense = [f for f in facs if not f.index]
    # A few MB (in cache) while the right factors are small; when they are large (long rows) a block
    # grows to 4× their size, so that reading them once per block costs at most a quarter of the pieces'
    # own elements; at most the weight's own size (a vocabulary's [m, V, d] never exists), at least 128
    # weight rows (thinner products lose their rate), and never more than the memory budget.
    right = max((f.R.numel() for f in dense), default=0)
    cap = max(_PIECE_BLOCK, min(4 * right, dL * dR))
    cap = min(cap, max(dL * dR, _SMALL_BLOCK))
    vb = min(max(_MIN_ROWS, cap // max(1, m * dR)), max(1, budget // max(1, m * dR)))  # weight rows per block
    starts = list(range(0, dL, vb))
    # per token-id use: ids sorted, their values and parts, and where each block's ids begin
    tokens = [_sorted_tokens(f, dst, starts, dL, dtype) for f in facs if f.index]
    total = (
        torch.empty(g_full.shape, dtype=torch.promote_types(sum_dtype(dtype), g_full.dtype), device=g_full.device)
        if keep_total
        else None
    )
    diff = torch.zeros((), dtype=torch.float64, device=g_full.device)
    # Every block's piece (and product) is written into one buffer made once: a fresh block of several MB
    # per product is a fresh mapping on a CPU, and its page faults cost as much as the product itself.
    pdt = dense[0].L.dtype if dense else dtype
    buf = torch.empty(m * min(vb, dL) * dR, dtype=pdt, device=g_full.device)
    tmp = None if in_order or not dense else torch.empty(r * min(vb, dL) * dR, dtype=pdt, device=g_full.device)
    for j, lo in enumerate(starts):
        hi = min(dL, lo + vb)
        P = buf[: m * (hi - lo) * dR].view(m, hi - lo, dR)  # [m, hi-lo, d_R]
        if not in_order or not dense:
            P.zero_()
        for k, f in enumerate(dense):
            lt, rt = f.L[:, :, lo:hi].transpose(1, 2), f.R.to(f.L.dtype)  # [r, hi-lo, n], [r, n, d_R]
            if in_order and f.L.dtype == pdt:
                if k == 0:
                    torch.bmm(lt, rt, out=P)
                else:
                    P.baddbmm_(lt, rt)
            elif in_order:
                P.add_(torch.bmm(lt, rt))
            else:
                out = tmp[: r * (hi - lo) * dR].view(r, hi - lo, dR) if f.L.dtype == pdt else None
                prod = torch.bmm(lt, rt, out=out)  # [r, hi-lo, d_R]
                P.index_add_(0, dst, prod)
        for ids_s, vals, part, edges in tokens:
            a, b = edges[j], edges[j + 1]
            if b > a:  # the tokens of this block, each into its part's row of the piece
                P.view(-1, dR).index_add_(0, part[a:b] * (hi - lo) + (ids_s[a:b] - lo), vals[a:b].to(P.dtype))
        P2 = P.view(m, -1)  # [m, (hi-lo)·d_R]
        d, G = fine_products(P2, W[lo:hi], gram is not None, gram is None and sq is not None)
        dots += d
        if gram is not None:
            gram += G
        elif sq is not None:
            sq += G
        s = row_sum(P2)  # [(hi-lo)·d_R]
        diff += diff_sq64(s, g_full[lo:hi])
        if total is not None:
            total[lo:hi] = s.view(hi - lo, dR)
    return total, diff  # kept in float32 at least: the conservation error above is this vector's


# Elements of one part's piece of a block on a CPU (1 MB in float32: it stays in the core's own cache
# while it is reduced).
_PART_BLOCK = 1 << 18
# A weight of at most this many elements is read with every part's piece at once even on a CPU: a part's
# piece then costs less work than the dozen kernels that read it on its own.
_PART_MIN = 1 << 16


def _row_lengths(f: Factors) -> list[int]:
    """Positions of each of ``f``'s rows."""
    return [n for _, n in f.runs] if f.runs is not None else [int(f.R.shape[1])] * int(f.R.shape[0])


def _row_positions(f: Factors) -> int:
    """Positions of ``f``'s longest row."""
    return max(_row_lengths(f), default=0)


def _by_part(device: torch.device, numel: int) -> bool:
    """Whether the direct route reads one part's piece of a block at a time (:func:`_direct_by_part`) for a
    weight of ``numel`` elements: on a CPU, where a core's own cache holds one part's piece but not every
    part's, once the piece is large enough to pay for its kernels (over 2¹⁶ elements; a toy Llama's
    ``[344, 128]`` MLP weights at m = 64 took 1.36× as long read one part at a time); on a GPU one batched
    product per block is cheaper than a kernel launch per part."""
    return device.type == "cpu" and numel > _PART_MIN


def read_piece(
    P: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    tmp: torch.Tensor,
    dots: torch.Tensor,
    sq: Optional[torch.Tensor],
    first: bool,
) -> None:
    """One part's piece of a block (``P``, ``[rows, d_R]``) read for every reading: its dot with ``w`` per
    weight row into ``dots`` and its norm per weight row into ``sq`` (``[rows]``, in their dtype; None: not
    wanted), and its addition into ``s`` (``Σ_S g_S`` of the block; copied into it when ``first``). ``tmp``
    (``P``'s shape, ``dots``' dtype) holds the products with ``w``."""
    torch.sum(torch.mul(P, w, out=tmp), 1, dtype=dots.dtype, out=dots)
    if sq is not None:
        torch.linalg.vector_norm(P, dim=1, dtype=sq.dtype, out=sq)
    if first:
        s.copy_(P)
    else:
        s.add_(P)


def _direct_by_part(
    facs: Sequence[Factors],
    g_full: torch.Tensor,
    W: torch.Tensor,
    dst: torch.Tensor,
    m: int,
    dots: torch.Tensor,
    sq: Optional[torch.Tensor],
    keep_total: bool,
    spans: Optional[Sequence[Optional[list]]] = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """:func:`direct_param` without the Gram, on a CPU: a block of the weight's rows at a time, and within
    it one part at a time.

    A part's piece of the block (``[hi-lo, d_R]``, about 1 MB) is formed (a product per row of the part
    and dense use, an ``index_add`` of its tokens per token-id use), dotted with ``W``, its squared norm
    taken and added into the block of ``Σ_S g_S`` while it is still in the core's cache; the next part's
    piece overwrites it. The batched product of every part's block at once (the GPU path) writes a block
    of several MB that is read back three times from beyond the core's cache: in the separate pass on a
    llama shape at m = 32, T = 128 the direct route takes 0.91× the time (``benchmarks/direct_route_ab.py``).

    Dots and squares are summed per weight row in float32 at least (``d_R`` terms; a half-precision piece
    is multiplied with ``W`` itself, not with ``W`` rounded to its dtype), the rows' sums in float64.
    ``spans`` (per use: each row's ``(first, past-last)`` live position, from :func:`_cut`, or None) keeps a
    row's products to its live positions.
    """
    dL, dR = g_full.shape
    dense = [f for f in facs if not f.index]
    pdt = dense[0].L.dtype if dense else facs[0].R.dtype  # the products' dtype (the factors', as the bmm path)
    sdt = sum_dtype(pdt)
    dev = g_full.device
    vb = max(1, min(dL, _PART_BLOCK // max(1, dR)))  # weight rows per block
    starts = list(range(0, dL, vb))
    right = [f.R.to(pdt) for f in dense]  # converted once, not once per block and part
    spans = [None] * len(facs) if spans is None else spans
    # per dense use and row: its (first, past-last) live positions, and where its positions begin in L and R
    live = [sp or [(0, n) for n in _row_lengths(f)] for f, sp in zip(facs, spans) if not f.index]
    begins = [None if f.runs is None else [a for a, _ in f.runs] for f in dense]
    rows_of_part = [[] for _ in range(m)]  # the selected rows of each part, in order
    for k, i in enumerate(dst.tolist()):
        rows_of_part[i].append(k)
    # per token-id use: tokens sorted by (part, id), their values, and where each (part, block)'s begin
    tokens = [_sorted_tokens(f, dst, starts, dL, pdt, m) for f in facs if f.index]
    total = torch.empty(g_full.shape, dtype=torch.promote_types(sdt, g_full.dtype), device=dev) if keep_total else None
    s_buf = (
        None if keep_total else torch.empty(min(vb, dL), dR, dtype=torch.promote_types(sdt, g_full.dtype), device=dev)
    )
    diff = torch.zeros((), dtype=torch.float64, device=dev)
    buf = torch.empty(min(vb, dL) * dR, dtype=pdt, device=dev)  # one part's piece of a block, reused
    tmp = torch.empty(min(vb, dL) * dR, dtype=sdt, device=dev)  # its products with W
    row_dots = torch.zeros(m, min(vb, dL), dtype=sdt, device=dev)  # [m, vb] per weight row, float64 per block
    row_sq = torch.zeros(m, min(vb, dL), dtype=sdt, device=dev) if sq is not None else None
    for j, lo in enumerate(starts):
        hi = min(dL, lo + vb)
        w = W[lo:hi].to(sdt)  # [hi-lo, d_R]
        s = total[lo:hi] if total is not None else s_buf[: hi - lo]  # [hi-lo, d_R]
        first = True
        for i in range(m):
            P = buf[: (hi - lo) * dR].view(hi - lo, dR)  # [hi-lo, d_R]
            wrote = False
            for f, R, sp, at in zip(dense, right, live, begins):
                for k in rows_of_part[i]:
                    a, b = sp[k]
                    if b <= a:  # no live position in this row
                        continue
                    if at is None:
                        lt, rt = f.L[k, a:b, lo:hi].T.to(pdt), R[k, a:b]  # [hi-lo, b-a], [b-a, d_R]
                    else:  # the row's run of the flat positions
                        lt, rt = f.L[at[k] + a : at[k] + b, lo:hi].T.to(pdt), R[at[k] + a : at[k] + b]
                    if wrote:
                        P.addmm_(lt, rt)
                    else:
                        torch.mm(lt, rt, out=P)
                        wrote = True
            for ids_s, vals, _, edges in tokens:
                a, b = edges[i * len(starts) + j], edges[i * len(starts) + j + 1]
                if b > a:  # this part's tokens of this block
                    if not wrote:
                        P.zero_()
                        wrote = True
                    P.index_add_(0, ids_s[a:b] - lo, vals[a:b])
            if not wrote:  # the part has nothing in this block: its dots and norms stay zero
                row_dots[i, : hi - lo].zero_()
                if row_sq is not None:
                    row_sq[i, : hi - lo].zero_()
                continue
            read_piece(
                P,
                w,
                s,
                tmp[: (hi - lo) * dR].view(hi - lo, dR),
                row_dots[i, : hi - lo],
                None if row_sq is None else row_sq[i, : hi - lo],
                first,
            )
            first = False
        if first:  # no part has anything in this block
            s.zero_()
        dots += row_dots[:, : hi - lo].double().sum(1)
        if sq is not None:
            sq += row_sq[:, : hi - lo].double().pow(2).sum(1)
        diff += diff_sq64(s, g_full[lo:hi], tmp)
    return total, diff


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
    total: bool = True,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
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
        total: form ``Σ_S g_S`` at all; False (the dots are checked against ``g_full`` along ``target`` by
            the caller): ``(None, None)`` is returned and the dots are the only products.

    Returns:
        ``(Σ_S g_S, ‖Σ_S g_S − g_full‖²)``: the parts' sum assembled from the captured factors (float64 0-d
        tensor for the second, read back later with the others).
    """
    param = uses[0].weight if param is None else param
    facs = [widened(f) for f in (use_factors(u, param, sel, B) for u in uses) if f is not None]
    r = int(sel.numel())
    if r == 0 or not facs:
        return (torch.zeros_like(g_full) if keep_total else None), sq64(g_full)
    per_row = torch.zeros(r, dtype=torch.float64, device=g_full.device)  # [r]
    W = (g_full if target is None else target).to(facs[0].R.dtype)
    for f in facs:
        per_row += row_dot(f, W)
    dots.index_add_(0, dst, per_row)

    def summed() -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if not total:
            return None, None
        s = _total(facs, g_full)
        if keep_total:
            return s, diff_sq64(s, g_full)
        return None, sq64(s.sub_(g_full.to(s.dtype)))  # the difference in the sum's own buffer

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
