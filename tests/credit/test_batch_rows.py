"""A ``credit_terms`` that runs the model once per chunk of rows (a trainer's micro-batches).

Under :func:`batch_rows` the one-pass engine stacks each layer's calls into one call on the whole batch,
so no parameter needs the fallback (one backward per part); the readings are held against the reference
engine (one masked backward per part) in float64. Without it, or with spans that do not tile the batch,
the parameters take the exact fallback: still exact, and ``coverage`` says which path read what.
"""

from __future__ import annotations

import pytest
import torch

from lens_callbacks.credit import CreditTerms, by_rollout, disintegrate
from lens_callbacks.credit.engines.ghost import RideAlong, RowInteraction, batch_rows, disintegrate_ghost
from tests.credit.test_ghost_engine import LayerPolicy, assert_same_readings, both, layer_batch


class ChunkedPolicy(LayerPolicy):
    """:class:`LayerPolicy` whose terms are computed chunk by chunk of rows and stacked in order."""

    def __init__(self, chunks, spans="rows", **kw):
        super().__init__(**kw)
        self.chunks = chunks  # rows per chunk
        self.spans = spans  # "rows": each chunk under its rows; None: no batch_rows; a list: these spans

    def chunk_terms(self, tokens, trained, adv, n_trained):
        B, T = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(T)[None])  # [b, T, d]
        causal = torch.tril(torch.ones(T, T, dtype=x.dtype)) / torch.arange(1, T + 1, dtype=x.dtype)[:, None]
        h = self.frozen(torch.tanh(self.fc(self.norm(causal @ x))))  # [b, T, d]
        if self.scale is not None:
            h = h * self.scale
        lp = torch.log_softmax(self.head(h[:, :-1]), -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [b, T-1]
        lp = torch.nn.functional.pad(lp, (1, 0))  # [b, T]
        return -adv[:, None] * lp * trained / n_trained  # [b, T]

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        n_trained = trained.sum().clamp_min(1)
        out, r0 = [], 0
        for k, n in enumerate(self.chunks):
            rows = slice(r0, r0 + n)
            span = (r0, r0 + n) if self.spans == "rows" else None if self.spans is None else self.spans[k]
            with batch_rows(*span) if span is not None else torch.enable_grad():
                out.append(self.chunk_terms(tokens[rows], trained[rows], adv[rows], n_trained))
            r0 += n
        return CreditTerms(torch.cat(out), trained, torch.arange(tokens.shape[0]), group)


def _trainable(module):
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("chunks", [[2, 3, 1], [1] * 6], ids=["2-3-1", "rows"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
def test_chunks_under_batch_rows_read_in_one_pass(chunks, tie, partition):
    whole = LayerPolicy(tie=tie, bare=False)
    chunked = ChunkedPolicy(chunks, tie=tie, bare=False)
    batch = layer_batch(B=6)
    ref, got = both(chunked, batch, partition)
    assert_same_readings(ref, got)
    # the same paths as the unchunked forward: nothing falls back
    _, one = both(whole, batch, partition)
    assert dict(got.coverage) == dict(one.coverage) and "fallback" not in dict(got.coverage)
    assert_same_readings(one, got)  # the chunked terms are the same function


def test_bare_parameter_still_falls_back_alone():
    chunked = ChunkedPolicy([4, 2])
    ref, got = both(chunked, layer_batch(B=6), "by_rollout")
    assert_same_readings(ref, got)
    assert dict(got.coverage)["fallback"] == 8  # the bare `scale` (used once per chunk), nothing else


@pytest.mark.parametrize(
    "spans",
    [None, [(0, 2), (2, 6)], [(0, 3), (3, 5)], [(0, 3), (0, 3)]],
    ids=["none", "overlap-gap", "short", "repeat"],
)
def test_chunks_without_tiling_spans_fall_back_exactly(spans):
    chunked = ChunkedPolicy([3, 3], spans=spans, bare=False)
    ref, got = both(chunked, layer_batch(B=6), "by_rollout")
    assert_same_readings(ref, got)
    assert dict(got.coverage) == {"fallback": _trainable(chunked)}


def test_float32_chunks_conserve():
    chunked = ChunkedPolicy([1, 4, 1], bare=False)
    got = disintegrate_ghost(chunked, layer_batch(B=6), "by_rollout", dtype="float32")
    assert "fallback" not in dict(got.coverage)
    assert got.conservation_error <= 1e-6 and abs(sum(got.projected_share) - 1) <= 1e-6


def test_ride_along_stacks_the_spans():
    chunked = ChunkedPolicy([2, 4], bare=False)
    batch = layer_batch(B=6)
    ref, _ = both(chunked, batch, "by_rollout")
    chunked.zero_grad(set_to_none=True)
    ride = RideAlong(chunked).start()
    try:
        loss = chunked.credit_terms(batch).terms.sum()
        ride.on_loss(loss, by_rollout)
        loss.backward()
        got = ride.report(by_rollout, partition_name="by_rollout")
    finally:
        ride.clear()
    assert not isinstance(got, str), got
    assert_same_readings(ref, got, tol=1e-12)


def test_ride_along_with_spans_that_do_not_tile_says_why():
    chunked = ChunkedPolicy([2, 4], spans=[(0, 2), (3, 6)], bare=False)
    ride = RideAlong(chunked).start()
    try:
        loss = chunked.credit_terms(layer_batch(B=6)).terms.sum()
        ride.on_loss(loss, by_rollout)
        loss.backward()
        got = ride.report(by_rollout, partition_name="by_rollout")
    finally:
        ride.clear()
    assert isinstance(got, str) and "do not tile" in got and "(3, 6)" in got


@pytest.mark.parametrize("bad", [(-1, 2), (3, 3), (2, 1), (0.0, 2)])
def test_batch_rows_rejects_bad_spans(bad):
    with pytest.raises(ValueError, match=r"0 <= start < stop, got start="):
        with batch_rows(*bad):
            pass


def test_batch_rows_outside_an_audit_changes_nothing():
    chunked = ChunkedPolicy([2, 4])
    plain = ChunkedPolicy([2, 4], spans=None)
    batch = layer_batch(B=6)
    a = chunked.credit_terms(batch).terms
    b = plain.credit_terms(batch).terms
    assert torch.equal(a, b)


def test_a_mislabelled_span_is_caught_by_verify_part():
    # the chunks are stacked as rows 0:3, 3:6 but say 3:6, 0:3: the spans tile, so the calls are stacked,
    # each row's piece under the other chunk's rows; only a part's own backward can tell
    chunked = ChunkedPolicy([3, 3], spans=[(3, 6), (0, 3)], bare=False)
    batch = layer_batch(B=6)
    got = disintegrate_ghost(chunked, batch, "by_rollout", dtype="float64")
    ref = disintegrate(chunked, batch, "by_rollout", dtype="float64", engine="reference")
    assert max(abs(a - b) for a, b in zip(got.projected_share, ref.projected_share)) > 1e-3  # mislabelled
    with pytest.raises(RowInteraction):
        disintegrate_ghost(chunked, batch, "by_rollout", dtype="float64", verify_part=True)


def test_chunks_with_the_trainers_gradient():
    # full_grad: the backward runs to the layers' outputs only (every call's), the stacked uses are read after it
    chunked = ChunkedPolicy([2, 1, 3], bare=False)
    batch = layer_batch(B=6)
    leaves = [p for p in chunked.parameters() if p.requires_grad]
    grad = torch.autograd.grad(chunked.credit_terms(batch).terms.sum(), leaves)  # what the trainer's .grad holds
    ref = disintegrate(chunked, batch, "by_group", dtype="float64", engine="reference", keep_parts=True)
    got = disintegrate(chunked, batch, "by_group", dtype="float64", full_grad=list(grad))
    assert got.engine == "ghost+grad" and "fallback" not in dict(got.coverage)
    assert_same_readings(ref, got)
