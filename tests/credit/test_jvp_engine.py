"""The forward-mode engine against the reference engine (one backward per part), float64.

Policies: the examples' GPT-2 (eager attention, dropout on, tied embeddings) and a transformers Llama
(RMSNorm, rotary, grouped KV heads, left padding), on multi-turn rollout batches built with
``batch_from_trajectories``; partitions ``by_turn``/``by_segment``/``by_role`` and Hypothesis-drawn ones.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lens_callbacks.credit import CreditTerms, Partition, batch_from_trajectories, by_turn, disintegrate, turn_segments
from lens_callbacks.credit.engines.jvp import ForwardADUnsupportedError, disintegrate_jvp, terms_jvp
from lens_callbacks.credit.inputs.trajectories import Trajectory, Turn

pytest.importorskip("transformers")

from lens_callbacks.examples.grpo_tools.env import build_tokenizer  # noqa: E402
from lens_callbacks.examples.tiny_policy import tiny_gpt2  # noqa: E402
from tests.credit.test_ghost_engine import llama_float64  # noqa: E402,F401  (transformers' float32 spots patched)

TOL = 1e-12


def _trajectories(n_rows: int = 3, n_rounds: int = 3, seed: int = 0) -> list[Trajectory]:
    """Episodes ``user → (assistant → tool)* → assistant`` of different lengths, 2 per group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_rows):
        turns = [Turn("user", f"{int(torch.randint(0, 9, (1,), generator=g))} + {k} =")]
        for j in range(n_rounds - (k % 2)):
            a, b = (int(x) for x in torch.randint(0, 9, (2,), generator=g))
            turns.append(Turn("assistant", f"calc {a} + {b} <eot>"))
            turns.append(Turn("tool", str(a + b)))
        turns.append(Turn("assistant", f"{k + 3} <eot>"))
        out.append(Trajectory(tuple(turns), reward=float(k % 2), group=k // 2, rollout=k))
    return out


class TurnPolicy(nn.Module):
    """``terms[k, t] = −A_k · log π(y_{k,t}) · trained[k, t] / N`` over a multi-turn rollout batch."""

    def __init__(self, policy: nn.Module, segment_by: str = "turn") -> None:
        super().__init__()
        self.policy = policy
        self.segment_by = segment_by

    def credit_terms(self, batch) -> CreditTerms:
        b, segments, adv = batch
        logits = self.policy(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
        ).logits  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        logp = F.pad(logp, (1, 0))  # [B, T]
        n = b.trained.sum().clamp(min=1)
        terms = -(adv.to(logp.dtype)[:, None] * logp) * b.trained.to(logp.dtype) / n  # [B, T]
        segment, names = turn_segments(segments, self.segment_by, rollout=b.rollout)
        return CreditTerms(terms, b.trained, b.rollout, b.group, segment, names)


def _batch(padding_side: str = "right", seed: int = 0, n_rows: int = 3, n_rounds: int = 3):
    tok = build_tokenizer()
    b, seg = batch_from_trajectories(tok, _trajectories(n_rows, n_rounds, seed), padding_side=padding_side)
    adv = torch.linspace(-1.0, 1.3, b.shape[0], dtype=torch.float64)  # [B]
    return b, seg, adv


def gpt2_policy(dropout: float = 0.1, segment_by: str = "turn", seed: int = 0) -> TurnPolicy:
    tok = build_tokenizer()
    policy = tiny_gpt2(
        vocab_size=len(tok),
        n_positions=128,
        n_layer=2,
        n_embd=16,
        n_head=2,
        dropout=dropout,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        seed=seed,
        dtype="float64",
    )
    return TurnPolicy(policy.train(), segment_by)


def llama_policy(attn: str = "eager", segment_by: str = "turn") -> TurnPolicy:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = LlamaForCausalLM(cfg).double()
    return TurnPolicy(model.train(), segment_by)


def _same_shares(a, b, tol=TOL) -> None:
    assert a.part_names == b.part_names
    diff = max(abs(x - y) for x, y in zip(a.projected_share, b.projected_share))
    assert diff <= tol, diff


@pytest.mark.parametrize(
    "segment_by,partition", [("turn", "by_turn"), ("turn", "by_segment"), ("turn_index", "by_segment")]
)
def test_gpt2_with_dropout_equals_reference(segment_by, partition):
    m = gpt2_policy(0.1, segment_by)
    batch = _batch("right")
    torch.manual_seed(11)
    ref = disintegrate(m, batch, partition, dtype="float64")
    torch.manual_seed(11)
    jvp = disintegrate_jvp(m, batch, partition, dtype="float64")
    assert ref.n_parts >= 3 and ref.reason is None and jvp.reason is None
    _same_shares(jvp, ref)
    assert jvp.conservation_error <= 1e-12
    assert (
        abs(jvp.loss - ref.loss) <= 1e-15 and abs(jvp.full_grad_norm - ref.full_grad_norm) <= 1e-12 * ref.full_grad_norm
    )
    # Dropout is live: another random state gives other shares, so agreement above is not vacuous.
    torch.manual_seed(12)
    other = disintegrate(m, batch, partition, dtype="float64")
    assert max(abs(x - y) for x, y in zip(other.projected_share, ref.projected_share)) > 1e-6


def test_projected_readings_leave_norms_undefined_but_the_report_defined():
    m = gpt2_policy(0.0)
    r = disintegrate_jvp(m, _batch(), "by_turn", dtype="float64")
    assert r.ok and r.reason is None
    assert all(math.isnan(x) for x in r.norm_share + r.part_norm) and math.isnan(r.cancellation)
    assert abs(r.share_sum - 1.0) <= 1e-12
    assert "nan" in r.render()


def _patch_llama_float64(monkeypatch) -> None:
    """LlamaRMSNorm and eager softmax compute in float32 on float64 weights: run them in the input dtype."""
    from transformers.models.llama import modeling_llama as ml

    def rms_forward(self, h):
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = F.dropout(torch.softmax(w, dim=-1), p=dropout, training=module.training)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_forward)
    monkeypatch.setattr(ml, "eager_attention_forward", eager)


@pytest.mark.parametrize("float64_patched", [True, False])
def test_llama_left_padding_equals_reference(monkeypatch, float64_patched):
    if float64_patched:
        _patch_llama_float64(monkeypatch)
    m = llama_policy()
    # Stock eager attention adds float64's lowest value as the mask and casts to float32: a fully
    # masked (left-padding) query row becomes all -inf and its softmax NaN, in both engines alike.
    batch = _batch("left" if float64_patched else "right")
    if float64_patched:
        assert batch[0].attention_mask[:, 0].min() == 0  # some row is left-padded
    ref = disintegrate(m, batch, "by_turn", dtype="float64")
    jvp = disintegrate_jvp(m, batch, "by_turn", dtype="float64")
    # Stock Llama rounds to float32 inside RMSNorm and softmax: forward and reverse mode then round
    # different quantities, so the two agree to float32 precision only (the arithmetic differs).
    tol = TOL if float64_patched else 1e-6
    assert ref.reason is None and jvp.reason is None
    _same_shares(jvp, ref, tol)
    assert jvp.conservation_error <= (1e-12 if float64_patched else 1e-6)


def test_frozen_parameters_are_left_out_of_both_engines():
    m = gpt2_policy(0.0)
    for name, p in m.named_parameters():
        if "wpe" in name or ".h.0." in name:
            p.requires_grad_(False)
    batch = _batch()
    ref = disintegrate(m, batch, "by_turn", dtype="float64")
    jvp = disintegrate_jvp(m, batch, "by_turn", dtype="float64", readings="all")
    _same_shares(jvp, ref)
    assert abs(jvp.full_grad_norm - ref.full_grad_norm) <= 1e-12 * ref.full_grad_norm


@pytest.mark.parametrize("readings", ["all", "shares"])
def test_all_readings_equal_the_reference_in_every_field(readings):
    m = gpt2_policy(0.1)
    batch = _batch("right")
    torch.manual_seed(5)
    ref = disintegrate(m, batch, "by_turn", dtype="float64")
    torch.manual_seed(5)
    jvp = disintegrate_jvp(m, batch, "by_turn", dtype="float64", readings=readings)
    for field in ("projected_share", "norm_share", "part_norm"):
        a, b = getattr(jvp, field), getattr(ref, field)
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b)) <= TOL, field
    for field in ("cancellation", "conservation_error", "full_grad_norm", "loss"):
        assert abs(getattr(jvp, field) - getattr(ref, field)) <= TOL * max(1.0, abs(getattr(ref, field))), field
    for field in ("part_names", "dtype", "n_trained", "partition", "reason", "grad_match"):
        assert getattr(jvp, field) == getattr(ref, field), field


