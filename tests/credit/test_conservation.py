"""step_conservation and the exact-optimizer precondition, against independent numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.readings.conservation import (
    ConservationReading,
    exact_optimizer_precondition,
    step_conservation,
    unit_roundoff,
)
from lens_callbacks.refusal import Refusal


class TinyPolicy(nn.Module):
    """A next-token policy small enough for exact float64 work: embedding → tanh MLP → logits."""

    def __init__(self, vocab: int = 11, d: int = 8, dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.hid = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.to(dtype)

    def credit_terms(self, batch) -> CreditTerms:
        tokens, mask, adv = batch  # [B, T+1], [B, T], [B]
        h = torch.tanh(self.hid(self.emb(tokens[:, :-1])))  # [B, T, d]
        logp = torch.log_softmax(self.out(h), dim=-1)  # [B, T, V]
        lp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T]
        m = mask.to(lp.dtype)
        terms = -adv[:, None].to(lp.dtype) * lp * m / m.sum()  # [B, T]
        B = tokens.shape[0]
        return CreditTerms(terms, mask, torch.arange(B), torch.arange(B) // 2)


def _batch(B: int = 4, T: int = 6, vocab: int = 11, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=g)  # [B, T+1]
    mask = torch.rand(B, T, generator=g) > 0.2  # [B, T]
    mask[:, 0] = True
    rewards = torch.randint(0, 2, (B,), generator=g).double()
    rewards[0], rewards[1] = 1.0, 0.0  # advantages never all zero
    adv = rewards - rewards.view(-1, 2).mean(1).repeat_interleave(2)  # group-relative, groups of 2
    return tokens, mask, adv


def _numpy_error(before, after, lrs, grad):
    """The obviously correct reading: flatten everything, float64 numpy."""
    d = np.concatenate([((b.double() - a.double()) / lr).numpy().ravel() for b, a, lr in zip(before, after, lrs)])
    g = np.concatenate([gg.double().numpy().ravel() for gg in grad])
    return np.linalg.norm(d - g) / np.linalg.norm(g)


def _sgd_step(policy, batch, opt):
    """One real training step; returns θ_before, θ_after and the .grad the optimizer applied."""
    before = [p.detach().clone() for p in policy.parameters()]
    opt.zero_grad()
    policy.credit_terms(batch).terms.sum().backward()
    grads = [p.grad.detach().clone() for p in policy.parameters()]
    opt.step()
    return before, [p.detach().clone() for p in policy.parameters()], grads


def test_float64_summed_parts_against_a_real_sgd_step():
    torch.manual_seed(0)
    policy = TinyPolicy(dtype=torch.float64)
    batch = _batch()
    lr = 1e-3
    report = disintegrate(policy, batch, "by_rollout", dtype="float64", keep_grads=True)
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    before, after, _ = _sgd_step(policy, batch, opt)
    parts = report.grads.parts_sum
    assert report.grads.names == tuple(n for n, _ in policy.named_parameters())
    reading = step_conservation(
        before, after, lr, parts, precondition=exact_optimizer_precondition(opt), source="credit_parts"
    )
    assert isinstance(reading, ConservationReading)
    assert reading.relative_error <= 1e-8  # the spec measured 4.9e-9
    assert reading.relative_error == pytest.approx(
        _numpy_error(before, after, [lr] * len(before), parts), rel=1e-9, abs=1e-18
    )
    assert reading.holds and reading.dtype == "float64" and reading.source == "credit_parts"
    # Not vacuous: a gradient 1 % off is seen at once.
    wrong = step_conservation(before, after, lr, [1.01 * g for g in parts])
    assert wrong.relative_error == pytest.approx(0.01 / 1.01, rel=1e-6)
    assert not wrong.update_precision_limited and wrong.violated


def test_float32_tiny_lr_is_precision_limited_not_a_failure():
    """The spec's "0.151 under a floor of 7.9", in kind: a tiny step on float32 weights."""
    policy = TinyPolicy(dtype=torch.float32, seed=3)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(8.0)  # weights large against the step, as in a trained model
    batch = _batch(seed=4)
    lr = 1e-7
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    before, after, grads = _sgd_step(policy, batch, opt)
    reading = step_conservation(before, after, lr, grads, precondition=exact_optimizer_precondition(opt))
    naive = _numpy_error(before, after, [lr] * len(before), grads)
    assert reading.relative_error == pytest.approx(naive, rel=1e-9)
    assert naive > 0.05  # reads as a catastrophic failure...
    assert reading.update_precision_limited and reading.update_precision_floor > reading.relative_error
    assert reading.holds and not reading.violated  # ...and is not reported as one
    # The same step in float64 closes: the float32 error is rounding of θ_after, nothing else.
    exact = [(b.double() - lr * g.double()) for b, g in zip(before, grads)]
    ref = step_conservation([b.double() for b in before], exact, lr, [g.double() for g in grads])
    assert ref.relative_error < 1e-6 < reading.relative_error


