"""The rank-1 fit on a window Gram, the OLS coefficient line, de-staling and the random-walk null.

Everything here works on ``W × W`` matrices and tick lists; no parameter-sized vector is touched.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["Rank1Fit", "fit_rank1", "ols", "destale", "evr1_null_quantile", "evr1_null_limit"]


@dataclass(frozen=True)
class Rank1Fit:
    r"""Leading direction of a snapshot window and the line through its coefficients.

    Attributes:
        ticks: ``W`` real tick indices, the base's first.
        delta_ids: ring ids of the ``W − 1`` consecutive deltas the window spans.
        sigma1: ``sqrt(max(λ1, 0))`` of the base-delta Gram ``B`` (``[W−1, W−1]``).
        u1: leading unit eigenvector of ``B`` (length ``W − 1``), sign pinned so that ``a ≥ 0``.
        c: ``W`` coefficients ``c_i = <Δ_i, v1> = σ1·u1[i]``, with ``c_0 = 0`` for the base.
        evr1: ``λ1 / trace(B)``.
        a, b, r2: the OLS line ``c ≈ a·t + b`` on the real ticks and its ``R²``.
    """

    ticks: tuple[int, ...]
    delta_ids: tuple[int, ...]
    sigma1: float
    u1: tuple[float, ...]
    c: tuple[float, ...]
    evr1: float
    trace: float
    a: float
    b: float
    r2: float

    @property
    def W(self) -> int:
        return len(self.ticks)

    def predict(self, t: float) -> float:
        """``ĉ(t) = a·t + b``."""
        return self.a * t + self.b

    def beta(self) -> dict[int, float]:
        r"""``v1`` in consecutive-delta coordinates: ``v1 = Σ_k β_k d_k``, ``β_k = (1/σ1)·Σ_{i≥k} u1[i]``."""
        if self.sigma1 <= 0.0:
            return {k: 0.0 for k in self.delta_ids}
        u = np.asarray(self.u1, dtype=np.float64)
        rc = np.cumsum(u[::-1])[::-1] / self.sigma1
        return {k: float(v) for k, v in zip(self.delta_ids, rc)}

    def gammas(self, c_hat: float) -> tuple[float, ...]:
        r"""Weights of ``θ̂ = θ_base + Σ_i γ_i Δ_i``: ``γ_i = (ĉ/σ1)·u1[i]``."""
        if self.sigma1 <= 0.0:
            return tuple(0.0 for _ in self.u1)
        return tuple(c_hat / self.sigma1 * u for u in self.u1)


def ols(t: Sequence[float], c: Sequence[float]) -> tuple[float, float, float]:
    r"""Least-squares line on real (possibly irregular) ticks.

    ``a = Σ(t_i − t̄)(c_i − c̄) / Σ(t_i − t̄)²``, ``b = c̄ − a·t̄``, ``R² = 1 − SS_res/SS_tot``
    (``R² = nan`` when every ``c_i`` is equal).

    Example:
        >>> ols([0, 10, 30], [1.0, 2.0, 4.0])
        (0.1, 1.0, 1.0)
    """
    tt = np.asarray(t, dtype=np.float64)
    cc = np.asarray(c, dtype=np.float64)
    if tt.size < 2:
        raise ValueError(f"`t` must hold at least 2 ticks for a line, got {tt.size}.")
    tm, cm = tt.mean(), cc.mean()
    sxx = float(np.sum((tt - tm) ** 2))
    if sxx == 0.0:
        raise ValueError(f"`t` must hold at least 2 distinct ticks, got {list(t)!r}.")
    a = float(np.sum((tt - tm) * (cc - cm)) / sxx)
    b = float(cm - a * tm)
    ss_tot = float(np.sum((cc - cm) ** 2))
    ss_res = float(np.sum((cc - (a * tt + b)) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0.0 else float("nan")
    return a, b, r2


def fit_rank1(B: torch.Tensor, ticks: Sequence[int], delta_ids: Optional[Sequence[int]] = None) -> Optional[Rank1Fit]:
    r"""Rank-1 fit of a window from its base-delta Gram alone.

    ``λ, U = eigh(sym(B))`` (descending), ``σ1 = sqrt(max(λ1, 0))``, ``c = σ1·u1``, ``EVR1 = λ1/trace(B)``.
    The eigenvector's sign is pinned so that the OLS slope of ``c`` on the ticks is ``≥ 0`` (the coefficient
    grows with time); on a zero slope the largest entry of ``u1`` is made positive. Returns ``None`` when
    the window has no extent (``trace(B) = 0``).

    Example:
        >>> B = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)   # Δ_2 = 2·Δ_1
        >>> f = fit_rank1(B, [0, 1, 2])
        >>> round(f.evr1, 12), [round(x, 12) for x in f.c], round(f.r2, 12)
        (1.0, [0.0, 1.0, 2.0], 1.0)
    """
    n = B.shape[0]
    if len(ticks) != n + 1:
        raise ValueError(
            f"`ticks` must hold W = {n + 1} ticks (base included) for a [{n}, {n}] Gram, got {len(ticks)}."
        )
    ids = tuple(range(n)) if delta_ids is None else tuple(int(i) for i in delta_ids)
    if n == 0:
        return None
    G = B.detach().to(torch.float64).cpu()
    G = 0.5 * (G + G.T)  # [n, n]
    trace = float(torch.diagonal(G).sum())
    if not math.isfinite(trace) or trace <= 0.0:
        return None
    lam, U = torch.linalg.eigh(G)  # ascending
    lam1 = float(lam[-1])
    u1 = U[:, -1].clone()  # [n]
    sigma1 = math.sqrt(max(lam1, 0.0))
    t = [float(x) for x in ticks]
    c = [0.0] + (sigma1 * u1).tolist()
    a, b, r2 = ols(t, c)
    flip = a < 0.0 or (a == 0.0 and float(u1[int(torch.argmax(u1.abs()))]) < 0.0)
    if flip:
        u1 = -u1
        c = [0.0] + (sigma1 * u1).tolist()
        a, b, r2 = ols(t, c)
    c[0] = 0.0  # -0.0 after a flip reads oddly
    return Rank1Fit(
        ticks=tuple(int(x) for x in ticks),
        delta_ids=ids,
        sigma1=sigma1,
        u1=tuple(u1.tolist()),
        c=tuple(c),
        evr1=lam1 / trace,
        trace=trace,
        a=a,
        b=b,
        r2=r2,
    )


def destale(t_fast: int, t_W: int, h_safe: Optional[float]) -> tuple[float, float]:
    r"""De-stale distance and target tick: ``h_eff = min(t_fast − t_W, h_safe)``, ``t_tgt = t_W + h_eff``.

    ``t_tgt ≤ t_fast`` always: the anchor never leads the live weights. ``h_safe = None`` means no cap.

    Example:
        >>> destale(80, 60, 5), destale(80, 60, None)
        ((5, 65), (20, 80))
    """
    if t_fast < t_W:
        raise ValueError(f"`t_fast` must be ≥ the newest visible tick t_W = {t_W}, got {t_fast}.")
    h = t_fast - t_W
    if h_safe is not None:
        h = min(h, h_safe)
    h = max(h, 0)
    return h, t_W + h


def evr1_null_limit(ticks: Sequence[int]) -> float:
    r"""EVR1 of a pure random walk in the limit ``d → ∞`` for the ring's (uncentered) base-delta Gram.

    Isotropic steps give ``B/E[·] → K`` with ``K[i, j] = min(t_i, t_j) − t_0``, so the limit is
    ``λ1(K)/trace(K)``. For many equally spaced snapshots it tends to ``8/π² ≈ 0.81`` (the Brownian
    Karhunen–Loève spectrum ``1/((k − ½)²π²)``): higher than the centred-PCA ``6/π² ≈ 0.61``, because the
    Gram here is not centred. Either way a random walk clears ``EVR1 ≥ 0.6``.

    Example:
        >>> round(evr1_null_limit(range(0, 2001, 20)), 3), round(8 / math.pi ** 2, 3)
        (0.811, 0.811)
    """
    t = np.asarray(list(ticks), dtype=np.float64)
    s = t[1:] - t[0]
    K = np.minimum.outer(s, s)
    lam = np.linalg.eigvalsh(K)
    return float(lam[-1] / lam.sum())


@functools.lru_cache(maxsize=256)
def _null_quantile_cached(gaps: tuple[float, ...], d: int, q: float, n_samples: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    n = len(gaps)
    g = np.sqrt(np.asarray(gaps, dtype=np.float64))  # per-step std ∝ sqrt(gap)
    if d < 4 * n or d <= 64:
        # Direct: n isotropic Gaussian steps in R^d.
        X = rng.standard_normal((n_samples, n, d)) * g[None, :, None]  # [S, n, d]
        D = X @ np.swapaxes(X, 1, 2)  # [S, n, n]
    else:
        # Bartlett: X Xᵀ ~ Wishart(d, I) as A Aᵀ, A lower-triangular with chi(d − i) diagonal;
        # the cost is W × W whatever d is.
        A = np.tril(rng.standard_normal((n_samples, n, n)), -1)
        df = d - np.arange(n)
        A[:, np.arange(n), np.arange(n)] = np.sqrt(rng.chisquare(df, size=(n_samples, n)))
        AS = A * g[None, :, None]
        D = AS @ np.swapaxes(AS, 1, 2)  # [S, n, n]
    L = np.tril(np.ones((n, n)))
    B = L[None] @ D @ L.T[None]  # [S, n, n]
    lam = np.linalg.eigvalsh(B)  # [S, n]
    evr = lam[:, -1] / lam.sum(axis=1)
    return float(np.quantile(evr, q))


def evr1_null_quantile(ticks: Sequence[int], d: int, q: float = 0.95, n_samples: int = 2000, seed: int = 0) -> float:
    r"""The ``q``-quantile of EVR1 when the weights do a pure isotropic random walk in ``R^d``.

    Steps between snapshots are independent ``N(0, gap·I_d)``; the window's EVR1 is computed exactly
    as the ring computes it (uncentered base-delta Gram). Sampled with a seeded generator (cached), in
    ``O(W³)`` per sample for large ``d`` (Bartlett decomposition of the Wishart ``D``). A coherent drift
    must beat this, not a fixed 0.6: the null's median is ≈ 0.8 for ``W ≥ 4``.

    Example:
        >>> q = evr1_null_quantile([0, 20, 40, 60], d=10**6, q=0.5)
        >>> abs(q - evr1_null_limit([0, 20, 40, 60])) < 0.01
        True
    """
    t = [int(x) for x in ticks]
    if len(t) < 2:
        return float("nan")
    gaps = np.diff(np.asarray(t, dtype=np.float64))
    if np.any(gaps <= 0):
        raise ValueError(f"`ticks` must increase, got {t!r}.")
    gaps = tuple(float(x) for x in np.round(gaps / gaps.mean(), 12))
    if len(gaps) == 1:
        return 1.0  # one displacement: EVR1 is 1 whatever the walk
    return _null_quantile_cached(gaps, int(d), float(q), int(n_samples), int(seed))
