"""The one-pass engine's per-layer rules at a real vocabulary, against the reference engine, per part.

Reference: :func:`disintegrate` with ``engine="reference", keep_parts=True`` (one masked backward per part,
every ``g_S`` kept, its Gram summed from those vectors, float64). Vocabularies of 4,096 tokens and more;
tied and untied heads, padding ids, tokens repeated inside a row and across rows, frozen embeddings,
LoRA. Memory: no rule may form a ``[rows, V, d]`` buffer for an embedding (every op's output watched).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.engines.ghost import RideAlong, disintegrate_ghost
from lens_callbacks.credit.engines.rules import Factors, Rule, find_rule, register, take, unregister
from lens_callbacks.credit.inputs.partition import by_rollout
from tests.credit.test_ghost_engine import llama_float64  # noqa: F401  (transformers' float32 spots patched)

TOL = 1e-12
V = 4096


def assert_same(ref, got, tol=TOL):
    assert got.part_names == ref.part_names
    for field in ("projected_share", "norm_share"):
        for a, b in zip(getattr(ref, field), getattr(got, field)):
            assert abs(a - b) <= tol, (field, a, b)
    assert abs(ref.cancellation - got.cancellation) <= tol * max(1.0, ref.cancellation)
    scale = max(ref.part_norm)
    for a, b in zip(ref.part_norm, got.part_norm):
        assert abs(a - b) <= tol * scale, ("part_norm", a, b)
    if got.readings == "all":
        g_ref = torch.tensor(ref.gram, dtype=torch.float64)  # [m, m]
        g_got = torch.tensor(got.gram, dtype=torch.float64)  # [m, m]
        assert float((g_ref - g_got).abs().max()) <= tol * float(g_ref.diagonal().max())
    assert got.conservation_error <= 1e-13


class VocabPolicy(nn.Module):
    """Token embedding (padding id 0) + broadcast position embedding → LayerNorm → MLP → head (tied or not)."""

    def __init__(self, vocab=V, d=8, T=12, tie=True, freeze_emb=False, seed=0, dtype=torch.float64, scale=0.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
        self.to(dtype)
        if freeze_emb:
            self.tok.requires_grad_(False)

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        B, T = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(T)[None])  # [B, T, d]
        causal = torch.tril(torch.ones(T, T, dtype=x.dtype)) / torch.arange(1, T + 1, dtype=x.dtype)[:, None]
        x = self.norm(causal @ x)  # [B, T, d]
        h = x + self.out(torch.tanh(self.fc(x)))  # [B, T, d]
        lp = torch.log_softmax(self.head(h[:, :-1]), -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = -adv[:, None] * lp * trained / trained.sum().clamp_min(1)  # [B, T]
        return CreditTerms(terms, trained, torch.arange(B), group)


def vocab_batch(B=6, T=12, vocab=V, seed=1, dtype=torch.float64):
    """Rows that repeat tokens inside themselves and share tokens with other rows; padding after the text."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(1, vocab, (5,), generator=g)  # a few tokens every row draws from
    tokens = torch.randint(1, vocab, (B, T), generator=g)
    pick = torch.rand(B, T, generator=g) < 0.5
    tokens = torch.where(pick, common[torch.randint(0, 5, (B, T), generator=g)], tokens)  # [B, T]
    trained = torch.zeros(B, T, dtype=torch.bool)
    for k in range(B):
        n = int(torch.randint(3, T - 2, (1,), generator=g))
        trained[k, 2 : 2 + n] = True
        tokens[k, 2 + n :] = 0  # padding id after the completion
    adv = torch.randn(B, generator=g, dtype=dtype)
    return tokens, trained, adv, torch.arange(B) // 2


def both(module, batch, partition, readings="all", **kw):
    ref = disintegrate(module, batch, partition, dtype="float64", engine="reference", keep_parts=True)
    got = disintegrate_ghost(module, batch, partition, dtype="float64", readings=readings, **kw)
    return ref, got


def test_the_batch_repeats_tokens_within_and_across_rows_and_pads():
    tokens, trained, _, _ = vocab_batch()
    rows = [set(r[t].tolist()) for r, t in zip(tokens, trained)]
    assert any(len(r) < int(t.sum()) for r, t in zip(rows, trained))  # a token twice in one row
    assert any(rows[i] & rows[j] for i in range(len(rows)) for j in range(i + 1, len(rows)))  # across rows
    assert bool((tokens == 0).any())  # padding ids


