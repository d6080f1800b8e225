"""The one-pass ("ghost") engine against the reference engine, per part, in float64.

Reference: :func:`disintegrate` with ``engine="reference", keep_parts=True`` (one masked backward per
part, every ``g_S`` kept; its Gram is summed from those vectors). Every reading compared: projected
share, norm share, part norm, cancellation, and the Gram ``<g_S, g_S'>``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lens_callbacks.credit import CreditTerms, Partition, disintegrate
from lens_callbacks.credit.engines import available_engines, choose_engine, is_row_separable
from lens_callbacks.credit.engines.ghost import NotRowSeparable, RowInteraction, disintegrate_ghost

TOL = 1e-12


def assert_same_readings(ref, got, tol=TOL):
    assert got.part_names == ref.part_names
    for field in ("projected_share", "norm_share"):
        for a, b in zip(getattr(ref, field), getattr(got, field)):
            assert abs(a - b) <= tol, (field, a, b)
    for a, b in zip(ref.part_norm, got.part_norm):
        assert abs(a - b) <= tol * max(1.0, max(ref.part_norm)), ("part_norm", a, b)
    assert abs(ref.cancellation - got.cancellation) <= tol * max(1.0, ref.cancellation)
    assert abs(ref.full_grad_norm - got.full_grad_norm) <= tol * ref.full_grad_norm
    if got.readings == "shares":  # no interference matrix is formed, only each part's norm
        assert got.gram is None
    else:
        g_ref = torch.tensor(ref.gram, dtype=torch.float64)  # [m, m]
        g_got = torch.tensor(got.gram, dtype=torch.float64)  # [m, m]
        scale = float(g_ref.diagonal().max())
        assert float((g_ref - g_got).abs().max()) <= tol * scale
    assert got.conservation_error <= 1e-13


def random_row_partition(trained, n_parts, seed):
    """Whole rows drawn into up to ``n_parts`` parts (dense ids, untrained positions in none)."""
    B, T = trained.shape
    g = torch.Generator().manual_seed(seed)
    row_part = torch.randint(0, n_parts, (B,), generator=g)
    used = sorted(set(row_part.tolist()))
    dense = torch.tensor([used.index(int(r)) for r in row_part])
    ids = torch.where(trained, dense[:, None].expand(B, T), torch.full((B, T), -1))  # [B, T]
    return Partition(ids, tuple(f"p{i}" for i in range(len(used))))


def both(module, batch, partition, budget=None, readings="all", **kw):
    ref = disintegrate(module, batch, partition, dtype="float64", engine="reference", keep_parts=True, **kw)
    if budget is None:
        got = disintegrate(module, batch, partition, dtype="float64", engine="ghost", readings=readings, **kw)
    else:  # small chunks of parts: the Gram assembled block by block
        got = disintegrate_ghost(
            module, batch, partition, dtype="float64", memory_budget=budget, readings=readings, **kw
        )
    assert (ref.engine, got.engine) == ("reference", "ghost")
    return ref, got


# ---- a model of plain layers: Linear, Embedding, LayerNorm, a frozen layer, a bare parameter ---------


class LayerPolicy(nn.Module):
    """Embedding + position embedding (one row broadcast over the batch) → LayerNorm → MLP → tied head."""

    def __init__(self, V=13, d=8, T=9, seed=0, bare=True, frozen=True, tie=True, norm="layer"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        self.norm = nn.LayerNorm(d) if norm == "layer" else nn.RMSNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.frozen = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, V, bias=False)
        if tie:
            self.head.weight = self.tok.weight
        self.scale = nn.Parameter(torch.ones(d)) if bare else None
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        self.double()
        if frozen:
            self.frozen.requires_grad_(False)

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        B, T = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(T)[None])  # [B, T, d]
        causal = torch.tril(torch.ones(T, T, dtype=x.dtype)) / torch.arange(1, T + 1, dtype=x.dtype)[:, None]
        x = self.norm(causal @ x)  # [B, T, d]
        h = self.frozen(torch.tanh(self.fc(x)))  # [B, T, d]
        if self.scale is not None:
            h = h * self.scale  # a bare parameter no rule covers: the fallback path
        lp = torch.log_softmax(self.head(h[:, :-1]), -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = -adv[:, None] * lp * trained / trained.sum().clamp_min(1)  # [B, T]
        return CreditTerms(terms, trained, torch.arange(B), group)


def layer_batch(B=6, T=9, V=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (B, T), generator=g)
    trained = torch.zeros(B, T, dtype=torch.bool)
    for k in range(B):
        n = int(torch.randint(2, T - 1, (1,), generator=g))
        trained[k, 2 : 2 + n] = True
        tokens[k, 2 + n :] = 0  # padding id after the completion
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return tokens, trained, adv, torch.arange(B) // 2


@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
def test_plain_layers_tied_frozen_and_bare_parameter(partition):
    module, batch = LayerPolicy(), layer_batch()
    ref, got = both(module, batch, partition)
    assert_same_readings(ref, got)
    cov = dict(got.coverage)
    assert cov["fallback"] == 8  # the bare `scale`, nothing else
    assert cov["embedding+linear"] == 13 * 8  # the tied weight: both uses summed
    assert cov["embedding"] == 9 * 8 and cov["layernorm"] == 16 and cov["linear"] == 8 * 16 + 16
    assert sum(cov.values()) == sum(p.numel() for p in module.parameters() if p.requires_grad)


def test_rmsnorm_untied_no_fallback():
    module, batch = LayerPolicy(bare=False, tie=False, norm="rms"), layer_batch()
    ref, got = both(module, batch, "by_rollout")
    assert_same_readings(ref, got)
    assert "fallback" not in dict(got.coverage) and "rmsnorm" in dict(got.coverage)


def test_chunked_pieces_equal_one_chunk():
    module, batch = LayerPolicy(), layer_batch(B=7)
    one = disintegrate_ghost(module, batch, "by_rollout", dtype="float64")
    small = disintegrate_ghost(module, batch, "by_rollout", dtype="float64", memory_budget=64)  # one part per chunk
    assert_same_readings(one, small, tol=1e-13)


def test_projected_readings_skip_the_gram():
    module, batch = LayerPolicy(), layer_batch()
    ref, _ = both(module, batch, "by_rollout")
    got = disintegrate(module, batch, "by_rollout", dtype="float64", engine="ghost", readings="projected")
    assert got.readings == "projected" and got.gram is None and all(math.isnan(x) for x in got.norm_share)
    for a, b in zip(ref.projected_share, got.projected_share):
        assert abs(a - b) <= TOL
    assert "projected shares only" in got.render()


def test_shares_readings_are_the_norms_without_the_gram():
    module, batch = LayerPolicy(), layer_batch()
    for partition in ("by_rollout", "by_group"):
        ref, got = both(module, batch, partition, readings="shares")
        assert got.readings == "shares" and got.gram is None
        assert_same_readings(ref, got, tol=TOL)
        text = got.render()
        assert "projected and norm shares, cancellation" in text and "interference" not in text


@settings(max_examples=8, deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(4, 8),
    d=st.integers(1, 6),
    seed=st.integers(0, 1000),
    n_parts=st.integers(1, 4),
    budget=st.sampled_from([None, 2, 300]),
    readings=st.sampled_from(["all", "shares"]),
)
def test_hypothesis_shapes_and_row_partitions(B, T, d, seed, n_parts, budget, readings):
    module = LayerPolicy(V=7, d=d, T=T, seed=seed)
    tokens, trained, adv, group = layer_batch(B=B, T=T, V=7, seed=seed + 1)
    part = random_row_partition(trained, n_parts, seed)
    ref, got = both(module, (tokens, trained, adv, group), part, budget=budget, readings=readings)
    if ref.ok:
        assert_same_readings(ref, got, tol=1e-11)


# ---- the example's GPT-2, a transformers Llama, a peft LoRA policy --------------------------------


def test_example_gpt2_dropout_tied_padding():
    pytest.importorskip("transformers")
    from lens_callbacks.examples.grpo import GRPOModule

    torch.manual_seed(0)
    module = GRPOModule(n_layer=2, n_embd=16, n_head=2, group_size=4, dropout=0.1, dtype="float64")
    module.train()
    rb, _ = module.sample_rollouts(torch.tensor([[1, 2], [3, 4]]))
    rb.advantages = torch.randn(rb.batch_size, dtype=torch.float64)
    # Pad some rows: end their completion early (positions past it are padding, attention-masked).
    rb.attention_mask[::3, -2:] = 0
    rb.completion_mask[::3, -2:] = False
    for partition in ("by_rollout", "by_group"):
        ref, got = both(module, rb, partition)
        assert_same_readings(ref, got)
        cov = dict(got.coverage)
        assert "fallback" not in cov, cov  # wte (tied head), wpe (broadcast), Conv1D, LayerNorm: all by hooks
        assert cov["embedding+linear"] == module.policy.transformer.wte.weight.numel()


def _tiny_llama(seed=0, lora=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=23,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).double()
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
            )
            for n, p in model.named_parameters():
                if "lora_B" in n:  # peft starts B at zero; a zero adapter has a degenerate gradient
                    with torch.no_grad():
                        p.normal_(0, 0.3)
    return model


class HFPolicy(nn.Module):
    """GRPO terms over a transformers causal LM, left-padded rows."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def credit_terms(self, batch):
        ids, am, trained, adv, group = batch
        pos = (am.cumsum(1) - 1).clamp(min=0)  # [B, T] left padding: positions start at the first real token
        logits = self.model(input_ids=ids, attention_mask=am, position_ids=pos).logits  # [B, T, V]
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))  # [B, T]
        return CreditTerms(terms, trained, torch.arange(ids.shape[0]), group)


