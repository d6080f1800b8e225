"""Probe credit against plain references: per-part backward passes, real optimizer steps, finite differences.

Every reading is computed by :mod:`lens_callbacks.credit.readings.probe` and held against a reference built here
independently: a per-part ``autograd.grad`` in a loop dotted with ``g_probe``, the update a real
``torch.optim`` step applied (``θ_after − θ_before``), and a central finite difference of ``∇L_probe``
for the second-order term.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lens_callbacks.credit.readings.probe as probe_mod
from lens_callbacks.credit import CreditTerms, Partition
from lens_callbacks.credit.readings.probe import (
    ProbeCreditReport,
    combine_ranks,
    copy_into,
    optimizer_update_map,
    probe_credit,
    probe_value_and_grad,
    scratch_like,
    with_actual,
)
from lens_callbacks.refusal import Refusal

V, D, B, T = 11, 6, 6, 5


class Bigram(nn.Module):
    """``terms[k, t] = −A_k · log π(x_{k,t+1} | x_{k,t}) / (B·T)`` with a tanh layer (curvature), float64."""

    def __init__(self, seed: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(V, D).double()
        self.hid = nn.Linear(D, D).double()
        self.out = nn.Linear(D, V).double()
        self.drop = nn.Dropout(dropout)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.7)

    def logp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.hid(self.emb(x[:, :-1]))))  # [B, T-1, D]
        lp = torch.log_softmax(self.out(h), -1)  # [B, T-1, V]
        return lp.gather(-1, x[:, 1:, None]).squeeze(-1)  # [B, T-1]

    def credit_terms(self, batch) -> CreditTerms:
        x, adv, rew, src = batch
        lp = F.pad(self.logp(x), (1, 0))  # [B, T]
        trained = torch.ones_like(x, dtype=torch.bool)
        trained[:, 0] = False
        terms = torch.where(trained, -adv[:, None] * lp / x.numel(), torch.zeros_like(lp))  # [B, T]
        n = x.shape[0]
        return CreditTerms(
            terms,
            trained,
            torch.arange(n),
            torch.arange(n) // 2,
            rewards=rew,
            advantages=adv,
            source=src,
            source_names=("easy", "hard"),
        )

    def probe_loss(self, x: torch.Tensor) -> torch.Tensor:
        return -self.logp(x).mean()


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    rew = torch.tensor([1.0, 0.0, 1.1, 0.1, 0.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([0.7, -0.7, 0.7, -0.7, -0.5, 0.5], dtype=torch.float64)
    return x, adv, rew, torch.tensor([0, 0, 1, 1, 0, 1])


def _probe_batch(seed: int = 2):
    return torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(seed))


def _one_part(terms: CreditTerms) -> Partition:
    ids = torch.where(terms.trained, 0, -1)  # [B, T]
    return Partition(ids, ("all",))


def _grads(m, loss):
    ps = [p for p in m.parameters() if p.requires_grad]
    return [g.detach() for g in torch.autograd.grad(loss, ps, retain_graph=True)]


def _dot(a, b):
    return math.fsum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))


def _set_grad(m, batch):
    for p in m.parameters():
        p.grad = None
    m.credit_terms(batch).terms.sum().backward()


def _assert_per_rollout(rep, m, batch, opt, gp, rel):
    """Each rollout's contribution against its own backward: ``−Σ D ⊙ g_k ⊙ g_probe``, and the parts' gap."""
    update = optimizer_update_map(opt, list(m.parameters()))
    terms = m.credit_terms(batch).terms
    for k in range(B):
        g_k = _grads(m, terms[k].sum())
        want = -math.fsum(float((d * g * p).sum()) for d, g, p in zip(update.coeff, g_k, gp))
        assert rep.contribution[k] == pytest.approx(want, rel=rel, abs=1e-16)
    assert rep.parts_gap < rel


def _reading(m, batch, opt, probe_x, partition="by_rollout", engine="auto", **kw):
    params = [p for p in m.parameters() if p.requires_grad]
    update = optimizer_update_map(opt, params)
    assert not isinstance(update, Refusal), update
    before, gp = probe_value_and_grad(m, m.probe_loss, probe_x, dtype="float64")
    return probe_credit(m, batch, partition, update, gp, loss_before=before, dtype="float64", engine=engine, **kw), gp


@pytest.mark.parametrize("engine", ["auto", "reference"])
def test_sgd_parts_add_up_to_minus_eta_dot(engine):
    m, batch, px = Bigram(), _batch(), _probe_batch()
    eta = 0.3
    _set_grad(m, batch)
    rep, gp = _reading(m, batch, torch.optim.SGD(m.parameters(), lr=eta), px, engine=engine)
    # Independent references: g_full by its own backward, g_probe by a plain backward of the probe loss.
    g_full = _grads(m, m.credit_terms(batch).terms.sum())
    g_probe = _grads(m, m.probe_loss(px))
    assert _dot(gp, g_probe) == pytest.approx(_dot(g_probe, g_probe), rel=1e-14)
    want = -eta * _dot(g_full, g_probe)
    assert rep.parts_sum == pytest.approx(want, rel=1e-12, abs=1e-16)
    assert rep.carried == 0.0
    assert rep.predicted == pytest.approx(want, rel=1e-12)
    assert rep.parts_gap < 1e-12
    # Each part against a per-part backward and a dot.
    terms = m.credit_terms(batch).terms
    for k in range(B):
        g_k = _grads(m, terms[k].sum())
        assert rep.contribution[k] == pytest.approx(-eta * _dot(g_k, g_probe), rel=1e-11, abs=1e-15)
    cos = _dot(g_full, g_probe) / math.sqrt(_dot(g_full, g_full) * _dot(g_probe, g_probe))
    assert rep.alignment == pytest.approx(cos, rel=1e-12)


def test_splits_sum_the_parts_by_stable_names():
    m, batch, px = Bigram(), _batch(), _probe_batch()
    _set_grad(m, batch)
    rep, _ = _reading(m, batch, torch.optim.SGD(m.parameters(), lr=0.1), px)
    sign = rep.split("by_advantage_sign")
    adv = batch[1]
    assert sign["positive"] == pytest.approx(math.fsum(c for c, a in zip(rep.contribution, adv) if a > 0), rel=1e-14)
    assert sign["negative"] == pytest.approx(math.fsum(c for c, a in zip(rep.contribution, adv) if a < 0), rel=1e-14)
    assert sign["zero"] == 0.0
    src = rep.split("by_source")
    assert set(src) == {"easy", "hard"}
    assert math.fsum(src.values()) == pytest.approx(rep.parts_sum, rel=1e-13)
    assert set(rep.split("by_reward")) == {"reward=0", "reward=0.1", "reward=1", "reward=1.1"}
    info = rep.part_info[rep.helped(1)[0]]
    k = rep.helped(1)[0]
    assert (info.group, info.advantage, info.reward) == (k // 2, float(adv[k]), float(batch[2][k]))
    d = rep.to_dict()
    assert d["probe/probe/split/by_advantage_sign/positive"] == sign["positive"]
    assert "helped" in rep.render()


def _fd_second_order(m, px, delta, h=1e-4):
    """``½ ⟨Δθ, H_probe Δθ⟩`` by a central difference of ``∇L_probe`` along ``Δθ``."""
    ps = [p for p in m.parameters() if p.requires_grad]
    out = []
    for s in (h, -h):
        mm = copy.deepcopy(m)
        with torch.no_grad():
            for p, d in zip([p for p in mm.parameters() if p.requires_grad], delta):
                p.add_(s * d)
        out.append(_grads(mm, mm.probe_loss(px)))
    hv = [(a - b) / (2 * h) for a, b in zip(*out)]
    assert len(hv) == len(ps)
    return 0.5 * _dot(delta, hv)


def test_gap_shrinks_as_eta_squared_against_finite_differences():
    base, batch, px = Bigram(), _batch(), _probe_batch()
    gaps, refs = [], []
    for eta in (0.4, 0.2, 0.1):
        m = copy.deepcopy(base)
        _set_grad(m, batch)
        opt = torch.optim.SGD(m.parameters(), lr=eta)
        rep, gp = _reading(m, batch, opt, px)
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        delta = [p.detach() - b for p, b in zip(m.parameters(), before)]
        after, _ = probe_value_and_grad(m, m.probe_loss, px, dtype="float64", grad=False)
        rep = with_actual(rep, after, delta, gp)
        assert rep.update_match < 1e-12  # the update map is the update SGD applied
        gaps.append(rep.first_order_gap)
        refs.append(_fd_second_order(base, px, delta))
    for gap, ref in zip(gaps, refs):
        assert gap == pytest.approx(ref, rel=0.5)  # second order dominates the gap
    # The gap is second order: halving η quarters it (up to the third-order term, itself shrinking).
    r1, r2 = gaps[0] / gaps[1], gaps[1] / gaps[2]
    assert abs(r2 - 4) < abs(r1 - 4) + 1e-9 and abs(r2 - 4) < 0.5
    # Against the finite-difference second-order term the remainder is third order: it shrinks ~8×.
    e = [abs(g - r) for g, r in zip(gaps, refs)]
    assert e[1] / e[2] > 5 and e[0] / e[1] > 5


def _optimizers():
    return {
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
        "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1),
        "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "sgd_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.05),
        "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2),
        "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    }


@pytest.mark.parametrize("kind", list(_optimizers()))
@pytest.mark.parametrize("warm", [0, 2])
@pytest.mark.parametrize("block", [None, 5])  # 5: every parameter in several blocks of the map, the last one short
def test_preconditioned_prediction_is_the_applied_update(kind, warm, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(probe_mod, "_MAP_BLOCK", block)
    m, batch, px = Bigram(), _batch(), _probe_batch()
    opt = _optimizers()[kind](list(m.parameters()))
    for s in range(warm):  # earlier steps fill the optimizer's state (momentum, moments)
        _set_grad(m, _batch(10 + s))
        opt.step()
    _set_grad(m, batch)
    rep, gp = _reading(m, batch, opt, px, partition=_one_part)
    params = [p for p in m.parameters()]
    update = optimizer_update_map(opt, params)
    predicted = update.predicted_update([p.grad for p in params])
    before = [p.detach().clone() for p in params]
    opt.step()
    delta = [p.detach() - b for p, b in zip(params, before)]
    for u, d in zip(predicted, delta):
        assert torch.allclose(u.expand_as(d), d, rtol=1e-10, atol=1e-15)
    applied = _dot(delta, gp)
    assert rep.n_parts == 1
    assert rep.contribution[0] + rep.carried == pytest.approx(applied, rel=1e-10)
    if warm == 0 and kind in ("adam", "adam_amsgrad", "momentum"):
        assert rep.carried == 0.0  # nothing carried into the first step without weight decay
    if warm and kind != "adam_amsgrad":
        assert rep.carried != 0.0


@pytest.mark.parametrize("kind", list(_optimizers()))
@pytest.mark.parametrize("param_dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_probe_read_along_the_map_equals_the_map_formed_whole(kind, param_dtype, monkeypatch):
    monkeypatch.setattr(probe_mod, "_MAP_BLOCK", 7)  # several blocks per parameter, the last one short
    m = Bigram().to(param_dtype)
    m.out.bias.requires_grad_(False)  # a parameter outside the optimizer: D = 0, its gradient still read
    params = [p for p in m.parameters() if p.requires_grad] + [m.out.bias]
    opt = _optimizers()[kind](params[:-1])
    for s in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s + 3 * p.numel())).to(p.dtype)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7 + p.numel())).to(p.dtype)
    gp = [torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=torch.float32) for p in params]
    update = optimizer_update_map(opt, params)
    got = update.along(gp, [p.grad for p in params], torch.float32)  # before D and the carried term exist
    assert "_made" not in update.__dict__
    # the reference: the map formed whole (old and new), then every sum in float64 over the whole tensors
    d = update.coeff
    c = update.carried
    g = [p.grad.double() for p in params]
    v = [(x.float() * y).expand(y.shape) for x, y in zip(d, gp)]
    for a, b in zip(got.onto, v):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a, b)
    assert torch.equal(d[-1], torch.zeros((), dtype=torch.float64)) and c[-1] is None
    want = {
        "carried_dot": _dot([x for x in c if x is not None], [y for x, y in zip(c, gp) if x is not None]),
        "grad_dot": _dot(g, gp),
        "probe_sq": _dot(gp, gp),
        "onto_sq": _dot(v, v),
        "onto_grad": _dot(v, g),
        "grad_sq": _dot(g, g),
    }
    for key, ref in want.items():
        assert getattr(got, key) == pytest.approx(ref, rel=1e-6, abs=1e-12), key
    again = update.along(gp, [p.grad for p in params], torch.float32)  # now from the formed map
    for a, b in zip(again.onto, got.onto):
        assert torch.equal(a, b)
    for key in want:
        assert getattr(again, key) == pytest.approx(getattr(got, key), rel=1e-12, abs=1e-15), key


def test_v_is_written_into_the_buffers_given_which_then_hold_theta_before(monkeypatch):
    monkeypatch.setattr(probe_mod, "_MAP_BLOCK", 7)  # several blocks per parameter, the last one short
    m = Bigram().float()
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    for s in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s + p.numel()))
        opt.step()
    gp = [torch.randn(p.shape, generator=torch.Generator().manual_seed(9 + p.numel())) for p in params]
    update = optimizer_update_map(opt, params)
    fresh = update.along(gp, [p.grad for p in params], torch.float32)
    bufs = scratch_like(params, torch.float32)
    assert [b.shape for b in bufs] == [p.shape for p in params] and all(b.dtype == torch.float32 for b in bufs)
    got = update.along(gp, [p.grad for p in params], torch.float32, out=bufs)
    for v, b, f in zip(got.onto, bufs, fresh.onto):
        assert v.data_ptr() == b.data_ptr() and torch.equal(v, f)  # the same storage, the same bits
    assert got._replace(onto=[]) == fresh._replace(onto=[])  # every sum bit for bit
    # reuse: fitting buffers are kept, the others made again
    assert all(a is b for a, b in zip(scratch_like(params, torch.float32, bufs), bufs))
    other = scratch_like(params, torch.float64, bufs)
    assert all(a is not b and a.dtype == torch.float64 for a, b in zip(other, bufs))
    short = scratch_like(params, torch.float32, bufs[:2])
    assert short[0] is bufs[0] and short[2] is not bufs[2]
    # θ_before into the same buffers (a clone where the dtype differs)
    before = copy_into(bufs, params)
    assert all(x is b and torch.equal(x, p) for x, b, p in zip(before, bufs, params))
    doubles = copy_into(other, params)
    assert all(x is not b and x.dtype == p.dtype and torch.equal(x, p) for x, b, p in zip(doubles, other, params))
    with pytest.raises(ValueError, match="`buffers` must hold one buffer per parameter"):
        copy_into(bufs[:1], params)
    bad = {
        "dtype": [b.double() if i == 1 else b for i, b in enumerate(bufs)],
        "shape": [b.reshape(-1) if i == 1 else b for i, b in enumerate(bufs)],
        "contiguity": [b.t() if i == 1 else b for i, b in enumerate(bufs)],
    }
    for what, out in bad.items():
        with pytest.raises(ValueError, match=r"`out\[1\]` must be a contiguous torch.float32 tensor"):
            update.along(gp, [p.grad for p in params], torch.float32, out=out)
    with pytest.raises(ValueError, match="`out` must hold one buffer per parameter"):
        update.along(gp, [p.grad for p in params], torch.float32, out=bufs[:-1])


@pytest.mark.parametrize("given", [False, True])
def test_riding_reads_the_checks_sums_from_the_map_pass_where_grad_is_in_the_audit_dtype(given, monkeypatch):
    import lens_callbacks.credit.engines.ghost as ghost_mod

    m, batch, px = Bigram(), _batch(), _probe_batch()
    opt = torch.optim.Adam(m.parameters(), lr=0.02)
    for s in range(2):
        _set_grad(m, _batch(40 + s))
        opt.step()
    calls = []
    real = ghost_mod.along_sums

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ghost_mod, "along_sums", spy)
    ride = _ridden_step(m, batch)
    try:
        # `applied_grad` given: the applied gradient is not known to be `.grad`, so the ride takes its own sums
        extra = {"applied_grad": [p.grad for p in m.parameters()]} if given else {}
        rep, gp = _reading(m, batch, opt, px, ride=ride, **extra)
    finally:
        ride.clear()
    assert rep.engine == "ghost+training_step" and rep.ride_fallback is None
    assert len(calls) == (1 if given else 0)
    # every reading against the separate pass and an independent per-part loop
    _set_grad(m, batch)
    sep, _ = _reading(m, batch, opt, px)
    for key in ("from_grad", "carried", "alignment", "grad_norm", "probe_grad_norm"):
        assert getattr(rep, key) == pytest.approx(getattr(sep, key), rel=1e-12), key
    _assert_per_rollout(rep, m, batch, opt, gp, rel=1e-12)


def _halves(terms: CreditTerms) -> Partition:
    """Each row's trained positions in two parts, before and after the middle: parts inside rows."""
    t = torch.arange(terms.terms.shape[1])
    ids = 2 * torch.arange(terms.terms.shape[0])[:, None] + (t >= T // 2)  # [B, T]
    return Partition(torch.where(terms.trained, ids, -1), tuple(f"p{i}" for i in range(2 * B)))


@pytest.mark.parametrize("partition", ["by_rollout", "halves"])
@pytest.mark.parametrize("audit", ["float64", "float32"])
def test_the_separate_pass_reads_the_checks_sums_from_the_map_pass(partition, audit, monkeypatch):
    import lens_callbacks.credit.engines.ghost as ghost_mod
    import lens_callbacks.credit.engines.jvp as jvp_mod

    m, batch, px = Bigram(), _batch(), _probe_batch()
    opt = torch.optim.Adam(m.parameters(), lr=0.02)
    for s in range(2):
        _set_grad(m, _batch(50 + s))
        opt.step()
    _set_grad(m, batch)
    calls = []
    for mod in (ghost_mod, jvp_mod):
        real = mod.along_sums
        monkeypatch.setattr(mod, "along_sums", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    part = _halves if partition == "halves" else partition
    update = optimizer_update_map(opt, list(m.parameters()))
    before, gp = probe_value_and_grad(m, m.probe_loss, px, dtype="float64")
    rep = probe_credit(m, batch, part, update, gp, loss_before=before, dtype=audit)
    assert rep.engine == ("ghost+grad" if partition == "by_rollout" else "jvp+grad")
    # `.grad` (float64) in the audit's dtype: the engine reads the map pass's sums; else it takes its own
    assert len(calls) == (0 if audit == "float64" else 1)
    # each part against its own backward, dotted with D ⊙ g_probe
    terms = m.credit_terms(batch)
    ids = _halves(terms).ids if partition == "halves" else torch.where(terms.trained, torch.arange(B)[:, None], -1)
    assert rep.n_parts == int(ids.max()) + 1
    for k in range(rep.n_parts):
        g_k = _grads(m, terms.terms[ids == k].sum())
        want = -math.fsum(float((d * g * p).sum()) for d, g, p in zip(update.coeff, g_k, gp))
        rel = 1e-10 if audit == "float64" else 1e-6
        assert rep.contribution[k] == pytest.approx(want, rel=rel, abs=1e-12 * max(map(abs, rep.contribution)))
    assert rep.parts_gap < (1e-10 if audit == "float64" else 1e-6)
    assert rep.ok


def test_sums_handed_to_an_engine_need_the_gradient_they_were_taken_from():
    from lens_callbacks.credit import disintegrate
    from lens_callbacks.credit.engines.reductions import AlongSums

    m, batch = Bigram(), _batch()
    v = [torch.ones_like(p) for p in m.parameters()]
    for part in ("by_rollout", _halves):
        with pytest.raises(ValueError, match="must come with `full_grad`"):
            disintegrate(
                m, batch, part, project_onto=v, readings="projected", dtype="float64", along=AlongSums(1.0, 1.0, 1.0)
            )


def test_a_map_used_after_the_step_raises_instead_of_reading_the_new_state():
    m = Bigram()
    params = list(m.parameters())
    opt = torch.optim.Adam(params, lr=0.05)
    _set_grad(m, _batch())
    opt.step()
    _set_grad(m, _batch(3))
    update = optimizer_update_map(opt, params)
    gp = [torch.ones_like(p) for p in params]
    opt.step()  # the moments, the parameters: all changed in place
    with pytest.raises(RuntimeError, match="did `optimizer.step\\(\\)` run"):
        update.along(gp, [p.grad for p in params], torch.float64)
    with pytest.raises(RuntimeError, match="read `optimizer_update_map` again before the step"):
        update.coeff


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_applied_update_is_dotted_a_block_at_a_time_without_forming_it(dtype, monkeypatch):
    import lens_callbacks.credit.engines.reductions as reductions

    monkeypatch.setattr(reductions, "BLOCK", 5)  # several blocks per parameter, the last one short
    g = torch.Generator().manual_seed(0)
    before = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in ((3, 4), (7,), (0,), (2, 2, 3))]
    after = [(b.double() + 1e-3 * torch.randn(b.shape, generator=g, dtype=torch.float64)).to(dtype) for b in before]
    gp = [torch.randn(b.shape, generator=g, dtype=torch.float64).float() for b in before]
    want = _dot([a.double() - b.double() for a, b in zip(after, before)], gp)  # the differences exact in float64
    got = probe_mod.update_dot(before, after, gp)
    assert got == pytest.approx(want, rel=1e-12 if dtype == torch.float64 else 1e-6)
    m = Bigram()
    _set_grad(m, _batch())
    rep = _reading(m, _batch(), torch.optim.SGD(m.parameters(), lr=0.1), _probe_batch())[0]
    assert with_actual(rep, 1.0, applied=got).applied == got
    with pytest.raises(ValueError, match="not both"):
        with_actual(rep, 1.0, [a - b for a, b in zip(after, before)], gp, applied=got)


def test_parts_split_an_adam_step_exactly():
    m, batch, px = Bigram(), _batch(), _probe_batch()
    opt = torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.1)
    for s in range(2):
        _set_grad(m, _batch(20 + s))
        opt.step()
    _set_grad(m, batch)
    rep, gp = _reading(m, batch, opt, px)
    _assert_per_rollout(rep, m, batch, opt, gp, rel=1e-10)


