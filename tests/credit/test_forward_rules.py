"""The forward-mode rules for ``linear`` and ``log_softmax`` against torch's own forward-mode derivatives.

Reference: the same op on dual tensors outside :class:`ForwardRules` (torch's formulas), float64. Each rule
must agree to 1e-12 for tangents on any subset of its inputs, non-contiguous inputs, every entry point
(``torch.log_softmax``, ``Tensor.log_softmax``, ``F.log_softmax``, ``nn.Linear``), and hold the tangent
pass's peak below torch's formulas on a vocabulary-wide head.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

from lens_callbacks.credit.engines import forward_rules
from lens_callbacks.credit.engines.forward_rules import ForwardRules

TOL = 1e-12


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _jvp(fn, prims, tans, rules):
    """``fn`` on dual tensors (None tangent: a plain tensor), with or without the rules."""
    with fwAD.dual_level():
        args = [p if t is None else fwAD.make_dual(p, t) for p, t in zip(prims, tans)]
        if rules:
            with ForwardRules() as mode:
                o, t = fwAD.unpack_dual(fn(*args))  # read inside the mode: a deferred tangent is formed here
        else:
            mode = None
            o, t = fwAD.unpack_dual(fn(*args))
        return o.clone(), (t.clone() if t is not None else None), mode


@pytest.mark.parametrize("which", [w for n in (1, 2, 3) for w in itertools.combinations("xwb", n)])
@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (4,)])
def test_linear_equals_torchs_forward_mode(which, shape):
    x, w, b = _randn(*shape, seed=1), _randn(6, 4, seed=2), _randn(6, seed=3)
    tans = [_randn(*t.shape, seed=10 + i) if n in which else None for i, (n, t) in enumerate(zip("xwb", (x, w, b)))]
    o_ref, t_ref, _ = _jvp(F.linear, (x, w, b), tans, rules=False)
    o, t, mode = _jvp(F.linear, (x, w, b), tans, rules=True)
    assert mode.rule_calls == {"linear": 1}
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL


def test_linear_through_a_module_with_a_non_contiguous_input_and_no_bias():
    lin = nn.Linear(4, 6, bias=False).double()
    x = _randn(3, 5, 4).transpose(0, 1)  # [5, 3, 4], not contiguous
    dx, dw = _randn(5, 3, 4, seed=4), _randn(6, 4, seed=5)

    def fn(x, w):
        return torch.func.functional_call(lin, {"weight": w}, (x,))

    o_ref, t_ref, _ = _jvp(fn, (x, lin.weight.detach()), (dx, dw), rules=False)
    o, t, mode = _jvp(fn, (x, lin.weight.detach()), (dx, dw), rules=True)
    assert mode.rule_calls == {"linear": 1}
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL


ENTRIES = {
    "torch.log_softmax": lambda x, dim: torch.log_softmax(x, dim),
    "Tensor.log_softmax": lambda x, dim: x.log_softmax(dim),
    "F.log_softmax": lambda x, dim: F.log_softmax(x, dim=dim),
    "F.log_softmax(dtype)": lambda x, dim: F.log_softmax(x.float(), dim=dim, dtype=torch.float64),
    "F.log_softmax(positional)": lambda x, dim: F.log_softmax(x.float(), dim, 3, torch.float64),
    "torch.log_softmax(dtype positional)": lambda x, dim: torch.log_softmax(x.float(), dim, torch.float64),
    "Tensor.log_softmax(dtype positional)": lambda x, dim: x.float().log_softmax(dim, torch.float64),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_log_softmax_equals_torchs_forward_mode(entry, dim, monkeypatch):
    monkeypatch.setattr(forward_rules, "SLICE_ELEMENTS", 7)  # many slices, one that does not divide
    x = _randn(3, 9, 11)[:, 1:]  # [3, 8, 11], sliced as `logits[:, :-1]` is
    dx = _randn(3, 9, 11, seed=6)[:, 1:]
    fn = ENTRIES[entry]
    o_ref, t_ref, _ = _jvp(lambda a: fn(a, dim), (x,), (dx,), rules=False)
    o, t, mode = _jvp(lambda a: fn(a, dim), (x,), (dx,), rules=True)
    assert mode.rule_calls == {"log_softmax": 1}
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL


def test_ops_without_tangents_run_torchs_op():
    x, w = _randn(5, 4), _randn(6, 4)
    linear, log_softmax = F.linear(x, w), torch.log_softmax(x, -1)  # torch's ops, outside the mode
    with ForwardRules() as mode:
        assert torch.equal(F.linear(x, w), linear)
        assert torch.equal(torch.log_softmax(x, -1), log_softmax)
    assert mode.rule_calls == {}


class _Head(nn.Module):
    """A vocabulary-wide head and its log-softmax: where the tangent pass's peak is."""

    def __init__(self, d=16, V=2048):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, d), nn.Linear(d, V, bias=False)

    def forward(self, ids):
        logits = self.head(torch.tanh(self.emb(ids)))[:, :-1]  # [B, T-1, V]
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]