def hf_batch(B=4, T=10, V=23, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    trained = torch.zeros(B, T, dtype=torch.bool)
    for k in range(B):
        left = k % 3  # left padding of 0..2 tokens
        am[k, :left] = 0
        ids[k, :left] = 0
        trained[k, left + 3 :] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return ids, am, trained, adv, torch.arange(B) // 2


@pytest.fixture
def llama_float64(monkeypatch):
    """transformers' LlamaRMSNorm and eager softmax compute in float32 even on float64 weights (and a
    left-padded row's fully masked query then reads NaN): patch those two spots to the input's dtype."""
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml

    def rms_forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.functional.dropout(torch.softmax(w, dim=-1), p=dropout, training=module.training)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_forward)
    monkeypatch.setattr(ml, "eager_attention_forward", eager)


def test_llama_rmsnorm_rotary_left_padding(llama_float64):
    torch.manual_seed(0)
    module = HFPolicy(_tiny_llama())
    ref, got = both(module, hf_batch(), "by_rollout")
    assert ref.ok
    assert_same_readings(ref, got)
    cov = dict(got.coverage)
    assert "fallback" not in cov and "rmsnorm" in cov


def test_peft_lora_only_adapters_trainable(llama_float64):
    pytest.importorskip("peft")
    module = HFPolicy(_tiny_llama(lora=True))
    module.train()  # LoRA dropout on: both engines replay it under the same seed below
    batch = hf_batch()

    def run(engine, **kw):
        torch.manual_seed(5)
        return disintegrate(module, batch, "by_rollout", dtype="float64", engine=engine, preserve_rng=False, **kw)

    ref, got = run("reference", keep_parts=True), run("ghost")
    assert_same_readings(ref, got)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert dict(got.coverage) == {"linear": trainable}


