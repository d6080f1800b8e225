"""Credit against the applied update, against a plain loop: per-part ``autograd.grad`` dotted with Δθ.

A real optimizer step (SGD, SGD with momentum, Adam) on the examples' GPT-2 over a multi-turn batch;
the reference rebuilds the objective on a copy of the module at θ_before and takes one backward per
part, then dots each part's gradient with ``θ_before − θ_after`` in float64.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lens_callbacks.credit import CreditTerms, batch_from_trajectories, disintegrate, turn_segments
from lens_callbacks.credit.inputs.trajectories import Trajectory, Turn
from lens_callbacks.credit.readings.update_share import UpdateShareReport, update_shares

pytest.importorskip("transformers")

from lens_callbacks.examples.grpo_tools.env import build_tokenizer  # noqa: E402
from lens_callbacks.examples.tiny_policy import tiny_gpt2  # noqa: E402


class TurnPolicy(nn.Module):
    """``terms[k, t] = −A_k · log π(y_{k,t}) · trained[k, t] / N`` over a multi-turn rollout batch."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        tok = build_tokenizer()
        self.policy = tiny_gpt2(
            vocab_size=len(tok),
            n_positions=64,
            n_layer=1,
            n_embd=16,
            n_head=2,
            dropout=dropout,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            seed=4,
            dtype="float64",
        ).train()

    def credit_terms(self, batch) -> CreditTerms:
        b, segments, adv = batch
        logits = self.policy(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
        ).logits  # [B, T, V]
        logp = F.pad(
            torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1), (1, 0)
        )  # [B, T]
        terms = -(adv.to(logp.dtype)[:, None] * logp) * b.trained.to(logp.dtype) / b.trained.sum()  # [B, T]
        segment, names = turn_segments(segments, "turn", rollout=b.rollout)
        return CreditTerms(terms, b.trained, b.rollout, b.group, segment, names)


def _batch():
    turns = [
        (
            Turn("user", "3 + 4 ="),
            Turn("assistant", "calc 3 + 4 <eot>"),
            Turn("tool", "7"),
            Turn("assistant", "7 <eot>"),
        ),
        (Turn("user", "2 + 5 ="), Turn("assistant", "6 <eot>")),
        (
            Turn("user", "1 + 1 ="),
            Turn("assistant", "calc 1 <eot>"),
            Turn("tool", "1"),
            Turn("assistant", "calc 1 + 1 <eot>"),
            Turn("tool", "2"),
            Turn("assistant", "2 <eot>"),
        ),
    ]
    trajs = [Trajectory(t, reward=float(k), group=0, rollout=k) for k, t in enumerate(turns)]
    b, seg = batch_from_trajectories(build_tokenizer(), trajs)
    return b, seg, torch.tensor([-1.0, 0.2, 0.8], dtype=torch.float64)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _step(m, batch, opt):
    opt.zero_grad()
    m.credit_terms(batch).terms.sum().backward()
    opt.step()


