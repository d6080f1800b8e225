"""Riding along an accumulated step: each micro-batch captured on its own backward, read once against ``.grad``."""

from __future__ import annotations

import pytest
import torch

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.engines.ghost import RideAlong, report_accumulated
from lens_callbacks.credit.inputs.partition import by_group, by_rollout
from lens_callbacks.credit.inputs.terms import cat_terms
from tests.credit.test_ghost_rules import VocabPolicy, assert_same, vocab_batch

PARTITIONS = {"by_rollout": by_rollout, "by_group": by_group}


class MicroPolicy(VocabPolicy):
    """``credit_terms(micro)`` for one micro-batch (its rows numbered from the micro-batch's offset, its terms
    divided by the accumulation count), ``credit_terms([micro, ...])`` for the whole step (rows stacked)."""

    def credit_terms(self, batch):
        if isinstance(batch, list):
            return cat_terms([self.credit_terms(mb) for mb in batch])
        tokens, trained, adv, group, offset, accum = batch
        t = super().credit_terms((tokens, trained, adv, group))
        rows = torch.arange(tokens.shape[0]) + offset
        return CreditTerms(t.terms / accum, t.trained, rows, group)


def micro_batches(n=2, B=4, dtype=torch.float64):
    out = []
    for k in range(n):
        tokens, trained, adv, _ = vocab_batch(B=B, seed=10 + k, dtype=dtype)
        group = (torch.arange(B) + k * B) // 3  # a group of 3 rows: some groups span two micro-batches
        out.append((tokens, trained, adv, group, k * B, n))
    return out


def capture(module, micro, scale=1.0, declare=True, lose_first=False):
    """One RideAlong per micro-batch, each only capturing its own backward of ``scale · terms.sum()``."""
    riders = []
    for i, mb in enumerate(micro):
        r = RideAlong(module).start()
        loss = module.credit_terms(mb).terms.sum() * scale
        r.on_loss(loss, **({"scale": scale} if declare and scale != 1.0 else {}))
        loss.backward()
        r.stop()
        riders.append(r)
        if lose_first and i == 0:
            module.zero_grad(set_to_none=True)  # the first micro-batch's gradient never reaches .grad
    return riders


def ride_accumulated(module, micro, partition, readings, **kw):
    riders = capture(module, micro)
    try:
        return report_accumulated(riders, PARTITIONS[partition], partition_name=partition, readings=readings, **kw)
    finally:
        for r in riders:
            r.clear()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
@pytest.mark.parametrize("readings", ["all", "shares"])
def test_an_accumulated_step_equals_the_reference_over_the_whole_step(tie, partition, readings):
    module, micro = MicroPolicy(tie=tie), micro_batches()
    ref = disintegrate(module, micro, partition, dtype="float64", engine="reference", keep_parts=True)
    got = ride_accumulated(module, micro, partition, readings)
    assert not isinstance(got, str), got
    assert got.engine == "ghost+training_step"
    assert_same(ref, got)
    if partition == "by_group":  # the parts whose rows lie in both micro-batches were read whole
        assert len(got.part_names) < 8


def test_the_conservation_error_holds_the_parts_against_grad_not_against_themselves():
    module, micro = MicroPolicy(tie=False), micro_batches()
    got = ride_accumulated(module, micro, "by_rollout", "shares", keep_grads=True)
    assert not isinstance(got, str), got
    # The kept full gradient is the accumulated .grad; the parts' sum is assembled from the captured pieces.
    trained = [p for p in module.parameters() if p.requires_grad]
    for g, s, p in zip(got.grads.g_full, got.grads.parts_sum, trained):
        assert torch.equal(g, p.grad)
        assert float((s - p.grad).abs().max()) <= 1e-12 * max(1.0, float(p.grad.abs().max()))
    # A micro-batch's backward that .grad never saw breaks the sum, and the reading says so.
    module.zero_grad(set_to_none=True)
    out = report_accumulated(capture(module, micro, lose_first=True), by_rollout, readings="shares")
    assert isinstance(out, str) and "do not add up to `.grad`" in out, out