# ---- rows that interact, dispatch, read-only ---------------------------------------------------------


class BatchNormPolicy(LayerPolicy):
    def __init__(self):
        super().__init__(bare=False)
        self.bn = nn.BatchNorm1d(9).double()

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        x = self.tok(tokens)  # [B, T, d]
        x = self.bn(x)  # mixes rows in training mode
        lp = torch.log_softmax(self.head(x[:, :-1]), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        terms = -adv[:, None] * nn.functional.pad(lp, (1, 0)) * trained
        return CreditTerms(terms, trained, torch.arange(tokens.shape[0]), group)


def test_batchnorm_in_training_mode_is_refused_or_falls_back():
    module, batch = BatchNormPolicy(), layer_batch()
    module.train()
    with pytest.raises(RowInteraction, match="bn"):
        disintegrate(module, batch, "by_rollout", dtype="float64", engine="ghost")
    auto = disintegrate(module, batch, "by_rollout", dtype="float64")
    ref = disintegrate(module, batch, "by_rollout", dtype="float64", engine="reference")
    assert auto.engine == "reference" and auto.projected_share == ref.projected_share


def test_cross_row_loss_is_caught_by_verify_part():
    module, batch = LayerPolicy(), layer_batch()
    inner = module.credit_terms

    def mixing(b):
        t = inner(b)
        mean = t.terms.sum(1).mean()  # a cross-row term put on every row's first trained position
        extra = torch.zeros_like(t.terms)
        first = t.trained.int().argmax(1)
        extra[torch.arange(t.terms.shape[0]), first] = 0.3 * mean * mean
        return CreditTerms(t.terms + extra, t.trained, t.rollout, t.group)

    with pytest.raises(RowInteraction, match="interact"):
        disintegrate_ghost(module, batch, terms_fn=mixing, dtype="float64", verify_part=True)
    # Without the cross-row term the same check passes.
    disintegrate_ghost(module, batch, dtype="float64", verify_part=True)


def test_auto_dispatch_and_unknown_engines():
    module, batch = LayerPolicy(), layer_batch()
    assert disintegrate(module, batch, "by_rollout", dtype="float64").engine == "ghost"
    tokens, trained, adv, group = batch
    half = torch.where(trained, (torch.arange(trained.shape[1]) >= 4).long().expand_as(trained), -1)
    within = Partition(half, ("early", "late"))
    assert not is_row_separable(within) and choose_engine(within, "all") == "reference"
    r = disintegrate(module, batch, within, dtype="float64")
    assert r.engine == "reference"
    with pytest.raises(NotRowSeparable, match="union"):
        disintegrate(module, batch, within, dtype="float64", engine="ghost")
    with pytest.raises(ValueError, match="`engine` must be one of"):
        disintegrate(module, batch, "by_rollout", engine="fastest")
    with pytest.raises(ValueError, match="`readings` must be one of"):
        disintegrate(module, batch, "by_rollout", readings="some")
    if "jvp" not in available_engines():
        with pytest.raises(ValueError, match="'reference', 'ghost'"):
            disintegrate(module, batch, "by_rollout", engine="jvp")


def test_read_only_params_grad_rng():
    module, batch = LayerPolicy(), layer_batch()
    for p in module.parameters():
        p.grad = torch.full_like(p, 3.0) if p.requires_grad else None
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    rng = torch.get_rng_state()
    n_hooks = sum(len(m._forward_hooks) for m in module.modules())
    r = disintegrate(module, batch, "by_rollout", dtype="float32", engine="ghost", reference_grads="grad")
    assert r.dtype == "float32" and r.conservation_error < 1e-6 and r.grad_match > 0.5
    assert torch.equal(torch.get_rng_state(), rng)
    assert sum(len(m._forward_hooks) for m in module.modules()) == n_hooks
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]) and p.dtype == torch.float64
        if p.requires_grad:
            assert torch.equal(p.grad, torch.full_like(p, 3.0))