def _naive_update_shares(m_before, batch, partition_name, after):
    """Per-part gradients by ``autograd.grad`` in a plain loop, dotted with Δθ (float64)."""
    names = [n for n, p in m_before.named_parameters() if p.requires_grad]
    params = [p for n, p in m_before.named_parameters() if p.requires_grad]
    delta = [p.detach() - after[n].detach() for n, p in zip(names, params)]
    terms = m_before.credit_terms(batch)
    from lens_callbacks.credit import resolve_partition

    part = resolve_partition(partition_name)(terms)
    dots = []
    for i in range(part.n_parts):
        loss = sum(terms.terms[k, t] for k, t in (part.ids == i).nonzero().tolist()) if (part.ids == i).any() else None
        if loss is None:
            dots.append(0.0)
            continue
        gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        dots.append(math.fsum(float((g * d).sum()) for g, d in zip(gs, delta) if g is not None))
    gs = torch.autograd.grad(terms.terms.sum(), params, allow_unused=True)
    full = math.fsum(float((g * d).sum()) for g, d in zip(gs, delta) if g is not None)
    return part.names, [d / full for d in dots], full


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("partition", ["by_turn", "by_rollout"])
def test_update_shares_sum_to_one_and_equal_the_naive_loop(kind, partition):
    m = TurnPolicy()
    batch = _batch()
    opt = _optimizer(kind, m.parameters())
    for _ in range(2):  # momentum and Adam's moments are non-trivial by the audited step
        _step(m, batch, opt)
    m_before = copy.deepcopy(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    _step(m, batch, opt)
    after = {n: p.detach().clone() for n, p in m.named_parameters()}
    r = update_shares(m, batch, partition, before, dtype="float64")
    names, expect, full = _naive_update_shares(m_before, batch, partition, after)
    assert r.ok and r.part_names == names
    assert abs(r.share_sum - 1.0) <= 1e-10
    assert max(abs(a - b) for a, b in zip(r.update_share, expect)) <= 1e-10
    assert abs(r.update_dot - full) <= 1e-10 * abs(full)
    assert r.conservation_error <= 1e-10
    for n, p in m.named_parameters():  # read-only: the live parameters are still θ_after
        assert torch.equal(p, after[n])
    if kind == "sgd":
        assert abs(r.update_grad_cosine - 1.0) <= 1e-10
    else:  # the preconditioner / momentum turned the step away from g
        assert r.update_grad_cosine < 1.0 - 1e-6


@pytest.mark.parametrize("partition", ["by_turn", "by_rollout"])
def test_plain_sgd_update_shares_equal_projected_shares(partition):
    m = TurnPolicy(dropout=0.1)
    batch = _batch()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    m_before = copy.deepcopy(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    torch.manual_seed(7)
    state = torch.get_rng_state()
    _step(m, batch, opt)  # the training forward draws its dropout masks from `state`
    torch.set_rng_state(state)
    r = update_shares(m, batch, partition, before, dtype="float64")
    torch.set_rng_state(state)
    proj = disintegrate(m_before, batch, partition, dtype="float64")
    assert max(abs(a - b) for a, b in zip(r.update_share, proj.projected_share)) <= 1e-10
    # and not by accident: Adam's update splits differently
    m2 = copy.deepcopy(m_before)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    torch.set_rng_state(state)
    _step(m2, batch, opt2)
    torch.set_rng_state(state)
    r2 = update_shares(m2, batch, partition, before, dtype="float64")
    assert max(abs(a - b) for a, b in zip(r2.update_share, proj.projected_share)) > 1e-4


def test_rng_grad_and_parameters_untouched():
    m = TurnPolicy(dropout=0.1)
    batch = _batch()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
            p.grad = torch.randn_like(p)
    snap = {n: (p.detach().clone(), p.grad.clone()) for n, p in m.named_parameters()}
    rng = torch.get_rng_state()
    r = update_shares(m, batch, "by_turn", before, dtype="float64")
    assert r.ok and torch.equal(torch.get_rng_state(), rng)
    for n, p in m.named_parameters():
        assert torch.equal(p, snap[n][0]) and torch.equal(p.grad, snap[n][1])


def test_no_update_is_undefined_with_a_reason():
    m = TurnPolicy()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    r = update_shares(m, _batch(), "by_turn", before, dtype="float64")
    assert not r.ok and "zero" in r.reason and all(math.isnan(u) for u in r.update_share)
    assert r.to_dict("credit/")["credit/update_undefined"] == 1.0
    assert "UNDEFINED" in r.render()


def test_missing_parameters_raise():
    m = TurnPolicy()
    with pytest.raises(ValueError, match="`theta_before` must hold every trainable parameter"):
        update_shares(m, _batch(), "by_turn", {}, dtype="float64")


def test_report_dict_and_render():
    r = UpdateShareReport(("a", "b"), (1.5, -0.5), (3.0, -1.0), 2.0, 1.0, 4.0, 1e-17, "float64", 7, "by_rollout")
    d = r.to_dict("credit/", max_parts=1)
    assert d["credit/update_share/a"] == 1.5 and "credit/update_share/b" not in d
    assert d["credit/update_share_sum"] == 1.0 and d["credit/update_grad_cosine"] == 0.5
    text = r.render()
    assert "update_share" in text and "-0.500000" in text and "cos(g, Δθ) 0.5000" in text


def test_doctests():
    import doctest

    from lens_callbacks.credit.readings import update_share

    res = doctest.testmod(update_share)
    assert res.attempted > 0 and res.failed == 0
