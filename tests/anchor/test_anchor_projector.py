"""Projector readings against a slow numpy reference built on explicitly stacked snapshots."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.anchor import Rank1TrajProjector, confidence_weights, projected_merge, replay, signed_ema


def _walk(n, d, seed, drift, noise, kind="iid"):
    """Snapshots θ_t at t = 0..n-1: linear drift plus iid noise, or a pure random walk."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g)
    x0 = torch.randn(d, generator=g)
    if kind == "iid":
        return [x0 + drift * t * v + noise * torch.randn(d, generator=g) for t in range(n)]
    steps = torch.randn(n, d, generator=g)
    return [x0 + steps[:t].sum(0) for t in range(n)]


def _ref_fit(snaps, ticks):
    """numpy: SVD of the stacked base-deltas, sign pinned so the coefficient grows, polyfit line."""
    base = snaps[0].double().numpy()
    X = np.stack([s.double().numpy() - base for s in snaps[1:]])  # [W-1, d]
    U, S, Vt = np.linalg.svd(X, full_matrices=False)
    c = np.concatenate([[0.0], U[:, 0] * S[0]])
    v1 = Vt[0]
    a, b = np.polyfit(np.asarray(ticks, float), c, 1)
    if a < 0:
        c, v1 = -c, -v1
        a, b = np.polyfit(np.asarray(ticks, float), c, 1)
    return base, v1, c, a, b, S


def test_projection_matches_numpy_reference_and_lies_in_the_span():
    d, cad, K = 64, 10, 20
    snaps = _walk(200, d, 1, drift=0.05, noise=0.02)
    p = Rank1TrajProjector(n0=4, w_cap=6, pool="global")
    seen, prev_ref, n_retro = [], None, 0
    for tick in range(0, 150, cad):
        truth = snaps[tick + K]
        prj = p.fire({"w": snaps[tick]}, tick, tick + K, truth={"w": truth})
        r = prj.reading
        seen.append(tick)
        window = seen[-6:]
        if prev_ref is not None:
            # retrospective: the previous fit predicts this snapshot's coefficient before seeing it
            pticks, pbase, pv1, pc, pa, pb = prev_ref
            c_true = float((snaps[tick].double().numpy() - pbase) @ pv1)
            want = abs(pa * tick + pb - c_true) / abs(c_true - pc[-1])
            assert r.coef_pred_error == pytest.approx(want, rel=1e-4)
            # and in weight space: the previous θ̂ at this tick against holding the previous newest snapshot
            new = snaps[tick].double().numpy()
            pred = pbase + (pa * tick + pb) * pv1
            want_w = np.linalg.norm(new - pred) / np.linalg.norm(new - snaps[pticks[-1]].double().numpy())
            assert r.retro_weight_ratio == pytest.approx(want_w, rel=1e-4)
            n_retro += 1
        if len(window) < 4:
            assert not r.projected and r.reason and math.isnan(r.evr1)
            torch.testing.assert_close(prj.anchor["w"], snaps[tick].float(), rtol=0, atol=0)
            prev_ref = None
            continue
        ws = [snaps[t] for t in window]
        base, v1, c, a, b, S = _ref_fit(ws, window)
        assert r.evr1 == pytest.approx(S[0] ** 2 / np.sum(S**2), rel=1e-6)
        assert r.r2 == pytest.approx(np.corrcoef(window, c)[0, 1] ** 2, rel=1e-5)
        t_tgt = tick + K  # h_safe = None: de-stale to the present
        assert r.t_tgt == t_tgt <= tick + K
        theta_ref = base + (a * t_tgt + b) * v1
        hat = prj.theta_hat["w"].double().numpy()
        np.testing.assert_allclose(hat, theta_ref, rtol=1e-4, atol=1e-5)
        assert r.span_residual < 1e-9
        # θ̂ (float64) lies in the affine span of the snapshots: θ̂ − θ_base in the span of their displacements
        p64 = Rank1TrajProjector(n0=4, w_cap=6, pool="global")
        p64.load_state_dict(p.state_dict())
        hat64 = p64.project(tick + K, theta_dtype=torch.float64).theta_hat["w"].numpy()
        # ... of the snapshots as stored (fp32 base + fp32 deltas, summed here in float64) to 1e-9,
        ring = p64.ring
        base_st = ring.base["w"].double().numpy()
        X = np.cumsum(np.stack([dk["w"].double().numpy() for dk in ring.deltas]), axis=0).T  # [d, W-1]
        coef, *_ = np.linalg.lstsq(X, hat64 - base_st, rcond=None)
        assert np.linalg.norm(X @ coef - (hat64 - base_st)) / np.linalg.norm(hat64 - base_st) < 1e-9
        # ... and of the raw snapshots up to the fp32 rounding of the stored deltas.
        X = np.stack([s.double().numpy() - base for s in ws[1:]]).T  # [d, W-1]
        coef, *_ = np.linalg.lstsq(X, hat64 - base, rcond=None)
        assert np.linalg.norm(X @ coef - (hat64 - base)) / np.linalg.norm(hat64 - base) < 1e-6
        tr = truth.double().numpy()
        want = np.linalg.norm(theta_ref - tr) / np.linalg.norm(ws[-1].double().numpy() - tr)
        assert r.weight_err_ratio == pytest.approx(want, rel=1e-4)
        vel = ws[-1].double().numpy() + K / cad * (ws[-1].double().numpy() - ws[-2].double().numpy())
        assert r.vel_err_ratio == pytest.approx(
            np.linalg.norm(vel - tr) / np.linalg.norm(ws[-1].double().numpy() - tr), rel=1e-4
        )
        if prev_ref is not None:
            assert r.fire_cos == pytest.approx(float(prev_ref[2] @ v1), abs=1e-6)
        prev_ref = (window, base, v1, c, a, b)
    assert r.comm_bytes == d * 4 + math.ceil(d / 8)
    assert n_retro == 11  # every fire after the first fit (fires 5..15)