def test_float32_accumulated_shares_match_float64():
    module, micro = MicroPolicy(tie=True, dtype=torch.float32), micro_batches(dtype=torch.float32)
    got = ride_accumulated(module, micro, "by_rollout", "shares")
    assert not isinstance(got, str), got
    # The reductions: against the reference engine in the same float32 arithmetic, one backward per part.
    ref32 = disintegrate(module, micro, "by_rollout", dtype="float32", engine="reference")
    assert max(abs(a - b) for a, b in zip(ref32.projected_share, got.projected_share)) < 1e-7
    assert abs(sum(got.projected_share) - 1.0) < 1e-7
    # Against float64 the step's own float32 forward and backward differ by 4e-7 on this policy.
    ref64 = disintegrate(module, micro, "by_rollout", dtype="float64", engine="reference")
    assert max(abs(a - b) for a, b in zip(ref64.projected_share, got.projected_share)) < 1e-6


def test_a_partition_given_at_on_loss_is_a_clear_error():
    module, micro = MicroPolicy(), micro_batches(n=1)
    r = RideAlong(module).start()
    loss = module.credit_terms(micro[0]).terms.sum()
    r.on_loss(loss, by_rollout)
    loss.backward()
    r.stop()
    with pytest.raises(ValueError, match=r"riders\[0\].*without a partition"):
        report_accumulated([r], by_rollout)
    r.clear()
    with pytest.raises(ValueError, match="one RideAlong per micro-batch"):
        report_accumulated([], by_rollout)


def test_micro_batches_of_different_lengths_are_a_reason_not_a_crash():
    module = MicroPolicy(T=14)
    a = micro_batches(n=1)[0]
    tokens, trained, adv, _ = vocab_batch(B=4, T=14, seed=3)
    b = (tokens, trained, adv, torch.arange(4), 4, 2)
    out = report_accumulated(capture(module, [a, b]), by_rollout)
    assert isinstance(out, str) and "positions per row" in out, out


def test_cat_terms_pads_and_keeps_only_fields_every_part_has():
    t1 = CreditTerms(
        torch.ones(2, 3),
        torch.ones(2, 3, dtype=torch.bool),
        torch.arange(2),
        torch.zeros(2, dtype=torch.long),
        rewards=torch.ones(2),
        segment=torch.zeros(2, 3, dtype=torch.long),
        text=("a", "b"),
    )
    t2 = CreditTerms(
        torch.ones(1, 5),
        torch.ones(1, 5, dtype=torch.bool),
        torch.arange(2, 3),
        torch.ones(1, dtype=torch.long),
        segment=torch.zeros(1, 5, dtype=torch.long),
        text=("c",),
    )
    t = cat_terms([t1, t2])
    assert t.terms.shape == (3, 5) and float(t.terms[:2, 3:].abs().sum()) == 0.0
    assert not bool(t.trained[:2, 3:].any()) and bool((t.segment[:2, 3:] == -1).all())
    assert t.rewards is None and t.text == ("a", "b", "c") and t.rollout.tolist() == [0, 1, 2]
    t.validate()
    with pytest.raises(ValueError, match="segment_names"):
        cat_terms(
            [t1, CreditTerms(t2.terms, t2.trained, t2.rollout, t2.group, segment=t2.segment, segment_names=("u",))]
        )


def test_a_rollout_id_in_two_micro_batches_names_two_parts_keyed_by_micro_batch():
    module = MicroPolicy()
    micro = [mb[:4] + (0, 2) for mb in micro_batches()]  # both micro-batches number their rows from 0
    ref = disintegrate(module, micro, "by_rollout", dtype="float64", engine="reference", keep_parts=True)
    out = report_accumulated(capture(module, micro), by_rollout)
    assert not isinstance(out, str), out
    assert out.part_names == ref.part_names == tuple(f"mb{j}/rollout_{i}" for j in range(2) for i in range(4))
    assert_same(ref, out)


def test_a_scaled_loss_rides_when_the_scale_is_declared():
    # Lightning divides each micro-batch's loss by the accumulation count: declared, the readings are .grad's.
    module, micro = MicroPolicy(tie=False), [mb[:5] + (1,) for mb in micro_batches()]
    ref = disintegrate(module, micro, "by_rollout", dtype="float64", engine="reference")
    got = report_accumulated(capture(module, micro, scale=0.5), by_rollout)
    assert not isinstance(got, str), got
    for a, b in zip(ref.projected_share, got.projected_share):
        assert abs(a - b) <= 1e-12
    for a, b in zip(ref.part_norm, got.part_norm):
        assert abs(a / 2 - b) <= 1e-12 * max(ref.part_norm)
    # undeclared, the same loss is refused by name
    out = report_accumulated(capture(module, micro, scale=0.5, declare=False), by_rollout)
    assert isinstance(out, str) and "micro-batch 0" in out and "is not `terms.sum()`" in out, out