@pytest.mark.parametrize("route", ["auto", "direct", "ghost"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
@pytest.mark.parametrize("readings", ["all", "shares"])
def test_embedding_and_head_equal_the_reference(tie, partition, readings, route):
    module, batch = VocabPolicy(tie=tie), vocab_batch()
    ref, got = both(module, batch, partition, readings, route=route)
    assert_same(ref, got)
    cov = dict(got.coverage)
    assert "fallback" not in cov, cov
    key = "embedding+linear" if tie else "embedding"
    assert cov[key] >= V * 8


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
@pytest.mark.parametrize("readings", ["projected", "shares"])
def test_direct_route_one_part_at_a_time_in_small_blocks_equals_the_reference(tie, partition, readings, monkeypatch):
    # The CPU's direct route forms one part's piece of a block at a time; blocks of 5 vocabulary rows put
    # each part's tokens (repeated, shared with other rows, padding) in many blocks, most parts with none
    # in most blocks.
    from lens_callbacks.credit.engines import ghost_routes

    monkeypatch.setattr(ghost_routes, "_PART_BLOCK", 40)
    module, batch = VocabPolicy(tie=tie), vocab_batch()
    ref, got = both(module, batch, partition, readings, route="direct")
    for a, b in zip(ref.projected_share, got.projected_share):
        assert abs(a - b) <= TOL
    if readings == "shares":
        assert_same(ref, got)


@pytest.mark.parametrize("route", ["direct", "ghost"])
@pytest.mark.parametrize("readings", ["projected", "all"])
def test_small_memory_budget_blocks_the_row_pairs(readings, route):
    # a budget of 64 elements: the direct route reads the tied head one vocabulary row at a time
    module, batch = VocabPolicy(tie=True), vocab_batch()
    ref, got = both(module, batch, "by_group", readings, memory_budget=64, route=route)
    for a, b in zip(ref.projected_share, got.projected_share):
        assert abs(a - b) <= TOL
    if readings == "all":
        assert_same(ref, got)


def test_frozen_embedding_with_an_untied_head():
    module, batch = VocabPolicy(tie=False, freeze_emb=True), vocab_batch()
    ref, got = both(module, batch, "by_rollout")
    assert_same(ref, got)
    cov = dict(got.coverage)
    assert "fallback" not in cov and "embedding" in cov  # the position embedding is still trained
    assert cov["embedding"] == module.pos.weight.numel()


def test_project_onto_with_a_tied_embedding():
    module, batch = VocabPolicy(tie=True), vocab_batch()
    g = torch.Generator().manual_seed(7)
    onto = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in module.parameters() if p.requires_grad]
    ref = disintegrate(module, batch, "by_rollout", dtype="float64", engine="reference", project_onto=onto)
    got = disintegrate_ghost(module, batch, "by_rollout", dtype="float64", project_onto=onto)
    for a, b in zip(ref.projected_share, got.projected_share):
        assert abs(a - b) <= TOL


def _llama(vocab=V, tie=True, lora=False, train_emb=False, seed=0):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        attention_dropout=0.0,
        pad_token_id=0,
    )
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).double()
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            )
            for n, p in model.named_parameters():
                if "lora_B" in n:  # peft starts B at zero; a zero adapter has a degenerate gradient
                    with torch.no_grad():
                        p.normal_(0, 0.3)
            if train_emb:
                model.get_input_embeddings().weight.requires_grad_(True)
    return model


class HFPolicy(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def credit_terms(self, batch):
        ids, trained, adv, group = batch
        am = (ids != 0).long()  # [B, T]
        logits = self.model(input_ids=ids, attention_mask=am).logits  # [B, T, V]
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))  # [B, T]
        return CreditTerms(terms, trained, torch.arange(ids.shape[0]), group)


@pytest.mark.parametrize("tie", [True, False])
def test_llama_tied_and_untied_at_a_real_vocabulary(tie, llama_float64):
    module = HFPolicy(_llama(tie=tie))
    ref, got = both(module, vocab_batch(), "by_rollout")
    assert_same(ref, got)
    assert "fallback" not in dict(got.coverage)


@pytest.mark.parametrize("train_emb", [False, True])
def test_peft_lora_with_frozen_or_trained_embedding(train_emb, llama_float64):
    pytest.importorskip("peft")
    module = HFPolicy(_llama(tie=True, lora=True, train_emb=train_emb))
    ref, got = both(module, vocab_batch(), "by_group")
    assert_same(ref, got)
    cov = dict(got.coverage)
    assert "fallback" not in cov
    assert ("embedding+linear" in cov) == train_emb  # the tied head of a trained embedding: both uses


