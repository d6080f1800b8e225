"""``global_report`` on W simulated ranks (threads with a barrier as the collectives), against one process.

Reference: a single-process ``disintegrate`` of the ranks' batches concatenated, terms divided by W (the
rank mean DDP applies), and per-part gradients by a plain ``torch.autograd.grad`` loop in numpy float64.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.readings.distributed import Collectives, global_report
from lens_callbacks.refusal import Refusal


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.double()

    def credit_terms(self, batch) -> CreditTerms:
        tokens, adv = batch  # [B, T+1], [B]
        lp = torch.log_softmax(self.out(torch.tanh(self.emb(tokens[:, :-1]))), -1)  # [B, T, V]
        lp = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T]
        terms = -adv[:, None] * lp / lp.numel()  # [B, T]
        B, T = terms.shape
        return CreditTerms(terms, torch.ones(B, T, dtype=torch.bool), torch.arange(B), torch.arange(B))


def _batch(rank: int, rows: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randint(0, 7, (rows, 5), generator=g), torch.randn(rows, generator=g, dtype=torch.float64)


class World:
    """All-gather and all-reduce across threads, one thread per rank."""

    def __init__(self, W: int) -> None:
        self.W, self.barrier, self.slots = W, threading.Barrier(W, timeout=60), [None] * W

    def collectives(self, rank: int) -> Collectives:
        def gather(x):
            self.slots[rank] = x.clone()
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()
            return out

        return Collectives(rank, self.W, gather, lambda x: gather(x).sum(0))


def _run_ranks(W, local_of):
    world, out, errors = World(W), [None] * W, []
    # The local audits run here, one after another: functional_call swaps the shared module's parameters,
    # which is not thread-safe. Only the collectives run on the rank threads.
    locals_ = [local_of(r) for r in range(W)]

    def work(r):
        try:
            local, applied, failure = locals_[r]
            out[r] = global_report(local, applied, world.collectives(r), failure=failure, keep_grads=True)
        except Exception as err:  # pragma: no cover - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def _full_grad(m, batch):
    params = [p for p in m.parameters()]
    return list(torch.autograd.grad(m.credit_terms(batch).terms.sum(), params))


@pytest.mark.parametrize("engine", ["reference", "ghost"])
@pytest.mark.parametrize("rows", [(3, 2), (2, 2, 4)])
def test_global_report_equals_a_single_process_audit_of_the_concatenated_batch(rows, engine):
    W = len(rows)
    m = Toy()
    batches = [_batch(r, n) for r, n in enumerate(rows)]
    per_rank = [_full_grad(m, b) for b in batches]
    applied = [sum(gs[i] for gs in per_rank) / W for i in range(len(per_rank[0]))]  # what DDP's .grad holds

    def local_of(r):
        local = disintegrate(m, batches[r], dtype="float64", keep_grads=True, project_onto=applied, engine=engine)
        return local, applied, None

    reports = _run_ranks(W, local_of)
    assert all(rep.engine == engine for rep in reports)
    for rep in reports[1:]:
        assert rep.part_names == reports[0].part_names and rep.projected_share == reports[0].projected_share
    rep = reports[0]

    def concat(_):
        ts = [m.credit_terms(b) for b in batches]
        terms = torch.cat([t.terms for t in ts]) / W  # [ΣB, T]
        n = terms.shape[0]
        return CreditTerms(terms, torch.cat([t.trained for t in ts]), torch.arange(n), torch.arange(n))

    ref = disintegrate(m, None, dtype="float64", terms_fn=concat, reference_grads=applied)
    assert rep.part_names == tuple(f"r{r}/rollout_{k}" for r, n in enumerate(rows) for k in range(n))
    np.testing.assert_allclose(rep.projected_share, ref.projected_share, rtol=0, atol=1e-14)
    np.testing.assert_allclose(rep.norm_share, ref.norm_share, rtol=0, atol=1e-14)
    np.testing.assert_allclose(rep.part_norm, ref.part_norm, rtol=1e-13)
    assert rep.cancellation == pytest.approx(ref.cancellation, rel=1e-13)
    assert rep.full_grad_norm == pytest.approx(ref.full_grad_norm, rel=1e-13)
    assert rep.loss == pytest.approx(ref.loss, rel=1e-13)
    assert rep.n_trained == ref.n_trained
    assert abs(rep.share_sum - 1.0) < 1e-14 and rep.conservation_error < 1e-14 and rep.grad_match < 1e-14

    # Independent of the engine: per-row gradients by a plain loop, shares against the applied gradient.
    params = list(m.parameters())
    flat = lambda gs: np.concatenate([g.detach().numpy().ravel() for g in gs])  # noqa: E731
    gbar = flat(applied)
    naive = []
    for b in batches:
        terms = m.credit_terms(b).terms
        for k in range(terms.shape[0]):
            naive.append(
                flat(torch.autograd.grad(terms[k].sum() / W, params, retain_graph=True)) @ gbar / (gbar @ gbar)
            )
    np.testing.assert_allclose(rep.projected_share, naive, rtol=0, atol=1e-14)
    # keep_grads: the global Σ parts is the applied gradient, identical on every rank.
    np.testing.assert_allclose(flat(rep.grads.parts_sum), gbar, rtol=0, atol=1e-15)


def test_a_rank_without_a_reading_makes_every_rank_refuse():
    m = Toy()
    batches = [_batch(r, 2) for r in range(2)]
    applied = _full_grad(m, batches[0])

    def local_of(r):
        if r == 1:
            return None, applied, "ValueError: no terms"
        return disintegrate(m, batches[0], dtype="float64", keep_grads=True, project_onto=applied), applied, None

    a, b = _run_ranks(2, local_of)
    assert isinstance(a, Refusal) and isinstance(b, Refusal)
    assert a.condition == b.condition == "credit_audit_global" and "[1]" in a.reason
    assert "no terms" in b.reason


@pytest.mark.parametrize("engine", ["reference", "ghost"])
def test_a_rank_with_zero_gradient_keeps_its_zero_parts(engine):
    m = Toy()
    tokens, adv = _batch(0, 2)
    batches = [(tokens, adv), (tokens, torch.zeros_like(adv))]  # rank 1: every advantage 0
    applied = [g / 2 for g in _full_grad(m, batches[0])]

    def local_of(r):
        return (
            disintegrate(m, batches[r], dtype="float64", keep_grads=True, project_onto=applied, engine=engine),
            applied,
            None,
        )

    rep = _run_ranks(2, local_of)[0]
    assert rep.engine == engine
    assert rep.ok and abs(rep.share_sum - 1.0) < 1e-14
    assert rep.projected_share[2:] == (0.0, 0.0)


def test_project_onto_must_align_with_the_parameters():
    m = Toy()
    with pytest.raises(ValueError, match="`project_onto` must hold one tensor per trainable parameter"):
        disintegrate(m, _batch(0, 2), project_onto=[torch.zeros(3)])