def _ridden_step(m, batch, partition_fn=None):
    """The training step's forward and backward of ``terms.sum()``, captured by a RideAlong."""
    from lens_callbacks.credit.engines.ghost import RideAlong

    for p in m.parameters():
        p.grad = None
    ride = RideAlong(m).start()
    loss = m.credit_terms(batch).terms.sum()
    ride.on_loss(loss, partition_fn)
    loss.backward()
    return ride


@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
def test_parts_read_from_the_training_step_captures_equal_per_part_backwards(partition):
    m, batch, px = Bigram(), _batch(), _probe_batch()
    opt = torch.optim.Adam(m.parameters(), lr=0.02)
    for s in range(2):
        _set_grad(m, _batch(30 + s))
        opt.step()
    ride = _ridden_step(m, batch)
    try:
        rep, gp = _reading(m, batch, opt, px, partition=partition, ride=ride)
        again, _ = _reading(m, batch, opt, _probe_batch(5), partition=partition, ride=ride)  # a second probe
    finally:
        ride.clear()
    assert rep.engine == again.engine == "ghost+training_step" and rep.ride_fallback is None
    update = optimizer_update_map(opt, list(m.parameters()))
    terms = m.credit_terms(batch).terms
    groups = [[k] for k in range(B)] if partition == "by_rollout" else [[k, k + 1] for k in range(0, B, 2)]
    for i, rows in enumerate(groups):
        g_k = _grads(m, terms[rows].sum())
        want = -math.fsum(float((d * g * p).sum()) for d, g, p in zip(update.coeff, g_k, gp))
        assert rep.contribution[i] == pytest.approx(want, rel=1e-12, abs=1e-16)
    assert rep.parts_gap < 1e-12 and again.parts_gap < 1e-12
    assert again.contribution != rep.contribution
    # the sums the riding reading shares with its check along v: as the separate pass reads them
    _set_grad(m, batch)
    sep, _ = _reading(m, batch, opt, px, partition=partition)
    assert sep.engine != rep.engine
    for key in ("from_grad", "carried", "alignment", "grad_norm", "probe_grad_norm"):
        assert getattr(rep, key) == pytest.approx(getattr(sep, key), rel=1e-12), key
    g = _grads(m, m.credit_terms(batch).terms.sum())
    assert rep.grad_norm == pytest.approx(math.sqrt(_dot(g, g)), rel=1e-12)


