"""The one-pass engine's two routes per weight, each forced, against the reference engine in float64.

``route="direct"`` forms every row's weight product; ``route="ghost"`` never does (ghost identities:
``<g_k, G> = Σ (B_k G)∘A_k``, Gram ``Σ (A_k A_lᵀ)∘(B_k B_lᵀ)``, ``Σ_k g_k`` as one product). Both must equal
the reference engine (one masked backward per part, every ``g_S`` kept) to 1e-12, reading by reading.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lens_callbacks.credit import CreditTerms, by_rollout, disintegrate
from lens_callbacks.credit.engines.ghost import RideAlong, disintegrate_ghost
from lens_callbacks.credit.engines.ghost_routes import choose_route, fine_products, route_costs
from tests.credit.test_ghost_engine import LayerPolicy, assert_same_readings, layer_batch, random_row_partition

TOL = 1e-12


def reference(module, batch, partition):
    return disintegrate(module, batch, partition, dtype="float64", engine="reference", keep_parts=True)


class TwiceLinear(nn.Module):
    """One square ``Linear`` applied twice (two uses of one weight: the Gram's cross terms) and a wide layer."""

    def __init__(self, V=11, d=6, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = nn.Embedding(V, d)
        self.sq = nn.Linear(d, d)
        self.wide = nn.Linear(d, 5 * d, bias=False)
        self.head = nn.Linear(5 * d, V)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.double()

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        B, T = tokens.shape
        x = self.tok(tokens)  # [B, T, d]
        causal = torch.tril(torch.ones(T, T, dtype=x.dtype)) / torch.arange(1, T + 1, dtype=x.dtype)[:, None]
        h = self.sq(torch.tanh(self.sq(causal @ x)))  # [B, T, d]
        lp = torch.log_softmax(self.head(torch.tanh(self.wide(h[:, :-1]))), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = -adv[:, None] * lp * trained / trained.sum().clamp_min(1)  # [B, T]
        return CreditTerms(terms, trained, torch.arange(B), group)


@pytest.mark.parametrize("route", ["direct", "ghost"])
@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
def test_forced_route_equals_reference(route, partition):
    for module, batch in ((LayerPolicy(), layer_batch()), (TwiceLinear(), layer_batch(V=11))):
        ref = reference(module, batch, partition)
        got = disintegrate_ghost(module, batch, partition, dtype="float64", route=route)
        assert_same_readings(ref, got, tol=TOL)
        shares = disintegrate_ghost(module, batch, partition, dtype="float64", route=route, readings="shares")
        assert shares.gram is None
        assert_same_readings(ref, shares, tol=TOL)
        proj = disintegrate_ghost(module, batch, partition, dtype="float64", route=route, readings="projected")
        assert proj.gram is None and proj.conservation_error <= 1e-13
        for a, b in zip(ref.projected_share, proj.projected_share):
            assert abs(a - b) <= TOL


def test_ghost_route_in_row_blocks_equals_one_block():
    module, batch = TwiceLinear(), layer_batch(B=7, V=11)
    one = disintegrate_ghost(module, batch, "by_rollout", dtype="float64", route="ghost")
    small = disintegrate_ghost(module, batch, "by_rollout", dtype="float64", route="ghost", memory_budget=40)
    assert_same_readings(one, small, tol=1e-13)
    assert_same_readings(reference(module, batch, "by_rollout"), small, tol=TOL)


@settings(max_examples=8, deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(4, 8),
    d=st.integers(1, 6),
    seed=st.integers(0, 1000),
    n_parts=st.integers(1, 4),
    budget=st.sampled_from([None, 3, 200]),
    route=st.sampled_from(["ghost", "auto"]),
    readings=st.sampled_from(["all", "shares"]),
)
def test_hypothesis_shapes_partitions_routes(B, T, d, seed, n_parts, budget, route, readings):
    module = TwiceLinear(V=7, d=d, seed=seed)
    tokens, trained, adv, group = layer_batch(B=B, T=T, V=7, seed=seed + 1)
    part = random_row_partition(trained, n_parts, seed)
    batch = (tokens, trained, adv, group)
    ref = reference(module, batch, part)
    got = disintegrate_ghost(module, batch, part, dtype="float64", route=route, memory_budget=budget, readings=readings)
    if ref.ok:
        assert_same_readings(ref, got, tol=1e-11)


def test_gpt2_conv1d_tied_ghost_route():
    pytest.importorskip("transformers")
    from lens_callbacks.examples.grpo import GRPOModule

    torch.manual_seed(0)
    module = GRPOModule(n_layer=1, n_embd=16, n_head=2, group_size=4, dropout=0.0, dtype="float64")
    rb, _ = module.sample_rollouts(torch.tensor([[1, 2], [3, 4]]))
    rb.advantages = torch.randn(rb.batch_size, dtype=torch.float64)
    rb.attention_mask[::3, -2:] = 0
    rb.completion_mask[::3, -2:] = False
    ref = reference(module, rb, "by_rollout")
    got = disintegrate_ghost(module, rb, "by_rollout", dtype="float64", route="ghost")
    assert_same_readings(ref, got, tol=TOL)


def test_ride_along_ghost_route_equals_separate_pass():
    module, batch = TwiceLinear(), layer_batch(V=11)
    ride = RideAlong(module).start()
    try:
        loss = module.credit_terms(batch).terms.sum()
        ride.on_loss(loss)
        loss.backward()
        got = ride.report(by_rollout, route="ghost")
    finally:
        ride.clear()
        module.zero_grad(set_to_none=True)
    assert not isinstance(got, str), got
    assert_same_readings(reference(module, batch, "by_rollout"), got, tol=TOL)


def test_auto_picks_by_cost():
    wide = torch.zeros(64, 32, dtype=torch.float64)

    class Use:  # what the cost model reads of a captured use
        rule = "linear"

        def __init__(self, n):
            self.weight, self.b = wide, torch.zeros(6, n, 64)

    short, long = [Use(3)], [Use(48)]
    for u in short + long:
        u.weight = wide
    # Short rows on a wide layer: the ghost Gram (r²n²(d_L+d_R)) beats m² d_L d_R plus the per-row products.
    d, g = route_costs(short, wide, rows=6, m=6, gram=True)
    assert g < d and choose_route(short, wide, 6, 6, True, "auto") == "ghost"
    # Long rows: the direct route, with the Gram or without it.
    assert choose_route(long, wide, 6, 6, True, "auto") == "direct"
    assert choose_route(long, wide, 6, 6, False, "auto") == "direct"
    assert choose_route(long, wide, 6, 6, True, "ghost") == "ghost"
    bias = torch.zeros(64, dtype=torch.float64)
    assert choose_route(long, bias, 6, 6, True, "ghost") == "direct"  # no identity for a bias: direct


def test_auto_on_short_wide_rows_uses_ghost_and_is_exact():
    module, batch = TwiceLinear(d=24), layer_batch(B=6, T=4, V=11)
    ref = reference(module, batch, "by_rollout")
    assert_same_readings(ref, disintegrate_ghost(module, batch, "by_rollout", dtype="float64"), tol=TOL)


def test_unknown_route_is_refused_with_the_options():
    module, batch = LayerPolicy(), layer_batch()
    with pytest.raises(ValueError, match=r"`route` must be one of \['auto', 'direct', 'ghost'\], got 'fast'"):
        disintegrate_ghost(module, batch, "by_rollout", route="fast")


def _ride(module, batch, readings, in_backward, route="auto", steps=1):
    ride = RideAlong(module).start()
    try:
        loss = module.credit_terms(batch).terms.sum()
        if in_backward:
            ride.on_loss(loss, by_rollout, readings=readings, route=route)
        else:
            ride.on_loss(loss)
        for _ in range(steps):  # steps > 1: `.grad` accumulates more than the backward the hooks saw
            loss.backward(retain_graph=True)
        return ride.report(by_rollout, readings=readings, route=route)
    finally:
        ride.clear()
        module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("readings", ["all", "shares"])
@pytest.mark.parametrize("route", ["direct", "ghost"])
def test_ride_along_reducing_inside_the_backward_equals_after_it(readings, route):
    module, batch = TwiceLinear(), layer_batch(V=11)
    inside = _ride(module, batch, readings, True, route)
    after = _ride(module, batch, readings, False, route)
    assert not isinstance(inside, str), inside
    assert inside.readings == readings and (inside.gram is None) == (readings == "shares")
    assert_same_readings(after, inside, tol=1e-13)
    assert_same_readings(reference(module, batch, "by_rollout"), inside, tol=TOL)


def test_ride_along_inside_the_backward_refuses_a_grad_that_was_not_zeroed():
    module, batch = TwiceLinear(), layer_batch(V=11)
    got = _ride(module, batch, "all", True, steps=2)
    assert isinstance(got, str) and "is not the gradient of this backward" in got and "zeroed" in got


def test_a_failure_inside_the_training_backward_is_reported_not_raised(monkeypatch):
    from lens_callbacks.credit.engines import ghost

    module, batch = TwiceLinear(), layer_batch(V=11)
    plain = torch.autograd.grad(module.credit_terms(batch).terms.sum(), list(module.parameters()))

    def broken(self, i, g, release=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(ghost._Reducer, "param", broken)
    ride = RideAlong(module).start()
    try:
        loss = module.credit_terms(batch).terms.sum()
        ride.on_loss(loss, by_rollout)
        loss.backward()  # the training step goes on
        got = ride.report(by_rollout)
    finally:
        ride.clear()
    assert isinstance(got, str) and "failed: RuntimeError: boom" in got
    for p, g in zip(module.parameters(), plain):
        assert torch.equal(p.grad, g)  # the step's gradient is what it is without the audit


class CopyRMSNorm(nn.Module):
    """An RMSNorm (by name, so the rule covers it) that keeps a copy of its input for its own backward."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, dtype=torch.float64) + 0.1)

    def forward(self, x):
        y = x.clone()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6))


class InPlaceAfterNorm(nn.Module):
    def __init__(self, V=11, d=6):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.tok = nn.Embedding(V, d).double()
        self.norm = CopyRMSNorm(d)
        self.head = nn.Linear(d, V).double()
        with torch.no_grad():
            for p in (self.tok.weight, self.head.weight):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        x = self.tok(tokens) * 1.0  # [B, T, d]
        h = self.norm(x)
        x.mul_(2.0)  # the norm's input changes after the norm read it (its backward kept a copy)
        lp = torch.log_softmax(self.head(h + x), -1).gather(-1, tokens[..., None])[..., 0]  # [B, T]
        terms = -adv[:, None] * lp * trained / trained.sum().clamp_min(1)  # [B, T]
        return CreditTerms(terms, trained, torch.arange(tokens.shape[0]), group)


def test_a_norm_input_changed_in_place_is_refused_and_auto_falls_back():
    from lens_callbacks.credit.engines.ghost import RowInteraction

    module, batch = InPlaceAfterNorm(), layer_batch(V=11)
    assert type(module.norm).__name__.endswith("RMSNorm")
    with pytest.raises(RowInteraction, match="modified in place"):
        disintegrate_ghost(module, batch, "by_rollout", dtype="float64")
    got = disintegrate(module, batch, "by_rollout", dtype="float64")  # auto: the reference engine instead
    assert got.engine == "reference" and got.conservation_error < 1e-12


@pytest.mark.parametrize("by_part", [True, False])
def test_direct_route_with_a_part_that_has_no_rows(by_part, monkeypatch):
    # A part with no rows in the batch (by_advantage_sign's "zero", say) reads 0; the part after it is read
    # after a part that formed no piece.
    from lens_callbacks.credit.engines import ghost, ghost_routes
    from lens_callbacks.credit.inputs.partition import row_partition

    monkeypatch.setattr(ghost, "_WHOLE", 0)
    monkeypatch.setattr(ghost_routes, "_by_part", lambda device, numel: by_part)

    def halves_around_an_empty_part(terms):
        B = terms.trained.shape[0]
        return row_partition(terms, (torch.arange(B) >= B // 2).long() * 2, ("first", "empty", "second"))

    module, batch = TwiceLinear(), layer_batch(B=20, V=11)
    ref = reference(module, batch, halves_around_an_empty_part)
    got = disintegrate_ghost(
        module, batch, halves_around_an_empty_part, dtype="float64", readings="shares", route="direct"
    )
    assert ref.part_norm[1] == 0.0 and got.part_norm[1] == 0.0
    assert_same_readings(ref, got, tol=TOL)


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("readings", ["shares", "all"])
@pytest.mark.parametrize("budget", [None, 40])
@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
@pytest.mark.parametrize("by_part", [True, False])
def test_direct_route_blocks_with_many_parts_equal_the_reference(
    readings, budget, whole, partition, by_part, monkeypatch
):
    # 20 rows; small weights are read whole (pieces batched with other small parameters) unless the
    # threshold is lowered, when every weight is read a block of its rows at a time; a 40-element budget
    # cuts every weight into blocks of one row (two uses of `sq` in each block: the second adds into the
    # block's buffer), and on the CPU's path (one part's piece at a time) a 40-element part block does the
    # same. by_group puts two rows in each of 10 parts: the rows' products are summed into their parts'
    # pieces, through a second buffer (batched) or one product after the other (by part).
    from lens_callbacks.credit.engines import ghost, ghost_routes

    if not whole:
        monkeypatch.setattr(ghost, "_WHOLE", 0)
    monkeypatch.setattr(ghost_routes, "_by_part", lambda device, numel: by_part)
    if budget is not None:
        monkeypatch.setattr(ghost_routes, "_PART_BLOCK", budget)
    blocked = []
    real = ghost.direct_param
    monkeypatch.setattr(ghost, "direct_param", lambda *a, **k: blocked.append(a[0][0].rule) or real(*a, **k))
    module, batch = TwiceLinear(), layer_batch(B=20, V=11)
    ref = reference(module, batch, partition)
    got = disintegrate_ghost(
        module, batch, partition, dtype="float64", readings=readings, route="direct", memory_budget=budget
    )
    assert_same_readings(ref, got, tol=TOL)
    # sq, wide and head read in blocks only below the lowered threshold (the small embedding always is: its
    # parts' dense pieces are read block by block, never as a [c, V, d] buffer per part)
    assert (len([r for r in blocked if r != "embedding"]) == 0) == whole
    got32 = disintegrate_ghost(
        module.float(), batch, partition, dtype="float32", readings=readings, route="direct", memory_budget=budget
    )
    assert max(abs(a - b) for a, b in zip(ref.projected_share, got32.projected_share)) < 1e-5


def test_a_cpu_reads_one_part_at_a_time_only_weights_above_the_size_that_pays(monkeypatch):
    # With the threshold between the weights' sizes, the small ones (the embedding, 66 elements; the square
    # layer, 36) are read with every part's piece at once and the larger ones (wide, 180; head, 330) one
    # part at a time; every reading equals the reference's either way.
    from lens_callbacks.credit.engines import ghost, ghost_routes

    monkeypatch.setattr(ghost, "_WHOLE", 0)
    monkeypatch.setattr(ghost_routes, "_PART_MIN", 100)
    by_part = []
    real = ghost_routes._direct_by_part

    def spy(facs, g_full, *a, **k):
        by_part.append(g_full.numel())
        return real(facs, g_full, *a, **k)

    monkeypatch.setattr(ghost_routes, "_direct_by_part", spy)
    module, batch = TwiceLinear(), layer_batch(B=20, V=11)
    ref = reference(module, batch, "by_rollout")
    got = disintegrate_ghost(module, batch, "by_rollout", dtype="float64", readings="shares", route="direct")
    assert_same_readings(ref, got, tol=TOL)
    assert sorted(by_part) == [180, 330]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2**-6), (torch.float32, 1e-5)])
def test_one_part_at_a_time_reads_half_precision_pieces_in_float32(dtype, tol, monkeypatch):
    # The CPU's direct route on factors as autocast leaves them (a dense use and a token-id use, as a tied
    # head and embedding): products in the factors' dtype, dots, norms and Σ_S g_S in float32 at least,
    # against a float32 g_full; blocks of 4 weight rows; part 2 has no rows.
    from lens_callbacks.credit.engines import ghost_routes
    from lens_callbacks.credit.engines.rules import Factors

    monkeypatch.setattr(ghost_routes, "_PART_BLOCK", 48)
    g = torch.Generator().manual_seed(0)
    r, n, dL, dR, m = 6, 5, 21, 12, 4
    L, R, Ri = (torch.randn(r, n, d, generator=g).to(dtype) for d in (dL, dR, dR))
    ids = torch.randint(0, dL, (r, n), generator=g)
    dst = torch.tensor([0, 1, 1, 3, 0, 1])
    rows = torch.einsum("knv,knd->kvd", L.double(), R.double())  # [r, dL, dR]
    rows += torch.einsum("knv,knd->kvd", nn.functional.one_hot(ids, dL).double(), Ri.double())
    parts = torch.zeros(m, dL, dR, dtype=torch.float64).index_add_(0, dst, rows)  # [m, dL, dR]
    g_full = rows.sum(0).float()  # [dL, dR]
    dots, sq = torch.zeros(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
    total, diff = ghost_routes._direct_by_part(
        [Factors(L, R, False), Factors(ids, Ri, True)], g_full, g_full, dst, m, dots, sq, keep_total=True
    )
    assert total.dtype == torch.float32
    assert float((total.double() - parts.sum(0)).abs().max()) <= tol * float(parts.abs().max())
    assert abs(float(diff) - float((total.double() - g_full.double()).pow(2).sum())) <= 1e-6 * float(
        g_full.double().pow(2).sum()
    )
    ref_dots = (parts * g_full.double()).sum((1, 2))  # [m]
    ref_sq = parts.pow(2).sum((1, 2))  # [m]
    assert dots[2] == 0 and sq[2] == 0
    assert float((dots - ref_dots).abs().max()) <= tol * float(ref_dots.abs().max())
    assert float((sq - ref_sq).abs().max()) <= tol * float(ref_sq.max())


def test_one_part_at_a_time_zeroes_a_block_no_part_has_anything_in(monkeypatch):
    # Tokens only in the embedding's first block of weight rows: the later blocks of Σ_S g_S must read as
    # zeros, not as whatever the buffers held (torch.empty is made to hand out NaN-filled memory here).
    from lens_callbacks.credit.engines import ghost_routes
    from lens_callbacks.credit.engines.rules import Factors

    empty = torch.empty

    def nan_empty(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(ghost_routes, "_PART_BLOCK", 48)  # 4 weight rows a block
    monkeypatch.setattr(torch, "empty", nan_empty)
    g = torch.Generator().manual_seed(0)
    r, n, dL, dR, m = 3, 5, 21, 12, 2
    ids = torch.randint(0, 4, (r, n), generator=g)  # [r, n], every token in rows 0..3 of the weight
    Ri = torch.randn(r, n, dR, generator=g, dtype=torch.float64)
    dst = torch.tensor([0, 1, 0])
    rows = torch.einsum("knv,knd->kvd", nn.functional.one_hot(ids, dL).double(), Ri)  # [r, dL, dR]
    parts = torch.zeros(m, dL, dR, dtype=torch.float64).index_add_(0, dst, rows)  # [m, dL, dR]
    g_full = torch.randn(dL, dR, generator=g, dtype=torch.float64)  # [dL, dR]
    for keep in (True, False):
        dots, sq = torch.zeros(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
        total, diff = ghost_routes._direct_by_part(
            [Factors(ids, Ri, True)], g_full, g_full, dst, m, dots, sq, keep_total=keep
        )
        if keep:
            assert torch.equal(total[4:], torch.zeros(dL - 4, dR, dtype=torch.float64))
            assert torch.allclose(total, parts.sum(0), rtol=0, atol=1e-12)
        assert abs(float(diff) - float((parts.sum(0) - g_full).pow(2).sum())) < 1e-9
        assert torch.allclose(dots, (parts * g_full).sum((1, 2)), rtol=1e-12, atol=1e-12)
        assert torch.allclose(sq, parts.pow(2).sum((1, 2)), rtol=1e-12, atol=1e-12)


def _naive_spans(L, R, index):
    """Each row's first and past-last position whose ``L_t`` and ``R_t`` are both nonzero, one position at a time."""
    out = []
    for k in range(R.shape[0]):
        live = [t for t in range(R.shape[1]) if (index or bool(L[k, t].ne(0).any())) and bool(R[k, t].ne(0).any())]
        out.append((live[0], live[-1] + 1) if live else None)
    return out


@pytest.mark.parametrize("index", [False, True])
def test_dead_positions_are_cut_off_the_ends_of_each_row(index):
    from lens_callbacks.credit.engines.ghost_routes import _cut, _spans
    from lens_callbacks.credit.engines.rules import Factors

    g = torch.Generator().manual_seed(3)
    r, n = 5, 9
    L = torch.randint(0, 7, (r, n), generator=g) if index else torch.randn(r, n, 4, generator=g)
    R = torch.randn(r, n, 3, generator=g)
    # row 0: a prompt of 3 positions (no output gradient); row 1: padding after 6; row 2: both, and a dead
    # position inside its span (kept: only the ends are cut); row 3: nothing live; row 4: live throughout
    # except its left factor's last position, which only a dense use can have dead
    R[0, :3] = 0
    R[1, 6:] = 0
    R[2, :2] = 0
    R[2, 7:] = 0
    R[2, 4] = 0
    R[3] = 0
    if not index:
        L[4, -1] = 0
    f = Factors(L, R, index)
    want = _naive_spans(L, R, index)
    got = _spans(f).tolist()
    for w, (a, b) in zip(want, got):
        assert (a, b) == w if w else a >= b
    cut, rows = _cut(f)
    a = min(w[0] for w in want if w)
    b = max(w[1] for w in want if w)
    assert cut.R.shape[1] == b - a and torch.equal(cut.R, R[:, a:b]) and torch.equal(cut.L, L[:, a:b])
    assert cut.R.data_ptr() == R[:, a:b].data_ptr()  # a view: no copy of the factor
    for k, w in enumerate(want):
        x, y = rows[k]
        assert (x + a, y + a) == w if w else x >= y


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 70),
    runs=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70), st.booleans()), min_size=1, max_size=5),
    index=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dead_runs_of_any_length_are_found_as_a_position_by_position_loop_finds_them(n, runs, index, seed):
    # dead runs at either end of any length, up to the whole row (read inward in chunks of 1, 2, 4, …),
    # and dead positions inside a row, which stay
    from lens_callbacks.credit.engines.ghost_routes import _spans
    from lens_callbacks.credit.engines.rules import Factors

    g = torch.Generator().manual_seed(seed)
    r = len(runs)
    L = torch.randint(0, 7, (r, n), generator=g) if index else torch.randn(r, n, 3, generator=g)
    R = torch.randn(r, n, 2, generator=g)
    for k, (a, b, inside) in enumerate(runs):
        R[k, : min(a, n)] = 0
        if not index:
            L[k, max(0, n - b) :] = 0
        else:
            R[k, max(0, n - b) :] = 0
        if inside:
            R[k, n // 2] = 0
    want = _naive_spans(L, R, index)
    got = _spans(Factors(L, R, index))
    if got is None:
        assert all(w == (0, n) for w in want)
        return
    for w, (a, b) in zip(want, got.tolist()):
        assert (a, b) == w if w else a >= b


def test_nothing_is_cut_when_every_row_ends_live_and_a_nan_counts_as_live():
    from lens_callbacks.credit.engines.ghost_routes import _cut, _spans
    from lens_callbacks.credit.engines.rules import Factors

    g = torch.Generator().manual_seed(4)
    L, R = torch.randn(3, 6, 4, generator=g), torch.randn(3, 6, 2, generator=g)
    R[:, 2] = 0  # dead inside every row only
    assert _spans(Factors(L, R, False)) is None
    f, rows = _cut(Factors(L, R, False))
    assert f.L is L and rows is None
    L[:, 0] = 0
    L[1, 0, 2] = float("nan")  # a NaN term stays in the products, so the audit shows it
    assert _spans(Factors(L, R, False)).tolist() == [[1, 6], [0, 6], [1, 6]]


@pytest.mark.parametrize("by_part", [True, False])
def test_the_head_multiplies_only_the_positions_its_loss_reaches(by_part, monkeypatch):
    # Prompts of 5 positions and padding after each answer leave the head's output gradient zero there: the
    # direct route's products skip those ends (row by row on the CPU's one-part path) and stay exact.
    from lens_callbacks.credit.engines import ghost, ghost_routes

    monkeypatch.setattr(ghost, "_WHOLE", 0)  # every weight read a block of its rows at a time, as a real head is
    monkeypatch.setattr(ghost_routes, "_by_part", lambda device, numel: by_part)
    monkeypatch.setattr(ghost_routes, "_CUT_MIN", 0)  # the dead ends looked for at a toy's size too
    seen = []
    real_cut = ghost_routes._cut

    def spy(f):
        out = real_cut(f)
        seen.append((tuple(f.R.shape), out[0].R.shape[1], out[1]))
        return out

    monkeypatch.setattr(ghost_routes, "_cut", spy)
    module = TwiceLinear()
    g = torch.Generator().manual_seed(5)
    B, T, prompt = 4, 12, 5
    tokens = torch.randint(0, 11, (B, T), generator=g)
    trained = torch.zeros(B, T, dtype=torch.bool)
    ends = [12, 9, 7, 10]
    for k, e in enumerate(ends):
        trained[k, prompt:e] = True
    batch = (tokens, trained, torch.randn(B, generator=g, dtype=torch.float64), torch.arange(B) // 2)
    ref = reference(module, batch, "by_rollout")
    got = disintegrate_ghost(module, batch, "by_rollout", dtype="float64", readings="shares", route="direct")
    assert_same_readings(ref, got)
    head = [(shape, n, rows) for shape, n, rows in seen if shape[-1] == 30]  # the head's right factor: [B, n, 5·d]
    assert head, seen
    for shape, n, rows in head:
        assert n < shape[1]
        if by_part:
            assert rows is not None and [y - x for x, y in rows] == [e - prompt for e in ends]


@pytest.mark.parametrize("own_backward", [True, False])
def test_a_check_along_v_reads_what_the_full_check_reads_and_catches_a_wrong_grad(own_backward):
    # along=True forms no Σ_S g_S: the parts' dots are held against <g_full, v>; v is not g_full here
    module, batch = TwiceLinear(), layer_batch(V=11)
    ref = disintegrate(module, batch, "by_rollout", dtype="float64", engine="reference", keep_parts=True)
    params = [p for p in module.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(3)
    v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    g_full = None if own_backward else list(ref.grads.g_full)
    kw = dict(dtype="float64", engine="ghost", readings="projected", project_onto=v, full_grad=g_full)
    full = disintegrate(module, batch, "by_rollout", **kw)
    along = disintegrate(module, batch, "by_rollout", along=True, **kw)
    vv = sum(float((x * x).sum()) for x in v)
    for k, parts in enumerate(ref.grads.parts):  # <g_S, v> / ‖v‖² by the reference's own part gradients
        want = sum(float((a * b).sum()) for a, b in zip(parts, v)) / vv
        assert along.projected_share[k] == pytest.approx(want, rel=TOL, abs=1e-15)
        assert along.projected_share[k] == pytest.approx(full.projected_share[k], rel=TOL, abs=1e-15)
    assert along.conservation_error <= 1e-13 and not along.conservation_violated
    if not own_backward:  # a g_full that is not the parts' sum: caught along v as by the full check
        wrong = [x * 1.01 if i == 1 else x for i, x in enumerate(g_full)]
        bad = disintegrate(module, batch, "by_rollout", along=True, **{**kw, "full_grad": wrong})
        assert bad.conservation_violated and bad.conservation_error > 1e-6


def test_along_without_a_vector_is_refused_by_name():
    module, batch = TwiceLinear(), layer_batch(V=11)
    with pytest.raises(ValueError, match="`along=True` must come with `project_onto`"):
        disintegrate(module, batch, "by_rollout", dtype="float64", readings="projected", along=True)


@pytest.mark.parametrize("m,n", [(3, 100), (8, 256), (8, 1025), (5, 70001), (64, 8192)])
def test_fine_products_match_numpy_in_float64(m, n):
    """The blocked float32 products, summed in float64, against numpy's float64 products of the same float32
    values: every dot within float32's unit roundoff (2⁻²⁴) of its summed magnitudes, however much its terms
    cancel (a head's rows against ``p − e_y``; a product over the whole row drifts past it), with or
    without the Gram or the norms, over column counts under, at and past a block, with a tail."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(m * n)
    P = torch.randn(m, n, generator=g)
    w = torch.randn(n, generator=g)
    P64, w64 = P.numpy().astype(np.float64), w.numpy().astype(np.float64)
    scale = np.abs(P64) @ np.abs(w64)  # [m] what rounding is measured against
    gram = P64 @ P64.T
    for want_gram, diag in ((False, False), (True, False), (False, True)):
        dots, G = fine_products(P, w, want_gram, diag)
        assert dots.dtype == torch.float64 and tuple(dots.shape) == (m,)
        assert np.max(np.abs(dots.numpy() - P64 @ w64) / scale) < 2.0**-24
        if not want_gram and not diag:
            assert G is None
            continue
        ref = np.diag(gram) if diag else gram
        assert G.dtype == torch.float64
        assert np.max(np.abs(G.numpy() - ref)) / np.max(np.abs(ref)) < 1e-6
    # a non-contiguous block reads the same
    Pt = P.T.contiguous().T
    assert torch.equal(fine_products(Pt, w, False, False)[0], fine_products(P, w, False, False)[0])


def test_fine_products_of_no_columns_are_zeros():
    """A block with no columns (a part-less parameter slice) gives zero dots and a zero Gram, in float64."""
    P, w = torch.zeros(4, 0), torch.zeros(0)
    for want_gram, diag in ((False, False), (True, False), (False, True)):
        dots, G = fine_products(P, w, want_gram, diag)
        assert dots.dtype == torch.float64 and torch.equal(dots, torch.zeros(4, dtype=torch.float64))
        if want_gram or diag:
            assert torch.equal(G, torch.zeros((4, 4) if want_gram else (4,), dtype=torch.float64))
