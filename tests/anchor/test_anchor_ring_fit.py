"""Ring, Gram and rank-1 fit against explicit numpy on stacked snapshots."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.anchor import (
    GrowingWeightTrajRing,
    destale,
    evr1_null_limit,
    evr1_null_quantile,
    fit_rank1,
    ols,
    prefix_gram,
    rebase_gram,
)


def _traj(W, shapes, seed, drift=1.0):
    g = torch.Generator().manual_seed(seed)
    v = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    snaps, x = [], {k: torch.randn(s, generator=g) for k, s in zip(v, shapes)}
    for _ in range(W):
        snaps.append({k: t.clone() for k, t in x.items()})
        x = {k: x[k] + drift * v[k] + 0.3 * torch.randn(x[k].shape, generator=g) for k in x}
    return snaps


def _flat(snap, names=None):
    names = sorted(snap) if names is None else names
    return np.concatenate([snap[n].double().reshape(-1).numpy() for n in names])


@settings(max_examples=12, deadline=None)
@given(W=st.integers(2, 9), n_t=st.integers(1, 3), d=st.integers(1, 40), seed=st.integers(0, 10_000))
def test_fit_matches_numpy_svd_of_stacked_deltas(W, n_t, d, seed):
    shapes = [(d,), (2, d), (3,)][:n_t]
    snaps = _traj(W, shapes, seed)
    ticks = [0]
    for _ in range(W - 1):
        ticks.append(ticks[-1] + 1 + (seed + len(ticks)) % 5)
    ring = GrowingWeightTrajRing(w_cap=W)
    for s, t in zip(snaps, ticks):
        ring.append(s, t)
    f = fit_rank1(ring.base_gram(), ticks, ring.delta_ids())
    names = ring.names
    # The ring stores fp32 differences; the reference stacks the same fp32 snapshots in float64.
    X = np.stack([_flat(s, names) - _flat(snaps[0], names) for s in snaps[1:]])  # [W-1, d]
    U, S, Vt = np.linalg.svd(X, full_matrices=False)
    assert f.sigma1 == pytest.approx(S[0], rel=1e-5)
    assert f.evr1 == pytest.approx(S[0] ** 2 / np.sum(S**2), rel=1e-5)
    np.testing.assert_allclose(np.abs(f.c[1:]), np.abs(U[:, 0] * S[0]), rtol=1e-4, atol=1e-5 * S[0])
    # The pinned sign makes the coefficient grow with time.
    assert f.a >= 0.0


def test_gram_is_float64_and_d_independent():
    snaps = _traj(5, [(1000,), (7,)], 0)
    ring = GrowingWeightTrajRing(w_cap=8)
    for t, s in enumerate(snaps):
        ring.append(s, t)
    assert all(D.dtype == torch.float64 and D.shape == (4, 4) for D in ring.D.values())
    assert all(d.dtype == torch.float32 for dd in ring.deltas for d in dd.values())


@settings(max_examples=10, deadline=None)
@given(n=st.integers(3, 9), seed=st.integers(0, 10_000))
def test_ols_equals_polyfit_on_irregular_ticks(n, seed):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.integers(1, 30, size=n)).astype(float)
    c = 0.3 * t + rng.normal(size=n)
    a, b, r2 = ols(t.tolist(), c.tolist())
    pa, pb = np.polyfit(t, c, 1)
    assert a == pytest.approx(pa, rel=1e-9, abs=1e-12)
    assert b == pytest.approx(pb, rel=1e-9, abs=1e-9)
    assert r2 == pytest.approx(np.corrcoef(t, c)[0, 1] ** 2, rel=1e-9)


def test_drop_oldest_rebased_gram_equals_recomputed_from_scratch():
    snaps = _traj(11, [(30,), (4, 5)], 3)
    ring = GrowingWeightTrajRing(w_cap=5)
    for t, s in enumerate(snaps):
        B_before = ring.base_gram() if ring.W >= 2 else None
        ring.append(s, 10 * t)
        if ring.over_cap:
            B_full = ring.base_gram()
            ring.drop_oldest_and_rebase()
            # bilinear re-base of the pre-drop Gram = prefix sum of the trimmed D
            torch.testing.assert_close(rebase_gram(B_full), ring.base_gram(), rtol=1e-12, atol=1e-12)
        del B_before
    kept = snaps[-5:]
    names = ring.names
    X = np.stack([_flat(s, names) - _flat(kept[0], names) for s in kept[1:]])
    np.testing.assert_allclose(ring.base_gram().numpy(), X @ X.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(_flat(ring.base, names), _flat(kept[0], names), rtol=0, atol=1e-5)
    assert ring.ticks == [60, 70, 80, 90, 100] and ring.W == 5


def test_gram_is_additive_over_shards():
    snaps = _traj(6, [(40,)], 5)
    whole, left, right = GrowingWeightTrajRing(8), GrowingWeightTrajRing(8), GrowingWeightTrajRing(8)
    for t, s in enumerate(snaps):
        whole.append(s, t)
        left.append({"t0": s["t0"][:17]}, t)
        right.append({"t0": s["t0"][17:]}, t)
    torch.testing.assert_close(left.base_gram() + right.base_gram(), whole.base_gram(), rtol=1e-6, atol=1e-9)
    # row_reduce sums a shard's new row with the other shard's: one ring then holds the whole Gram.
    summed = GrowingWeightTrajRing(8)
    other = GrowingWeightTrajRing(8)
    for t, s in enumerate(snaps):
        other.append({"t0": s["t0"][17:]}, t)
        row_other = other.D["t0"][-1].clone() if t > 0 else None
        summed.append({"t0": s["t0"][:17]}, t, row_reduce=(lambda r, o=row_other: r + o))
    torch.testing.assert_close(summed.base_gram(), whole.base_gram(), rtol=1e-6, atol=1e-9)


def test_prefix_gram_is_L_D_Lt():
    D = torch.randn(6, 6, dtype=torch.float64)
    D = D @ D.T
    L = torch.tril(torch.ones(6, 6, dtype=torch.float64))
    torch.testing.assert_close(prefix_gram(D), L @ D @ L.T)


@settings(max_examples=30, deadline=None)
@given(t_W=st.integers(0, 1000), lag=st.integers(0, 100), h_safe=st.one_of(st.none(), st.integers(0, 200)))
def test_target_tick_never_exceeds_the_present(t_W, lag, h_safe):
    h, t_tgt = destale(t_W + lag, t_W, h_safe)
    assert t_W <= t_tgt <= t_W + lag
    assert h == (lag if h_safe is None else min(lag, h_safe))


def test_random_walk_null_quantile_matches_direct_simulation():
    # Independent reference: explicit random walks in R^d, EVR1 of the uncentred base-delta Gram.
    rng = np.random.default_rng(123)
    W, d = 6, 300
    evr = []
    for _ in range(600):
        steps = rng.standard_normal((W - 1, d))
        X = np.cumsum(steps, axis=0)
        s = np.linalg.svd(X, compute_uv=False)
        evr.append(s[0] ** 2 / np.sum(s**2))
    q = evr1_null_quantile(list(range(0, 20 * W, 20)), d=d, q=0.9)
    assert q == pytest.approx(np.quantile(evr, 0.9), abs=0.01)
    # high-d limit: the Brownian spectrum (8/π² for many snapshots)
    assert evr1_null_limit(range(0, 20 * 400, 20)) == pytest.approx(8 / math.pi**2, abs=2e-3)
    assert 0.6 < evr1_null_quantile([0, 20, 40, 60], d=10**7, q=0.05)