def test_gate_is_pooled_per_layer_and_sign_agree_matches_numpy():
    # Layer h.0 (two tensors) drifts, layer h.1 does a random walk: one window, two gate decisions.
    d, cad, K = 300, 10, 10
    g = torch.Generator().manual_seed(11)
    drift = _walk(200, 2 * d, 4, drift=0.05, noise=0.01)
    walk = _walk(200, d, 5, 0, 0, kind="walk")
    snap = {t: {"h.0.a": drift[t][:d], "h.0.b": drift[t][d:].reshape(3, -1), "h.1.a": walk[t]} for t in range(200)}
    p = Rank1TrajProjector(n0=4, w_cap=6, pool="layer")
    # M_anchor: mostly against the drift on h.0 (a descent direction agrees with −a·v1), unrelated on h.1
    m0 = -(drift[100] - drift[0]) + 0.5 * torch.randn(2 * d, generator=g)
    m = {"h.0.a": m0[:d], "h.0.b": m0[d:].reshape(3, -1), "h.1.a": torch.randn(d, generator=g)}
    on = {"h.0": [], "h.1": []}
    seen = []
    for tick in range(0, 150, cad):
        prj = p.fire(snap[tick], tick, tick + K, truth=snap[tick + K], m_anchor=m)
        seen.append(tick)
        if not prj.reading.projected:
            continue
        window = seen[-6:]
        for blk, names in (("h.0", ["h.0.a", "h.0.b"]), ("h.1", ["h.1.a"])):
            X = np.stack([np.concatenate([snap[t][n].double().reshape(-1).numpy() for n in names]) for t in window])
            S = np.linalg.svd(X[1:] - X[0], compute_uv=False)
            assert prj.reading.blocks[blk]["evr1"] == pytest.approx(S[0] ** 2 / np.sum(S**2), rel=1e-6)
            on[blk].append(prj.gate[names[0]])
            assert all(prj.gate[n] == prj.gate[names[0]] for n in names)  # one decision per block
        # Resolution B's sign cross-check, pooled over all tensors, from per-tensor fits
        agree = both = 0
        for n in snap[tick]:
            X = np.stack([snap[t][n].double().reshape(-1).numpy() for t in window])
            _, v1, _, a, _, _ = _ref_fit([torch.from_numpy(x) for x in X], window)
            sb, sm = np.sign(-a * v1), np.sign(m[n].double().reshape(-1).numpy())
            agree += int(np.sum((sb == sm) & (sb != 0) & (sm != 0)))
            both += int(np.sum((sb != 0) & (sm != 0)))
        assert prj.reading.sign_agree == pytest.approx(agree / both, abs=1.5 / both)
    assert np.mean(on["h.0"]) > 0.8 and np.mean(on["h.1"]) < 0.2


