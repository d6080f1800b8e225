"""Stable-name partitions: each part is the sum of the matching rollouts' parts.

Reference: ``disintegrate(..., "by_rollout", keep_parts=True)`` (the reference engine, float64) gives
every rollout's gradient vector; summing the rollouts of a part must give the part's own gradient,
taken by its own backward pass, to 1e-12. The derived shares (summed without a backward) must equal
the engine's shares for that partition.
"""

from __future__ import annotations

import pytest
import torch

from lens_callbacks.credit import CreditTerms, Partition, by_rollout, disintegrate
from lens_callbacks.credit.inputs.partition import (
    PARTITIONS,
    by_advantage_sign,
    by_reward,
    by_source,
    reward_levels,
)
from lens_callbacks.credit.readings.derived import coarsening, derive_shares, rows_per_part
from tests.credit.test_engine import TinyPolicy, make_batch

SOURCES = ("easy", "medium", "hard")


class LabelledPolicy(TinyPolicy):
    """The engine tests' toy policy, handing over advantages, rewards and a source label per row."""

    def credit_terms(self, batch) -> CreditTerms:
        tokens, trained, adv, group, segment, rewards, source = batch
        base = super().credit_terms((tokens, trained, adv, group, segment))
        return CreditTerms(
            base.terms,
            base.trained,
            base.rollout,
            base.group,
            advantages=adv,
            rewards=rewards,
            source=source,
            source_names=SOURCES,
        )


