"""Rollouts packed into rows, read in one pass: equal to the same rollouts unpacked, and checked, not assumed.

Two rows each pack two rollouts (position ids restarting, no attention mask: transformers builds a
block-diagonal causal mask). Reference: the same four rollouts unpacked, one per row, audited by the
reference engine (one backward per rollout) — float64, transformers' float32 RMSNorm patched. Every engine
must give each rollout the same shares. With the position ids not restarting, attention crosses the
rollouts: the one-pass engine's check must fire, by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.engines.ghost import SpansInteract, disintegrate_ghost
from lens_callbacks.credit.inputs.partition import by_rollout, packed_rollouts
from tests.callbacks.test_turn_credit import rmsnorm_float64  # noqa: F401  (the float32 spots patched)

V, L = 48, 6  # vocabulary, positions per rollout
ADV = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
TOL = 1e-12


def _net(attn: str = "sdpa", tie: bool = False) -> nn.Module:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(cfg).double()


def _tokens():
    return torch.randint(0, V, (4, L), generator=torch.Generator().manual_seed(1))  # four rollouts


class Packed(nn.Module):
    """Rows of two rollouts each; ``restart=False`` keeps the positions running, so attention crosses them."""

    def __init__(self, net: nn.Module, restart: bool = True) -> None:
        super().__init__()
        self.net, self.restart = net, restart

    def credit_terms(self, batch=None) -> CreditTerms:
        ids = _tokens().reshape(2, 2 * L)  # [2, 12]
        pos = torch.arange(2 * L)[None].expand(2, -1) % (L if self.restart else 2 * L)
        logits = self.net(input_ids=ids, position_ids=pos, use_cache=False).logits
        lp = nn.functional.pad(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
        rollout = packed_rollouts(torch.arange(2 * L)[None].expand(2, -1) % L)  # [2, 12]: 0 0 .. 1 1 / 2 .. 3
        trained = torch.ones_like(ids, dtype=torch.bool)
        trained[:, 0] = trained[:, L] = False  # each rollout's first token has no term
        terms = torch.where(trained, -ADV[rollout] * lp / trained.sum(), torch.zeros_like(lp))
        return CreditTerms(terms, trained, rollout, torch.zeros(2, dtype=torch.long))


class Unpacked(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def credit_terms(self, batch=None) -> CreditTerms:
        ids = _tokens()  # [4, 6]
        logits = self.net(input_ids=ids).logits
        lp = nn.functional.pad(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
        trained = torch.ones_like(ids, dtype=torch.bool)
        trained[:, 0] = False
        terms = torch.where(trained, -ADV[:, None] * lp / trained.sum(), torch.zeros_like(lp))
        return CreditTerms(terms, trained, torch.arange(4), torch.zeros(4, dtype=torch.long))


def test_packed_rollouts_name_their_spans():
    part = by_rollout(Packed(_net()).credit_terms())
    assert part.names == ("rollout_0", "rollout_1", "rollout_2", "rollout_3")
    assert part.positions.tolist()[0] == [0] * L + [1] * L  # the prompt positions belong to their rollout
    assert int((part.ids >= 0).sum()) == 2 * (2 * L - 2)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(
    "engine, readings",
    [("ghost", "all"), ("ghost", "shares"), ("ghost", "projected"), ("reference", "all"), ("jvp", "projected")],
)
def test_packed_equals_unpacked_per_rollout_in_every_engine(engine, readings, tie, rmsnorm_float64):
    net = _net(tie=tie)
    ref = disintegrate(Unpacked(net), None, "by_rollout", dtype="float64", engine="reference")
    got = disintegrate(
        Packed(net), None, "by_rollout", dtype="float64", engine=engine, readings=readings, verify_part="spans"
    )
    assert got.engine == engine and got.part_names == ref.part_names
    assert max(abs(a - b) for a, b in zip(ref.projected_share, got.projected_share)) <= TOL
    if readings != "projected":
        assert max(abs(a - b) for a, b in zip(ref.norm_share, got.norm_share)) <= TOL
        assert abs(ref.cancellation - got.cancellation) <= TOL * ref.cancellation
    if engine == "ghost":
        assert got.spans and got.spans_verified and "fallback" not in dict(got.coverage)
        assert got.conservation_error <= 1e-13


def test_attention_across_packed_rollouts_is_caught_by_name():
    crossed = Packed(_net(), restart=False)
    with pytest.raises(SpansInteract, match="attention crosses the packed rollouts"):
        disintegrate(crossed, None, "by_rollout", dtype="float64", verify_part="spans")
    # unchecked, the one-pass reading would be wrong: the reference engine's loss-mask shares differ from it
    got = disintegrate_ghost(crossed, None, by_rollout, dtype="float64")
    ref = disintegrate(crossed, None, "by_rollout", dtype="float64", engine="reference")
    assert max(abs(a - b) for a, b in zip(ref.projected_share, got.projected_share)) > 1e-4
    assert got.conservation_error <= 1e-13  # which conservation alone does not see: hence the check


def test_the_callback_checks_packed_readings_and_refuses_crossed_attention_by_name():
    import lightning.pytorch as pl

    from lens_callbacks.callbacks import CreditAuditCallback

    class Lit(pl.LightningModule):
        def __init__(self, restart):
            super().__init__()
            self.inner = Packed(_net(), restart)

        def credit_terms(self, batch=None):
            return self.inner.credit_terms()

        def training_step(self, batch, batch_idx):
            return self.credit_terms().terms.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(restart, capture):
        audit = CreditAuditCallback(capture=capture, dtype="float64", log_figure=False, log_table_every_n_steps=0)
        audit.verify_spans_every = 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.Trainer(
                max_steps=3,
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[audit],
            ).fit(Lit(restart), torch.utils.data.DataLoader(range(3), batch_size=None))
        return audit

    for capture in ("separate", "training_step"):
        ok = fit(True, capture)
        assert ok.n_refusals == 0 and ok.last_report.spans
        assert ok.n_spans_readings == 3 and ok.n_spans_checks == 2  # steps 0 and 2 held to their own backward
        bad = fit(False, capture)
        assert bad.last_refusal is not None and bad.last_refusal.condition == "packed_attention", bad.last_refusal
        assert "block-diagonal" in bad.last_refusal.remedy
        assert bad.n_refusals == 3  # after a failed check every packed reading is checked: none is shown


LENGTHS = ((4, 8), (5, 5))  # per row: rollouts of unequal lengths, the second row padded by 2


class Uneven(nn.Module):
    """Rows packing rollouts of unequal lengths, the shorter row padded (its padding in no rollout)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def credit_terms(self, batch=None) -> CreditTerms:
        T = 12
        ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
        pos = torch.zeros(2, T, dtype=torch.long)
        valid = torch.zeros(2, T, dtype=torch.bool)
        for r, lens in enumerate(LENGTHS):
            pos[r, : sum(lens)] = torch.cat([torch.arange(n) for n in lens])
            valid[r, : sum(lens)] = True
        # no attention mask: transformers splits the row where the position ids restart (each padding
        # position, at 0, is a sequence of its own)
        logits = self.net(input_ids=ids, position_ids=pos, use_cache=False).logits
        lp = nn.functional.pad(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
        rollout = packed_rollouts(pos, valid)  # [2, 12]
        trained = valid & (pos > 0)
        adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)
        terms = torch.where(trained, -adv[rollout.clamp(min=0)] * lp / trained.sum(), torch.zeros_like(lp))
        return CreditTerms(terms, trained, rollout, torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("readings", ["all", "shares", "projected"])
def test_uneven_packed_rollouts_equal_the_reference_engine(readings, rmsnorm_float64):
    module = Uneven(_net())
    ref = disintegrate(module, None, "by_rollout", dtype="float64", engine="reference")
    got = disintegrate(
        module, None, "by_rollout", dtype="float64", engine="ghost", readings=readings, verify_part="spans"
    )
    assert got.spans and got.spans_verified and got.part_names == ref.part_names
    assert max(abs(a - b) for a, b in zip(ref.projected_share, got.projected_share)) <= TOL
    if readings != "projected":
        assert max(abs(a - b) for a, b in zip(ref.norm_share, got.norm_share)) <= TOL
    assert got.conservation_error <= 1e-13


@pytest.mark.parametrize(
    "positions, view",
    [
        ([[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]], True),  # one length, one after another: a view of the rows
        ([[-1, 0, 0, 0, 1, 1], [1, 2, 2, 2, 3, 3]], False),  # a part across two rows, unequal lengths
        ([[0, 0, 1, 1, 1, 1], [2, 2, 2, -1, -1, -1]], False),  # padding
        ([[1, 1, 1, 0, 0, 0], [2, 2, 2, 3, 3, 3]], False),  # one length, out of order
    ],
)
def test_part_rows_lay_out_each_part_as_a_naive_loop_does(positions, view):
    from lens_callbacks.credit.engines.ghost import PartRows

    pos = torch.tensor(positions)
    m = int(pos.max()) + 1
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    rows = PartRows(pos, m)
    got = rows.gather(x)
    k = max(int((pos == i).sum()) for i in range(m))
    want = torch.zeros(m, k, 3, dtype=torch.float64)
    for i in range(m):
        at = [(r, t) for r in range(2) for t in range(6) if pos[r, t] == i]  # row order, then position
        for j, (r, t) in enumerate(at):
            want[i, j] = x[r, t]
    assert torch.equal(got, want)
    assert (got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) is view
    flags = torch.rand(2, 6) > 0.5
    assert torch.equal(
        rows.gather(flags),
        torch.stack(
            [torch.cat([flags[pos == i], torch.zeros(k - int((pos == i).sum()), dtype=torch.bool)]) for i in range(m)]
        ),
    )


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("readings", ["shares", "projected"])
def test_uneven_rollouts_are_read_in_place_by_the_direct_route(readings, tie, monkeypatch, rmsnorm_float64):
    """Rollouts of unequal lengths, each one run of the rows' positions: the direct route (one part's piece at a
    time, dead ends cut) reads every Linear weight and the tied head from the runs themselves — no regrouped
    copy of an LM head's output gradient is ever formed — and equals the reference engine."""
    from lens_callbacks.credit.engines import ghost, ghost_routes

    monkeypatch.setattr(ghost_routes, "_PART_MIN", 0)  # a toy's weights read as a real shape's are
    monkeypatch.setattr(ghost_routes, "_CUT_MIN", 0)  # and their dead ends looked for
    monkeypatch.setattr(ghost, "_WHOLE", 0)  # every weight by the blocked routes
    gathered = []
    plain = ghost.PartRows.gather
    monkeypatch.setattr(ghost.PartRows, "gather", lambda self, x: gathered.append(x.shape[-1]) or plain(self, x))
    module = Uneven(_net(tie=tie))
    ref = disintegrate(module, None, "by_rollout", dtype="float64", engine="reference")
    got = disintegrate_ghost(module, None, by_rollout, dtype="float64", readings=readings, route="direct")
    assert got.spans and V not in gathered  # the head's output gradient [.., V] stayed in its rows
    assert max(abs(a - b) for a, b in zip(ref.projected_share, got.projected_share)) <= TOL
    if readings != "projected":
        assert max(abs(a - b) for a, b in zip(ref.norm_share, got.norm_share)) <= TOL
    assert got.conservation_error <= 1e-13 and "fallback" not in dict(got.coverage)


@pytest.mark.parametrize(
    "positions, runs",
    [
        ([[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]], None),  # one length, in order: a view, no runs needed
        ([[0, 0, 1, 1, 1, 1], [2, 2, 2, -1, -1, -1]], [(0, 2), (2, 4), (6, 3)]),  # unequal, padded
        ([[1, 1, 1, 0, 0, 2], [2, 2, 3, 3, 3, 3]], [(3, 2), (0, 3), (5, 3), (8, 4)]),  # out of order, across rows
        ([[0, 1, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]], None),  # part 0 is two runs
    ],
)
def test_part_rows_find_each_part_as_one_run(positions, runs):
    from lens_callbacks.credit.engines.ghost import PartRows

    pos = torch.tensor(positions)
    rows = PartRows(pos, int(pos.max()) + 1)
    assert rows.runs == runs
    if runs is not None:  # each run holds its part's positions, in order
        flat = pos.reshape(-1)
        for i, (a, n) in enumerate(runs):
            assert flat[a : a + n].tolist() == [i] * n and int((flat == i).sum()) == n