def test_captures_that_break_the_contract_fall_back_to_the_engine_and_say_why():
    m, batch, px = Bigram(), _batch(), _probe_batch()
    from lens_callbacks.credit.engines.ghost import RideAlong

    for p in m.parameters():
        p.grad = None
    ride = RideAlong(m).start()
    loss = 2.0 * m.credit_terms(batch).terms.sum()  # not terms.sum(): the captures are not the terms' gradients
    ride.on_loss(loss)
    loss.backward()
    rep, _ = _reading(m, batch, torch.optim.SGD(m.parameters(), lr=0.1), px, ride=ride)
    ride.clear()
    ref, _ = _reading(m, batch, torch.optim.SGD(m.parameters(), lr=0.1), px, engine="reference")
    assert "is not `terms.sum()`" in rep.ride_fallback and rep.engine != "ghost+training_step"
    assert rep.contribution == pytest.approx(ref.contribution, rel=1e-12, abs=1e-16)


def test_a_grad_changed_after_the_captured_backward_is_caught_along_the_probe_direction():
    # The riding reading forms no parts' sum: the parts are held against `.grad` along v = D ⊙ g_probe.
    m, batch, px = Bigram(), _batch(), _probe_batch()
    ride = _ridden_step(m, batch)
    with torch.no_grad():
        m.hid.weight.grad.mul_(1.001)  # e.g. a callback rescaled one parameter's gradient after the backward
    rep, _ = _reading(m, batch, torch.optim.SGD(m.parameters(), lr=0.1), px, ride=ride)
    ride.clear()
    assert "do not add up to `.grad`" in rep.ride_fallback and rep.engine != "ghost+training_step"
    assert rep.parts_gap > 1e-4  # and the separate pass's reading says so too: its parts miss the applied `.grad`