def test_floor_bounds_pure_rounding_numpy():
    """Independent check of the floor: round an exact float64 update to float32 and measure in numpy."""
    rng = np.random.default_rng(0)
    for lr in (1e-2, 1e-5, 1e-8):
        theta = rng.normal(size=4000) * 3.0
        g = rng.normal(size=4000)
        before = torch.tensor(theta.astype(np.float32))
        gt = torch.tensor(g.astype(np.float32))
        after = (before.double() - lr * gt.double()).float()  # correctly rounded update
        naive = _numpy_error([before], [after], [lr], [gt])
        r = step_conservation([before], [after], lr, [gt])
        assert r.relative_error == pytest.approx(naive, rel=1e-9)
        assert naive <= r.update_precision_floor
        # and the floor is not vacuous: within two orders of the rounding it bounds
        assert r.update_precision_floor < 100 * max(naive, unit_roundoff(torch.float32))


def test_two_groups_with_different_lrs_frozen_and_gradless_parameters():
    policy = TinyPolicy(dtype=torch.float64, seed=5)
    policy.emb.weight.requires_grad_(False)  # frozen, but still held by the optimizer
    unused = nn.Parameter(torch.ones(3, dtype=torch.float64))  # in the optimizer, never gets a gradient
    batch = _batch(seed=6)
    opt = torch.optim.SGD(
        [
            {"params": [policy.emb.weight, policy.hid.weight, policy.hid.bias, unused], "lr": 0.05},
            {"params": [policy.out.weight, policy.out.bias], "lr": 0.2},
        ],
        lr=0.1,
    )
    params = [p for g in opt.param_groups for p in g["params"]]
    gidx = [i for i, g in enumerate(opt.param_groups) for _ in g["params"]]
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    policy.credit_terms(batch).terms.sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    assert grads[0] is None and grads[3] is None
    lrs = [g["lr"] for g in opt.param_groups]
    opt.step()
    after = [p.detach().clone() for p in params]
    r = step_conservation(before, after, lrs, grads, group_index=gidx)
    assert r.n_without_grad == 2 and r.lrs == (0.05, 0.2)
    ref = _numpy_error(
        before, after, [lrs[i] for i in gidx], [torch.zeros_like(b) if g is None else g for b, g in zip(before, grads)]
    )
    assert r.relative_error == pytest.approx(ref, rel=1e-9, abs=1e-18)
    assert r.relative_error < 1e-12 and r.holds
    # Reading both groups with one lr is wrong, and seen.
    assert step_conservation(before, after, 0.05, grads).violated
    # A gradless tensor that moved anyway counts as error.
    moved = [a.clone() for a in after]
    moved[3] += 1e-3
    assert step_conservation(before, moved, lrs, grads, group_index=gidx).violated


def test_a_step_that_did_not_happen_is_a_violation_not_unresolvable():
    before = [torch.randn(50) * 100]
    g = [torch.randn(50)]
    r = step_conservation(before, [before[0].clone()], 1e-3, g)
    assert r.relative_error == 1.0 and not r.update_precision_limited and r.violated


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    n_groups=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_reading_matches_numpy_for_any_shapes(sizes, n_groups, seed):
    gen = torch.Generator().manual_seed(seed)
    before = [torch.randn(s, s + 1, generator=gen, dtype=torch.float64) for s in sizes]
    grads = [torch.randn(b.shape, generator=gen, dtype=torch.float64) for b in before]
    gidx = [i % n_groups for i in range(len(before))]
    lrs = [0.1 * (i + 1) for i in range(n_groups)]
    after = [
        b - lrs[i] * g + 1e-6 * torch.randn(b.shape, generator=gen, dtype=torch.float64)
        for b, g, i in zip(before, grads, gidx)
    ]
    r = step_conservation(before, after, lrs, grads, group_index=gidx)
    assert r.relative_error == pytest.approx(_numpy_error(before, after, [lrs[i] for i in gidx], grads), rel=1e-9)


# ---------------------------------------------------------------- the precondition