def test_report_dict_and_interference_matrix():
    module, batch = LayerPolicy(), layer_batch()
    r = disintegrate(module, batch, "by_rollout", dtype="float64")
    d = r.to_dict("credit/")
    assert d["credit/engine/ghost"] == 1.0 and d["credit/readings/all"] == 1.0
    cos = r.interference()
    gram = torch.tensor(r.gram, dtype=torch.float64)
    n = torch.tensor(r.part_norm, dtype=torch.float64)
    torch.testing.assert_close(cos, gram / torch.outer(n, n), rtol=1e-12, atol=0)
    torch.testing.assert_close(cos.diagonal(), torch.ones(r.n_parts, dtype=torch.float64), rtol=0, atol=1e-12)
    off = cos[~torch.eye(r.n_parts, dtype=torch.bool)]
    assert d["credit/interference/min_cosine"] == pytest.approx(float(off.min()), abs=1e-15)
    assert "interference" in r.render() and "engine ghost" in r.render()
    # sum of the Gram = ||Σ g_S||² = ||g_full||² (conservation through the matrix)
    assert float(gram.sum()) == pytest.approx(r.full_grad_norm**2, rel=1e-12)


@pytest.mark.parametrize("readings", ["all", "shares", "projected"])
def test_project_onto_equals_the_reference_engine(readings):
    module, batch = LayerPolicy(), layer_batch()
    g = torch.Generator().manual_seed(4)
    onto = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in module.parameters() if p.requires_grad]
    for partition in ("by_rollout", "by_group"):
        ref = disintegrate(module, batch, partition, dtype="float64", engine="reference", project_onto=onto)
        got = disintegrate(
            module, batch, partition, dtype="float64", engine="ghost", project_onto=onto, readings=readings
        )
        assert got.engine == "ghost"
        for a, b in zip(ref.projected_share, got.projected_share):
            assert abs(a - b) <= TOL
        assert abs(got.share_sum - ref.share_sum) <= TOL  # ≠ 1: v is not this batch's gradient
        assert got.conservation_error <= 1e-13
        if readings != "projected":
            for a, b in zip(ref.part_norm, got.part_norm):
                assert abs(a - b) <= TOL * max(ref.part_norm)
            assert abs(ref.cancellation - got.cancellation) <= TOL
    # the forward-mode engine projects onto v too: its tangent pass runs along v instead of g_full
    ref = disintegrate(module, batch, "by_rollout", dtype="float64", engine="reference", project_onto=onto)
    got = disintegrate(module, batch, "by_rollout", dtype="float64", engine="jvp", project_onto=onto)
    assert got.engine == "jvp"
    for a, b in zip(ref.projected_share, got.projected_share):
        assert abs(a - b) <= TOL
    assert got.conservation_error <= 1e-13