def test_a_vector_to_project_onto_needs_captures_not_yet_reduced():
    m, batch = Bigram(), _batch()
    ride = _ridden_step(
        m, batch, lambda t: Partition(torch.where(t.trained, torch.arange(B)[:, None], -1), tuple("abcdef"))
    )
    with pytest.raises(ValueError, match="`project_onto` must be given with on_loss"):
        ride.report(None, project_onto=[p.grad for p in m.parameters()])
    ride.clear()


def test_optimizers_outside_the_known_set_are_refused_by_name():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.ones(3, dtype=torch.float64)
    r = optimizer_update_map(torch.optim.RMSprop([p]), [p])
    assert isinstance(r, Refusal) and r.condition == "optimizer" and "RMSprop" in r.reason

    class MySGD(torch.optim.SGD):
        pass

    r = optimizer_update_map(MySGD([p], lr=0.1), [p])
    assert isinstance(r, Refusal) and "MySGD" in r.reason
    assert optimizer_update_map(torch.optim.Adam([p], maximize=True), [p]).condition == "maximize"
    assert (
        optimizer_update_map(torch.optim.SGD([p], lr=0.1), [p], gradient_clip_val=1.0).condition == "gradient_clip_val"
    )
    assert (
        optimizer_update_map(torch.optim.SGD([p], lr=0.1), [p], accumulate_grad_batches=2).condition
        == "accumulate_grad_batches"
    )
    assert r.to_dict("probe/x/")["probe/x/refused"] == 1.0