def test_the_rules_hold_the_head_below_torchs_peak(monkeypatch, bench_script):
    # peak bytes alive at once inside a call: the measurement behind docs/performance.md's memory columns
    peak = bench_script("credit_cost").peak_alloc_bytes
    monkeypatch.setattr(
        forward_rules, "SLICE_ELEMENTS", 1 << 16
    )  # an eighth of these logits, as 64 MiB is of real ones
    torch.manual_seed(0)
    m = _Head()
    ids = torch.randint(0, 2048, (4, 65))
    logits = 4 * 64 * 2048 * 4  # bytes of one float32 [B, T-1, V]
    tangents = {n: torch.randn_like(p) for n, p in m.named_parameters()}

    def run(rules):
        def go():
            with fwAD.dual_level(), torch.no_grad():
                params = {n: fwAD.make_dual(p.detach(), tangents[n]) for n, p in m.named_parameters()}
                ctx = ForwardRules() if rules else contextlib.nullcontext()
                with ctx:
                    out = torch.func.functional_call(m, params, (ids,))
                return fwAD.unpack_dual(out).tangent.clone()

        return go

    with_rules, without = peak(run(True)), peak(run(False))
    # torch's formulas hold a second and third logits-sized buffer beside the result, and the log-softmax's
    # tangent; the rules hold the logits, their tangent and the log-softmax, whose tangent is read at the
    # taken tokens only (the gather), plus one slice at a time
    assert with_rules <= without - 1.5 * logits, (with_rules / logits, without / logits)
    assert with_rules <= 3.5 * logits, with_rules / logits
    t_rules, t_torch = run(True)(), run(False)()
    assert float((t_rules - t_torch).abs().max()) <= 1e-4  # float32: the same derivative


READERS = {
    "gather": lambda y, ids: y.gather(-1, ids),
    "torch.gather": lambda y, ids: torch.gather(y, 2, ids),
    "gather, other dim": lambda y, ids: y.gather(1, ids[:, :3].transpose(1, 2).clamp(max=7)),
    "entropy": lambda y, ids: (y.exp() * y).sum(-1),
    "index": lambda y, ids: y[..., 3],
    "stack": lambda y, ids: torch.stack([y, y])[1, ..., 2],
    "gather, then entropy": lambda y, ids: y.gather(-1, ids)[..., 0] + (y.exp() * y).sum(-1),
    "whole": lambda y, ids: y,  # read by unpack_dual inside the mode
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_deferred_log_softmax_reads_as_torchs_forward_mode(reader):
    """The log-softmax's tangent is applied where its result is read: at the picked entries by a gather along
    its dim, whole by any other op; every reading equals torch's own forward mode."""
    x = _randn(3, 9, 11)[:, 1:]  # [3, 8, 11], a view, as `logits[:, :-1]` is
    dx = _randn(3, 9, 11, seed=6)[:, 1:]
    ids = torch.randint(0, 11, (3, 8, 1), generator=torch.Generator().manual_seed(3))
    fn = READERS[reader]
    o_ref, t_ref, _ = _jvp(lambda a: fn(torch.log_softmax(a, -1), ids), (x,), (dx,), rules=False)
    o, t, mode = _jvp(lambda a: fn(torch.log_softmax(a, -1), ids), (x,), (dx,), rules=True)
    assert mode.rule_calls.get("gather", 0) == (
        1 if reader in ("gather", "torch.gather", "gather, then entropy") else 0
    )
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL


def test_a_deferred_log_softmax_refuses_a_write_by_name():
    x, dx = _randn(2, 5), _randn(2, 5, seed=1)
    with fwAD.dual_level(), ForwardRules():
        y = torch.log_softmax(fwAD.make_dual(x, dx), -1)
        with pytest.raises(forward_rules.DeferredWrite, match="mul_.*clone"):
            y.mul_(2.0)


def test_the_tangent_pass_names_a_write_into_a_log_softmax_as_unsupported():
    """(Unreachable by a trainable ``credit_terms`` — autograd's backward refuses the same write — but a
    forward-only one gets the forward-mode engine's named error, which ``engine="auto"`` hands over on.)"""
    from lens_callbacks.credit import CreditTerms
    from lens_callbacks.credit.engines.jvp import ForwardADUnsupportedError, terms_jvp

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 6).double()

        def credit_terms(self, batch=None):
            y = torch.log_softmax(self.lin(_randn(3, 5, 4)), -1)
            y.masked_fill_(torch.zeros_like(y, dtype=torch.bool), 0.0)  # a write into the log-softmax
            terms = y.gather(-1, torch.zeros(3, 5, 1, dtype=torch.long))[..., 0]
            return CreditTerms(
                terms, torch.ones(3, 5, dtype=torch.bool), torch.arange(3), torch.zeros(3, dtype=torch.long)
            )

    net = Net()
    with pytest.raises(ForwardADUnsupportedError, match="masked_fill_"):
        terms_jvp(net, None, {n: torch.ones_like(p) for n, p in net.named_parameters()}, dtype="float64")