def test_full_grad_from_the_trainer_equals_the_own_backward_and_is_held_to_it():
    module, batch = LayerPolicy(), layer_batch()
    leaves = [p for p in module.parameters() if p.requires_grad]
    grad = torch.autograd.grad(module.credit_terms(batch).terms.sum(), leaves)  # what the trainer's .grad holds
    own = disintegrate(module, batch, "by_group", dtype="float64", engine="ghost", reference_grads=list(grad))
    got = disintegrate(module, batch, "by_group", dtype="float64", full_grad=list(grad))
    assert got.engine == "ghost+grad" and got.grad_match is None and "g_full by the trainer's .grad" in got.render()
    assert_same_readings(own, got, tol=TOL)
    assert abs(got.conservation_error - own.conservation_error) <= 1e-15
    # a .grad that is not this batch's gradient shows in the conservation error (what grad_match would say)
    stale = disintegrate(module, batch, "by_group", dtype="float64", full_grad=[1.1 * g for g in grad])
    assert stale.conservation_error == pytest.approx(0.1 / 1.1, rel=1e-9)
    with pytest.raises(ValueError, match="`full_grad` needs engine='ghost'"):
        disintegrate(module, batch, "by_group", dtype="float64", engine="reference", full_grad=list(grad))


@pytest.mark.parametrize(
    "route,blocked,by_part",
    [("direct", False, True), ("direct", True, True), ("direct", True, False), ("ghost", False, True)],
)
def test_under_bf16_autocast_the_parts_sum_is_float32_and_conservation_reads_it(route, blocked, by_part, monkeypatch):
    # Under autocast a Linear's input and output gradient are bfloat16, so its pieces are; their sum must
    # still be kept (and held against the float32 g_full) in float32: a bfloat16 Σ g_S, or g_full rounded
    # to bfloat16 before the difference, reads a conservation error that is not the returned vector's.
    # `blocked`: every weight read a block of its rows at a time (one part's piece at a time on the CPU's
    # path, every part's at once on the batched one), not whole with the other small weights.
    from lens_callbacks.credit.engines import ghost, ghost_routes

    if blocked:
        monkeypatch.setattr(ghost, "_WHOLE", 0)
    monkeypatch.setattr(ghost_routes, "_by_part", lambda device, numel: by_part)
    module, batch = LayerPolicy(V=300, d=16, seed=3), layer_batch(V=300)
    module.float()
    ref = disintegrate_ghost(module, batch, "by_rollout", dtype="float32", readings="shares")
    got = disintegrate_ghost(
        module,
        batch,
        "by_rollout",
        dtype="float32",
        keep_grads=True,
        route=route,
        forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    )
    gs, gf = got.grads.parts_sum, got.grads.g_full
    assert all(s.dtype == g.dtype == torch.float32 for s, g in zip(gs, gf))
    diff = math.sqrt(sum(float((s.double() - g.double()).pow(2).sum()) for s, g in zip(gs, gf)))
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in gf))
    assert abs(diff / norm - got.conservation_error) <= 1e-6 * got.conservation_error
    assert 0 < got.conservation_error < 8 * 2**-8  # bfloat16 products: the parts add up to its resolution
    for a, b in zip(ref.projected_share, got.projected_share):  # float32 products: to bfloat16's resolution
        assert abs(a - b) < 8 * 2**-8, (a, b)
    for a, b in zip(ref.norm_share, got.norm_share):
        assert abs(a - b) < 8 * 2**-8, (a, b)