def _p():
    return [nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "make, condition, value",
    [
        (lambda: torch.optim.Adam(_p()), "optimizer", "torch.optim.adam.Adam"),
        (lambda: torch.optim.AdamW(_p()), "optimizer", "torch.optim.adamw.AdamW"),
        (lambda: torch.optim.RMSprop(_p()), "optimizer", "torch.optim.rmsprop.RMSprop"),
        (lambda: torch.optim.LBFGS(_p()), "optimizer", "torch.optim.lbfgs.LBFGS"),
        (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), "momentum", 0.9),
        (lambda: torch.optim.SGD(_p(), lr=0.1, weight_decay=0.01), "weight_decay", 0.01),
        (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9, nesterov=True), "nesterov", True),
        (lambda: torch.optim.SGD(_p(), lr=0.1, maximize=True), "maximize", True),
    ],
)
def test_precondition_refuses_and_names_the_condition(make, condition, value):
    r = exact_optimizer_precondition(make())
    assert isinstance(r, Refusal) and not r
    assert r.condition == condition
    assert value in r.numbers.values() if condition != "optimizer" else r.numbers["optimizer"] == value
    assert repr(value) in r.reason or str(value) in r.reason
    assert "SGD" in r.remedy


def test_precondition_refuses_a_subclass_and_a_stranger():
    class MySGD(torch.optim.SGD):
        pass

    r = exact_optimizer_precondition(MySGD(_p(), lr=0.1))
    assert r.condition == "optimizer" and "subclass" in r.reason
    assert exact_optimizer_precondition(object()).condition == "optimizer"


def test_precondition_trainer_values():
    opt = torch.optim.SGD(_p(), lr=0.1)
    ok, why = exact_optimizer_precondition(opt, gradient_clip_val=0, accumulate_grad_batches=1)
    assert ok is True and "SGD" in why
    assert exact_optimizer_precondition(opt, gradient_clip_val=None)[0] is True
    r = exact_optimizer_precondition(opt, gradient_clip_val=1.0)
    assert r.condition == "gradient_clip_val" and r.numbers["gradient_clip_val"] == 1.0
    r = exact_optimizer_precondition(opt, accumulate_grad_batches=2)
    assert r.condition == "accumulate_grad_batches" and r.numbers["accumulate_grad_batches"] == 2
    assert exact_optimizer_precondition(opt, step_skipped=True).condition == "step_skipped"
    # The first broken condition is named: the optimizer before the trainer's settings.
    assert exact_optimizer_precondition(torch.optim.Adam(_p()), gradient_clip_val=1.0).condition == "optimizer"


def test_precondition_param_group_mix_names_the_breaking_group():
    a, b = _p(), _p()
    opt = torch.optim.SGD([{"params": a}, {"params": b, "weight_decay": 0.1}], lr=0.1)
    r = exact_optimizer_precondition(opt)
    assert r.condition == "weight_decay" and r.numbers["param_group"] == 1 and "param group 1" in r.reason
    # A precondition refusal passes through step_conservation unchanged.
    assert step_conservation([a[0]], [a[0]], 0.1, [a[0]], precondition=r) is r


def test_unreadable_steps_are_refusals():
    x = [torch.ones(3)]
    assert step_conservation(x, x, 0.0, [torch.ones(3)]).condition == "lr"
    assert step_conservation(x, x, 0.1, [torch.zeros(3)]).condition == "zero_gradient"
    assert step_conservation(x, x, 0.1, [torch.tensor([1.0, math.nan, 0.0])]).condition == "not_finite"


def test_reading_render_and_dict():
    r = step_conservation(
        [torch.ones(2, dtype=torch.float64)],
        [torch.zeros(2, dtype=torch.float64)],
        1.0,
        [torch.ones(2, dtype=torch.float64)],
        step=7,
    )
    d = r.to_dict("conservation/")
    assert d["conservation/error"] == 0.0 and d["conservation/refused"] == 0.0 and d["conservation/limited"] == 1.0
    # A float64 step that conserves to the last bit says so plainly: no "limited" in the words.
    assert r.status == "holds" and d["conservation/holds"] == 1.0 and r.explain() == ""
    assert "step 7" in r.render() and "HOLDS (error <= floor" in r.render() and "LIMITED" not in r.render()