_HYP_MODEL = None


def _hyp_model():
    global _HYP_MODEL
    if _HYP_MODEL is None:
        _HYP_MODEL = (gpt2_policy(0.1), _batch("right", n_rows=2, n_rounds=2))
    return _HYP_MODEL


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_random_partitions_inside_rows_equal_reference(m, seed):
    module, batch = _hyp_model()
    trained = batch[0].trained  # [B, T]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m, trained.shape, generator=g)  # [B, T]
    ids[~trained] = -1
    part = Partition(ids, tuple(f"p{i}" for i in range(m)))
    torch.manual_seed(seed % 1000)
    ref = disintegrate(module, batch, part, dtype="float64")
    torch.manual_seed(seed % 1000)
    jvp = disintegrate_jvp(module, batch, part, dtype="float64")
    _same_shares(jvp, ref)


def test_float32_agrees_to_float32_precision_and_module_is_untouched():
    m = gpt2_policy(0.1).float()
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in m.named_parameters()}
    batch = _batch()
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    jvp = disintegrate_jvp(m, batch, "by_turn", dtype="float32", reference_grads="grad")
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]) and p.dtype == torch.float32
    ref = disintegrate(m, batch, "by_turn", dtype="float64")
    _same_shares(jvp, ref, 1e-5)
    assert jvp.dtype == "float32" and jvp.conservation_error < 1e-5
    assert jvp.grad_match is not None and jvp.grad_match > 0.1  # random .grad is not this gradient