# ---- precision: float32 shares against the float64 reference ------------------------------------------


def test_float32_shares_match_the_float64_reference_on_a_large_tied_embedding():
    vocab, d = 16384, 64  # 1,048,576 embedding elements
    # weights at a trained model's scale (init std 0.02 as in transformers), so that float32 arithmetic of
    # the model itself stays near 1e-8
    module = VocabPolicy(vocab=vocab, d=d, T=16, tie=True, seed=2, scale=0.05)
    batch = vocab_batch(B=8, T=16, vocab=vocab, seed=4)
    assert module.tok.weight.numel() >= 1 << 20
    ref = disintegrate(module, batch, "by_rollout", dtype="float64", engine="reference")
    ref32 = disintegrate(module, batch, "by_rollout", dtype="float32", engine="reference")
    for readings in ("shares", "all"):
        got = disintegrate_ghost(module, batch, "by_rollout", dtype="float32", readings=readings)
        assert got.dtype == "float32"
        err = max(abs(a - b) for a, b in zip(ref.projected_share, got.projected_share))
        assert err <= 1e-7, err
        assert abs(sum(got.projected_share) - 1.0) <= 1e-7
        err_n = max(abs(a - b) for a, b in zip(ref.norm_share, got.norm_share))
        assert err_n <= 1e-7, err_n
        # against the reference engine in the same float32 arithmetic: the one-pass reductions add ~nothing
        err32 = max(abs(a - b) for a, b in zip(ref32.projected_share, got.projected_share))
        assert err32 <= 5e-8, err32


# ---- memory: no [rows, V, d] buffer for an embedding ---------------------------------------------------


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op (forward or backward) returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("readings", ["all", "shares", "projected"])
@pytest.mark.parametrize("tie", [True, False])
def test_no_rule_forms_a_rows_by_vocabulary_buffer(readings, tie):
    # width above the row length, so the model's own logits [B, T, V] stay under one parameter's size
    vocab, d, T = 8192, 32, 8
    module = VocabPolicy(vocab=vocab, d=d, T=T, tie=tie, dtype=torch.float32)
    batch = vocab_batch(B=6, T=T, vocab=vocab)
    size = module.tok.weight.numel()
    with _Largest() as watch:
        got = disintegrate_ghost(module, batch, "by_rollout", dtype="float32", readings=readings)
    assert got.ok
    # The watch sees the backward too (the embedding's own gradient is one parameter-sized tensor) ...
    assert watch.largest >= size
    # ... and nothing of two parameters' size or more: 6 rows' dense pieces would be 6 × size.
    assert watch.largest < 2 * size, (watch.largest, size)


def test_the_watch_catches_dense_per_row_pieces():
    # What the old embedding rule did (per-part pieces of the whole table, filled by index_add): the
    # watch sees the [rows, V, d] output of that op.
    with _Largest() as watch:
        torch.zeros(6, 8192, 16).index_add_(0, torch.tensor([0, 1]), torch.ones(2, 8192, 16))
    assert watch.largest >= 6 * 8192 * 16


# ---- riding along with a tied embedding ---------------------------------------------------------------


@pytest.mark.parametrize("readings", ["all", "shares"])
def test_ride_along_with_a_tied_embedding_equals_the_reference(readings):
    module, batch = VocabPolicy(tie=True), vocab_batch()
    ref = disintegrate(module, batch, "by_rollout", dtype="float64", engine="reference", keep_parts=True)
    ride = RideAlong(module).start()
    try:
        loss = module.credit_terms(batch).terms.sum()
        ride.on_loss(loss, by_rollout, readings=readings)
        loss.backward()
        got = ride.report(by_rollout, readings=readings)
    finally:
        ride.clear()
        module.zero_grad(set_to_none=True)
    assert not isinstance(got, str), got
    assert_same(ref, got)


# ---- the registry: a rule for a custom layer is one class -----------------------------------------------