def test_probe_gradient_is_read_only_and_repeatable():
    m, px = Bigram(dropout=0.3).train(), _probe_batch()
    for p in m.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = torch.random.get_rng_state()
    v1, g1 = probe_value_and_grad(m, m.probe_loss, px, dtype="float64")
    v2, g2 = probe_value_and_grad(m, m.probe_loss, px, dtype="float64")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in m.parameters())
    assert v1 == v2 and all(torch.equal(a, b) for a, b in zip(g1, g2))  # the same dropout masks each time
    with pytest.raises(TypeError, match="scalar float tensor"):
        probe_value_and_grad(m, lambda x: m.logp(x), px)


def test_zero_probe_gradient_gives_zero_contributions():
    m, batch = Bigram(), _batch()
    _set_grad(m, batch)
    params = list(m.parameters())
    update = optimizer_update_map(torch.optim.SGD(params, lr=0.1), params)
    rep = probe_credit(m, batch, "by_rollout", update, [torch.zeros_like(p) for p in params], dtype="float64")
    assert rep.ok and rep.contribution == (0.0,) * B and rep.predicted == 0.0


def test_combine_ranks_adds_parts_and_splits():
    a = ProbeCreditReport(
        "p",
        ("rollout_0",),
        (-1.0,),
        0.5,
        -0.5,
        2.0,
        0.1,
        1.0,
        1.0,
        "torch.optim.SGD",
        "float64",
        3,
        splits=(("by_advantage_sign", ("positive", "negative", "zero"), (-1.0, 0.0, 0.0)),),
    )
    b = ProbeCreditReport(
        "p",
        ("rollout_0",),
        (0.25,),
        0.5,
        -0.5,
        2.0,
        0.1,
        1.0,
        1.0,
        "torch.optim.SGD",
        "float64",
        4,
        splits=(("by_advantage_sign", ("positive", "negative", "zero"), (0.0, 0.25, 0.0)),),
    )
    c = combine_ranks([a, b])
    assert c.part_names == ("r0/rollout_0", "r1/rollout_0") and c.n_trained == 7
    assert c.predicted == pytest.approx(-0.25) and c.split("by_advantage_sign") == {
        "positive": -1.0,
        "negative": 0.25,
        "zero": 0.0,
    }


@pytest.mark.parametrize("name", ["lens_callbacks.credit.readings.probe", "lens_callbacks.metrics.probe"])
def test_docstring_examples(name):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