def test_below_n0_is_a_strict_no_op():
    snaps = _walk(5, 16, 2, 1.0, 0.0)
    p = Rank1TrajProjector(n0=4)
    for t in range(3):
        prj = p.fire({"w": snaps[t]}, 10 * t, 10 * t + 10, truth={"w": snaps[t + 1]})
        assert prj.theta_hat is None and not prj.reading.projected
        assert prj.tau == {"w": 1.0} and prj.gate == {"w": False}
        assert torch.equal(prj.anchor["w"], snaps[t])
    assert p.fire({"w": snaps[3]}, 30, 40).reading.projected


def test_linear_drift_beats_stale_and_matches_velocity_extrapolation():
    d, cad, K = 200, 10, 20
    snaps = _walk(260, d, 7, drift=0.05, noise=0.01)
    rep = replay(
        {t: {"w": s} for t, s in enumerate(snaps)},
        cadence=cad,
        delay_K=K,
        projector=Rank1TrajProjector(n0=4, w_cap=10, pool="global"),
    )
    proj = [r for r in rep.readings if r.projected]
    assert len(proj) >= 15
    assert rep.median_ratio < 0.1
    assert rep.median_ratio <= rep.median_vel_ratio * 1.05
    assert rep.gated_on_fraction > 0.9 and rep.decide()[0] == "project"
    # the line predicts the next snapshot's coefficient far better than holding the old one
    assert np.nanmedian([r.coef_pred_error for r in proj]) < 0.1


@pytest.mark.parametrize("retro_gate", [True, False])
def test_random_walk_gate_stays_mostly_off(retro_gate):
    # retro_gate=False: the random-walk EVR1 null alone must keep the gate OFF (a fixed 0.6 would not).
    d, cad, K = 500, 10, 10
    fr = []
    for seed in range(3):
        snaps = _walk(200, d, 100 + seed, 0, 0, kind="walk")
        rep = replay(
            {t: {"w": s} for t, s in enumerate(snaps)},
            cadence=cad,
            delay_K=K,
            projector=Rank1TrajProjector(n0=4, w_cap=8, pool="global", retro_gate=retro_gate),
        )
        fr += [r.gated_on_fraction for r in rep.readings if r.projected]
        # ungated, extrapolating a walk is worse than the stale snapshot (the gate is needed) ...
        assert rep.median_ratio > 1.0
        # ... and gated, the anchor falls back to the stale snapshot: no worse than doing nothing
        assert rep.median_ratio_gated <= 1.0 + 1e-12 and rep.decision == "stale"
    assert np.mean(fr) < 0.2