class DoubledLinear(nn.Module):
    """``y = 2 · x Wᵀ``: a layer no shipped rule covers."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=torch.float64) * 0.5)

    def forward(self, x):
        return 2.0 * (x @ self.weight.T)


class DoubledLinearRule(Rule):
    """Row ``k``'s weight gradient is ``2 · B_kᵀ A_k``: factors ``(2B, A)``, or the product itself."""

    name = "doubled_linear"

    def matches(self, mod):
        return type(mod) is DoubledLinear

    def has_factors(self, use, param):
        return param is use.weight

    def factors(self, use, param, sel, B):
        return Factors(2.0 * take(use.b, sel, B), take(use.a, sel, B), False)

    def pieces(self, use, param, rows):
        B = rows.rp.shape[0]
        prod = torch.bmm(2.0 * take(use.b, rows.sel, B).transpose(1, 2), take(use.a, rows.sel, B))  # [r, out, in]
        return torch.zeros((rows.c,) + tuple(param.shape), dtype=prod.dtype).index_add_(0, rows.dst, prod)


class CustomPolicy(VocabPolicy):
    def __init__(self):
        super().__init__(tie=True)
        g = torch.Generator().manual_seed(3)
        self.fc = DoubledLinear(8, 16)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(16, 8, generator=g, dtype=torch.float64) * 0.5)


@pytest.mark.parametrize("route", ["direct", "ghost"])
def test_a_registered_rule_covers_a_custom_layer(route):
    module, batch = CustomPolicy(), vocab_batch()
    before = disintegrate_ghost(module, batch, "by_group", dtype="float64")
    assert dict(before.coverage)["fallback"] == module.fc.weight.numel()  # unknown layer: the fallback
    rule = register(DoubledLinearRule())
    try:
        assert find_rule(module.fc) is rule
        ref, got = both(module, batch, "by_group", route=route)
        assert_same(ref, got)
        cov = dict(got.coverage)
        assert "fallback" not in cov and cov["doubled_linear"] == module.fc.weight.numel()
    finally:
        unregister(rule)
    assert find_rule(module.fc) is None


def test_register_refuses_what_is_not_a_rule():
    with pytest.raises(TypeError, match="`rule` must be an instance of .*Rule, got function"):
        register(lambda mod: True)


def test_ride_along_with_a_tied_embedding_is_bitwise_neutral_over_20_steps():
    def train(audit):
        module = VocabPolicy(tie=True, dtype=torch.float32, seed=5)
        opt = torch.optim.Adam(module.parameters(), lr=1e-2)
        reports = []
        for step in range(20):
            batch = vocab_batch(seed=100 + step, dtype=torch.float32)
            opt.zero_grad(set_to_none=True)
            ride = RideAlong(module).start() if audit else None
            try:
                loss = module.credit_terms(batch).terms.sum()
                if ride is not None:
                    ride.on_loss(loss, by_rollout, readings="shares")
                loss.backward()
                if ride is not None:
                    reports.append(ride.report(by_rollout, readings="shares"))
            finally:
                if ride is not None:
                    ride.clear()
            opt.step()
        return module, reports

    plain, _ = train(False)
    audited, reports = train(True)
    assert len(reports) == 20 and all(not isinstance(r, str) for r in reports), reports[0]
    assert all(abs(sum(r.projected_share) - 1.0) < 1e-5 for r in reports)
    for (n, p), (_, q) in zip(plain.named_parameters(), audited.named_parameters()):
        assert torch.equal(p, q), n
    assert all(len(mod._forward_hooks) == 0 for mod in audited.modules())


# ---- rules match layers by type; names and shapes only as the documented fallback ------------------------


def test_transformers_layers_are_matched_by_type_and_a_subclass_with_its_own_forward_is_not():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.pytorch_utils import Conv1D

    from lens_callbacks.credit.engines.rules.norms import _known_rmsnorm

    assert find_rule(Conv1D(8, 4)).name == "conv1d"
    assert find_rule(LlamaRMSNorm(8)).name == "rmsnorm" and _known_rmsnorm(LlamaRMSNorm(8))

    class Conv1DScaled(Conv1D):  # another layer: its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    Conv1DScaled.__name__ = "Conv1D"  # the old name match would have taken it
    assert find_rule(Conv1DScaled(8, 4)) is None


def test_the_name_fallback_covers_a_copy_of_a_layer_from_another_library():
    class MyRMSNorm(nn.Module):  # weight * x / rms(x), named as the heuristic expects
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    class GemmaRMSNorm(MyRMSNorm):  # (1 + weight) * …: not this rule's arithmetic
        pass

    assert find_rule(MyRMSNorm(4)).name == "rmsnorm"
    assert find_rule(GemmaRMSNorm(4)) is None