def test_status_words_and_the_words_of_a_violation():
    """`holds` / `holds within precision` / `violated`, and a violation named with its figure, cause and fix."""
    g = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)]
    before = [torch.tensor([3.0, 1.0, -1.0], dtype=torch.float64)]
    lr = 0.1
    honest = step_conservation(before, [before[0] - lr * g[0]], lr, g, source="credit_parts")
    assert honest.status == "holds" and honest.scale == pytest.approx(1.0, abs=1e-12)
    twice = step_conservation(before, [before[0] - 2 * lr * g[0]], lr, g, source="credit_parts", step=3)
    assert twice.status == "violated" and twice.scale == pytest.approx(2.0, abs=1e-12)
    words = twice.explain()
    for part in (
        "step conservation violated at step 3",
        "relative error of 1",
        "2 × Σ g_S",
        "wrong normaliser",
        "loss = self.credit_terms(batch).terms.sum()",
    ):
        assert part in words, (part, words)
    # A different direction (a term left out): not a multiple, and said so.
    other = [g[0] + torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64)]
    left_out = step_conservation(before, [before[0] - lr * other[0]], lr, g, source="credit_parts")
    assert left_out.violated and "not a multiple of Σ g_S" in left_out.explain()
    # bfloat16 weights and a tiny step: the floor is coarser than the tolerance, so an honest step holds within precision.
    b16 = [before[0].to(torch.bfloat16)]
    tiny = step_conservation(b16, [(b16[0].double() - 1e-4 * g[0]).to(torch.bfloat16)], 1e-4, g, tolerance=1e-4)
    assert tiny.update_precision_floor > 1e-4 and tiny.status == "holds within precision", tiny.render()
    assert "HOLDS WITHIN PRECISION" in tiny.render()


def test_the_audit_parts_rounding_joins_the_floor_up_to_rounding_only():
    g = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)]
    before = [torch.tensor([3.0, 1.0, -1.0], dtype=torch.float64)]
    # Σ g_S off .grad by 1e-3 relative (bfloat16 parts): the update is .grad's, the parts are g.
    applied = [g[0] * (1 + 1e-3)]
    after = [before[0] - 0.1 * applied[0]]
    plain = step_conservation(before, after, 0.1, g, source="credit_parts")
    assert plain.violated  # the float64 floor alone cannot explain 1e-3
    kw = dict(source="credit_parts", parts_error=1e-3, parts_dtype=torch.bfloat16)
    bf = step_conservation(before, after, 0.1, g, **kw)
    assert bf.parts_floor == pytest.approx(1e-3 / (1 - 1e-3)) and bf.holds and bf.status == "holds within precision"
    # The same gap claimed by float32 parts is beyond their rounding: it is not added, the violation stays.
    assert step_conservation(
        before, after, 0.1, g, source="credit_parts", parts_error=1e-3, parts_dtype=torch.float32
    ).violated
    # Parts that do not add up (error 0.5) are a finding, not rounding; a wrong normaliser still fires in bfloat16.
    assert step_conservation(
        before, after, 0.1, g, source="credit_parts", parts_error=0.5, parts_dtype=torch.bfloat16
    ).violated
    assert step_conservation(before, [before[0] - 0.2 * g[0]], 0.1, g, **kw).violated
    # Held against `.grad`, the audit's error is not part of the reading.
    assert step_conservation(before, after, 0.1, g, parts_error=1e-3, parts_dtype=torch.bfloat16).parts_floor == 0.0


def test_mixed_dtypes_round_each_tensor_in_its_own_dtype():
    rng = np.random.default_rng(1)
    lr = 1e-6
    before = [torch.tensor(rng.normal(size=500) * 4), torch.tensor(rng.normal(size=500).astype(np.float32) * 4)]
    grads = [torch.tensor(rng.normal(size=500)), torch.tensor(rng.normal(size=500).astype(np.float32))]
    after = [(b.double() - lr * g.double()).to(b.dtype) for b, g in zip(before, grads)]
    r = step_conservation(before, after, lr, grads)
    naive = _numpy_error(before, after, [lr, lr], grads)
    assert r.relative_error == pytest.approx(naive, rel=1e-9) and naive <= r.update_precision_floor
    assert r.dtype == "float32"
    # only the float32 tensor is rounded coarsely: its share of the floor, by numpy
    a32 = after[1].double().numpy()
    g_norm = np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    u32, u64 = 2.0**-24, 2.0**-53
    a64 = after[0].numpy()
    expect = np.sqrt((u64 / lr) ** 2 * (a64 @ a64) + (u32 / lr) ** 2 * (a32 @ a32)) / g_norm + 2 * u32
    assert r.update_precision_floor == pytest.approx(expect, rel=1e-12)


@pytest.mark.slow
def test_cost_benchmark_runs_on_a_small_size():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        str(root / "benchmarks" / "conservation_cost.py"),
        "--layers",
        "1",
        "--embd",
        "32",
        "--T",
        "8",
        "--repeats",
        "2",
    ]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "read (step_conservation) / plain step:" in r.stdout and "last reading: error" in r.stdout


@pytest.mark.parametrize("name", ["lens_callbacks.credit.readings.conservation", "lens_callbacks.metrics.conservation"])
def test_doctests(name):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(name))
    assert res.attempted > 0 and res.failed == 0