def test_terms_jvp_equals_the_gradient_dotted_with_the_direction():
    m = gpt2_policy(0.0)
    batch = _batch()
    params = {n: p for n, p in m.named_parameters()}
    g = torch.Generator().manual_seed(1)
    v = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}
    _, tangent = terms_jvp(m, batch, v, dtype="float64")
    terms = m.credit_terms(batch).terms  # [B, T]
    k, t = (int(x) for x in batch[0].trained.nonzero()[3])
    grads = torch.autograd.grad(terms[k, t], list(params.values()), allow_unused=True)
    expect = math.fsum(float((gr * v[n]).sum()) for n, gr in zip(params, grads) if gr is not None)
    assert abs(float(tangent[k, t]) - expect) <= 1e-12 * max(1.0, abs(expect))


def test_zero_gradient_is_an_undefined_reading_not_an_exception():
    m = gpt2_policy(0.0)
    b, seg, adv = _batch()
    r = disintegrate_jvp(m, (b, seg, torch.zeros_like(adv)), "by_turn", dtype="float64")
    assert r.reason is not None and "zero" in r.reason
    assert all(math.isnan(x) for x in r.projected_share)


def test_a_stock_sdpa_llama_takes_the_attention_rule(llama_float64):
    # transformers' default attention: torch's fused kernel has no forward mode, the engine's rule covers it
    batch = _batch()
    sdpa, eager = llama_policy(attn="sdpa"), llama_policy(attn="eager")
    got = disintegrate_jvp(sdpa, batch, "by_turn", dtype="float64")
    _same_shares(got, disintegrate(sdpa, batch, "by_turn", dtype="float64", engine="reference"), 1e-12)
    _same_shares(got, disintegrate_jvp(eager, batch, "by_turn", dtype="float64"), 1e-12)


class _NoForwardRule(torch.autograd.Function):
    """A fused kernel with a backward and no forward-mode rule (as flash-attention-2)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_an_attention_kernel_without_a_forward_rule_is_a_clear_error():
    m = gpt2_policy(0.0)
    inner = m.credit_terms

    def fused(batch):
        t = inner(batch)
        t.terms = _NoForwardRule.apply(t.terms)
        return t

    with pytest.raises(ForwardADUnsupportedError, match="flash_attention_2.*attn_implementation='sdpa'"):
        disintegrate_jvp(m, _batch(), "by_turn", dtype="float64", terms_fn=fused)


def test_bad_readings_and_partition_raise():
    m = gpt2_policy(0.0)
    with pytest.raises(ValueError, match="`readings` must be one of"):
        disintegrate_jvp(m, _batch(), "by_turn", readings="norms")
    b, seg, adv = _batch()
    bad = Partition(torch.zeros_like(b.trained, dtype=torch.long), ("all",))  # covers untrained positions
    with pytest.raises(ValueError, match="untrained position"):
        disintegrate_jvp(m, (b, seg, adv), bad)


def test_by_turn_gives_zero_shares_to_untrained_turns():
    m = gpt2_policy(0.0)
    batch = _batch()
    r = disintegrate_jvp(m, batch, by_turn, dtype="float64")
    for name, s in zip(r.part_names, r.projected_share):
        if not name.endswith(":assistant"):
            assert s == 0.0, name


def test_doctests():
    import doctest

    from lens_callbacks.credit.engines import jvp

    res = doctest.testmod(jvp)
    assert res.attempted > 0 and res.failed == 0


def test_without_preserve_rng_the_stream_advances_as_one_forward_would():
    m = gpt2_policy(0.1)
    batch = _batch()
    torch.manual_seed(3)
    disintegrate(m, batch, "by_turn", dtype="float64", preserve_rng=False)
    after_ref = torch.get_rng_state()
    torch.manual_seed(3)
    disintegrate_jvp(m, batch, "by_turn", dtype="float64", preserve_rng=False)
    assert torch.equal(torch.get_rng_state(), after_ref)  # the tangent pass replays, it does not draw again
    torch.manual_seed(3)
    assert not torch.equal(torch.get_rng_state(), after_ref)  # dropout did draw from the stream