def labelled_batch(seed: int, B: int = 8, continuous: bool = False):
    tokens, trained, adv, group, segment = make_batch(B=B, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    if continuous:
        rewards = torch.rand(B, generator=g, dtype=torch.float64)
    else:
        rewards = torch.randint(0, 3, (B,), generator=g).double() / 2  # levels 0, 0.5, 1
    adv = adv.clone()
    adv[0] = 0.0  # one row with zero advantage
    source = torch.randint(0, 2, (B,), generator=g)  # "hard" never appears: it must still be a part
    return tokens, trained, adv, group, segment, rewards, source


def _flat(vecs):
    return torch.cat([v.reshape(-1) for v in vecs])


@pytest.mark.parametrize(
    "name, continuous",
    [("by_advantage_sign", False), ("by_reward", False), ("by_source", False), ("by_reward", True)],
)
def test_parts_equal_sums_of_their_rollouts(name, continuous):
    m = LabelledPolicy()
    batch = labelled_batch(seed=3, continuous=continuous)
    fn = PARTITIONS[name]
    direct = disintegrate(m, batch, fn, dtype="float64", keep_parts=True)
    rolls = disintegrate(m, batch, "by_rollout", dtype="float64", keep_parts=True)
    terms = m.credit_terms(batch)
    part = fn(terms)
    assert direct.part_names == part.names
    row_part = part.ids.max(dim=1).values  # [B] every row's trained positions lie in one part
    for j, pname in enumerate(part.names):
        rows = [k for k in range(len(row_part)) if int(row_part[k]) == j]
        want = sum((_flat(rolls.grads.parts[k]) for k in rows), torch.zeros_like(_flat(rolls.grads.g_full)))
        got = _flat(direct.grads.parts[j])
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (pname, float((got - want).abs().max()))
    # Shares derived by summing the rollout shares equal the engine's own shares for the partition.
    mapping = coarsening(by_rollout(terms), part)
    assert mapping is not None
    derived = derive_shares(rolls.projected_share, mapping, part, name, rows_per_part(part, terms.trained))
    assert derived.part_names == direct.part_names
    for a, b in zip(derived.projected_share, direct.projected_share):
        assert a == pytest.approx(b, abs=1e-12)
    assert derived.share_sum == pytest.approx(1.0, abs=1e-12)
    assert sum(derived.n_rows) == terms.trained.shape[0]


def test_names_are_stable_across_steps():
    m = LabelledPolicy()
    seen = {name: set() for name in ("by_advantage_sign", "by_source")}
    for seed in range(6):
        terms = m.credit_terms(labelled_batch(seed))
        seen["by_advantage_sign"].add(by_advantage_sign(terms).names)
        seen["by_source"].add(by_source(terms).names)
        assert by_reward(terms).names == tuple(sorted(by_reward(terms).names, key=lambda n: float(n.split("=")[1])))
        assert set(by_reward(terms).names) <= {"reward=0", "reward=0.5", "reward=1"}
        fixed = reward_levels(edges=[0.25, 0.75])(terms).names
        assert fixed == ("reward<0.25", "reward[0.25,0.75)", "reward>=0.75")
        q = reward_levels(max_levels=2, n_bins=4)(m.credit_terms(labelled_batch(seed, continuous=True)))
        assert q.names == ("reward_q1", "reward_q2", "reward_q3", "reward_q4")
    assert seen == {"by_advantage_sign": {("positive", "negative", "zero")}, "by_source": {SOURCES}}


def test_rows_land_in_the_right_parts():
    m = LabelledPolicy()
    batch = labelled_batch(seed=1)
    terms = m.credit_terms(batch)
    adv, rewards, source = batch[2], batch[5], batch[6]
    sign = by_advantage_sign(terms).ids.max(1).values
    want = torch.where(adv > 0, 0, torch.where(adv < 0, 1, 2))
    assert torch.equal(sign, want)
    src = by_source(terms).ids.max(1).values
    assert torch.equal(src, source)
    rp = by_reward(terms)
    lv = rp.ids.max(1).values
    assert [rp.names[i] for i in lv] == [f"reward={float(r):g}" for r in rewards]
    # Equal-count rank bins: two rows per bin with B = 8, the largest rewards in the top bin.
    c = labelled_batch(seed=1, continuous=True)
    q = reward_levels(max_levels=2, n_bins=4)(m.credit_terms(c)).ids.max(1).values
    order = torch.argsort(c[5])
    assert q[order].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_missing_labels_and_bad_inputs_are_clear_errors():
    t = CreditTerms(
        torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.arange(2), torch.zeros(2, dtype=torch.long)
    )
    for fn, field in ((by_advantage_sign, "advantages"), (by_reward, "rewards"), (by_source, "source")):
        with pytest.raises(ValueError, match=f"CreditTerms.{field}"):
            fn(t)
    with pytest.raises(ValueError, match="`source` ids must index `source_names`"):
        CreditTerms(
            torch.zeros(2, 3),
            torch.ones(2, 3, dtype=torch.bool),
            torch.arange(2),
            torch.zeros(2, dtype=torch.long),
            source=torch.tensor([0, 2]),
            source_names=("a", "b"),
        ).validate()
    with pytest.raises(ValueError, match="`advantages` must be a \\[B\\] = \\[2\\] float tensor"):
        CreditTerms(
            torch.zeros(2, 3),
            torch.ones(2, 3, dtype=torch.bool),
            torch.arange(2),
            torch.zeros(2, dtype=torch.long),
            advantages=torch.tensor([1, 0]),
        ).validate()
    with pytest.raises(ValueError, match="`edges` must be a non-empty increasing"):
        reward_levels(edges=[1.0, 0.5])


def test_an_undefined_reading_is_undefined_for_every_derived_part():
    terms = LabelledPolicy().credit_terms(labelled_batch(seed=1))
    part = by_advantage_sign(terms)
    got = derive_shares([float("nan")] * 8, coarsening(by_rollout(terms), part), part, "by_advantage_sign")
    assert all(v != v for v in got.projected_share)  # NaN, not 0.0 for an empty part


def test_coarsening_detects_a_partition_that_is_not_a_union():
    ids = torch.tensor([[0, 0, 1], [1, 1, -1]])
    fine = Partition(torch.tensor([[0, 0, 0], [1, 1, -1]]), ("r0", "r1"))
    assert coarsening(fine, Partition(ids, ("a", "b"))) is None  # row 0 is split between a and b
    assert coarsening(fine, Partition(torch.tensor([[1, 1, 1], [0, 0, -1]]), ("a", "b"))) == [1, 0]