def _drift_walk(n, d, seed, rate):
    """θ_t = x0 + rate·t·v + a unit random walk: a drift with an accumulating part off its direction."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g)
    x0 = torch.randn(d, generator=g)
    walk = torch.cumsum(torch.randn(n, d, generator=g), 0)
    return [x0 + rate * t * v + walk[t] for t in range(n)]


@pytest.mark.parametrize("rate", [0.2, 1.0])
def test_retro_gate_refuses_a_coherent_but_unextrapolable_trajectory(rate):
    # A weak drift under a random walk: EVR1, R² and fire_cos all pass (the spec's four factors gate it ON),
    # yet θ̂ drops the walk's accumulated part off v1 and loses to the stale snapshot. The retrospective
    # factor sees that before projecting; on a strong drift it lets the projection through.
    snaps = _drift_walk(200, 500, 7, rate)
    reps = {}
    for retro in (False, True):
        reps[retro] = replay(
            {t: {"w": s} for t, s in enumerate(snaps)},
            cadence=10,
            delay_K=10,
            projector=Rank1TrajProjector(n0=4, w_cap=8, pool="global", retro_gate=retro),
        )
    proj = [r for r in reps[True].readings if r.projected]
    assert np.median([r.evr1 - r.evr1_null for r in proj]) > 0.05 and np.median([r.r2 for r in proj]) > 0.95
    assert reps[False].gated_on_fraction == 1.0
    if rate < 0.5:
        assert reps[False].median_ratio_gated > 1.1  # the four factors let a harmful projection through
        assert np.nanmedian([r.retro_weight_ratio for r in proj]) > 1.0
        assert reps[True].gated_on_fraction < 0.1 and reps[True].median_ratio_gated <= 1.0 + 1e-12
    else:
        assert np.nanmedian([r.retro_weight_ratio for r in proj]) < 1.0
        assert reps[True].gated_on_fraction > 0.8 and reps[True].median_ratio_gated < 0.6


def test_a_failed_span_self_test_leaves_the_anchor_stale(monkeypatch):
    import lens_callbacks.anchor.projector as projector

    monkeypatch.setattr(projector, "SPAN_TOL", -1.0)  # every residual fails
    snaps = _walk(60, 32, 3, drift=0.05, noise=0.0)
    p = Rank1TrajProjector(n0=4, pool="global", retro_gate=False)
    for t in range(0, 50, 10):
        prj = p.fire({"w": snaps[t]}, t, t + 10, truth={"w": snaps[t + 10]})
    r = prj.reading
    assert not r.projected and "span self-test" in r.reason
    assert prj.gate == {"w": False} and r.gated_on_fraction == 0.0
    assert torch.equal(prj.anchor["w"], snaps[40])


def test_projected_merger_at_full_confidence_is_signed_ema_bit_for_bit():
    # inf in G: w·signed + (1 − w)·G would turn 0·inf into nan where signed_ema gives ±inf.
    g = torch.tensor([1.5, -2.0, 0.0, -0.0, 3.0, -1e-30, 4.0, float("inf"), -float("inf")])
    m = torch.tensor([-1.0, -1.0, 2.0, -2.0, 0.0, 5.0, 1e-38, 1.0, -1.0])
    for alpha in (0.0, 0.25, 0.7, 1.0):
        a = signed_ema(g, m, alpha)
        b = projected_merge(g, m, alpha, 1.0, torch.ones_like(g))
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        c = projected_merge(g, m, alpha, 1.0, None)
        assert torch.equal(a.view(torch.int32), c.view(torch.int32))


def test_mergers_against_a_per_coordinate_loop():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(50, generator=gen, dtype=torch.float64)
    m = torch.randn(50, generator=gen, dtype=torch.float64)
    w = confidence_weights(m, kappa=1.5, p=0.3)
    q = np.quantile(np.abs(m.numpy()), 0.3, method="inverted_cdf")
    alpha, tau = 0.25, 0.6
    ae = alpha + (1 - alpha) * (1 - tau)
    out = projected_merge(g, m, alpha, tau, w)
    se = signed_ema(g, m, alpha)
    for i in range(50):
        gi, mi = float(g[i]), float(m[i])
        wi = min(max(abs(mi) / (1.5 * q), 0.0), 1.0)
        assert float(w[i]) == pytest.approx(wi, rel=1e-12)
        sg = math.copysign(1.0, mi) if mi != 0 else 0.0
        signed = wi * abs(gi) * sg + (1 - wi) * gi
        assert float(out[i]) == pytest.approx(ae * gi + (1 - ae) * signed, rel=1e-12, abs=1e-15)
        assert float(se[i]) == pytest.approx(alpha * gi + (1 - alpha) * abs(gi) * sg, rel=1e-12, abs=1e-15)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
    alpha=st.floats(0.0, 1.0),
    zeros=st.floats(0.0, 0.5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_full_confidence_is_signed_ema_bit_for_bit_on_any_tensor(n, seed, alpha, zeros, dtype):
    g_ = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=g_).to(dtype)
    m = torch.randn(n, generator=g_).to(dtype)
    g[torch.rand(n, generator=g_) < zeros] = 0.0
    m[torch.rand(n, generator=g_) < zeros] = 0.0
    a = signed_ema(g, m, alpha)
    b = projected_merge(g, m, alpha, 1.0, torch.ones(n, dtype=dtype))
    bits = torch.int16 if dtype == torch.bfloat16 else (torch.int32 if dtype == torch.float32 else torch.int64)
    assert torch.equal(a.view(bits), b.view(bits))
