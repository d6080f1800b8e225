"""The outcome→process reward instrument against hand tables and a brute-force reference."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.process import REMEDY, ProcessAudit, RolloutGroup, audit_groups, induced_process_reward
from lens_callbacks.refusal import Refusal

# ---------------------------------------------------------------------------------------------
# An obviously-correct reference: every quantity by its definition, from lists, no trie.


def _brute(completions, rewards):
    K = len(completions)
    comps = [tuple(c) for c in completions]
    R = [float(r) for r in rewards]
    q_root = sum(R) / K
    out = {"counts": [], "values": [], "prs": [], "informative": [], "depth": []}
    for k, c in enumerate(comps):
        L = len(c)
        counts, values, informative = [], [], []
        for t in range(1, L + 1):
            through = [j for j in range(K) if comps[j][:t] == c[:t]]
            counts.append(len(through))
            if t == L:
                values.append(R[k])  # the finished rollout is its own state
                informative.append(False)
            else:
                values.append(sum(R[j] for j in through) / len(through))
                # shared by rollouts with different outcomes that are not all copies of one completion
                informative.append(
                    len(through) >= 2 and len({R[j] for j in through}) > 1 and len({comps[j] for j in through}) > 1
                )
        prev = [q_root] + values[:-1]
        prs = [v - p for v, p in zip(values, prev)]
        alone = [t for t in range(1, L + 1) if counts[t - 1] == 1]
        depth = min(alone[0], L) if alone else L
        for key, v in zip(
            ("counts", "values", "prs", "informative", "depth"), (counts, values, prs, informative, depth)
        ):
            out[key].append(v)
    return out


# ---------------------------------------------------------------------------------------------


def test_never_shared_first_token_fires_the_kill():
    completions = [[11, 3, 4, 5], [12, 3], [13, 4, 4, 4, 4, 4], [14]]
    rewards = [1.0, 0.25, 0.0, 0.75]  # none equal to the mean 0.5, so token one always moves
    r = induced_process_reward(completions, rewards)
    assert r.kill is True
    assert r.common_prefix == () and r.common_prefix_len == 0
    assert r.mean_divergence_depth == 1.0
    assert r.divergence_depth == (1, 1, 1, 1)
    assert r.informative_fraction == 0.0
    expected_zero = sum(1 - 1 / len(c) for c in completions) / len(completions)
    assert r.zero_reward_fraction == pytest.approx(expected_zero, abs=1e-15)
    # every value past the root is the rollout's own outcome; the whole advantage lands on token one
    for k, c in enumerate(completions):
        assert r.values[k] == tuple([rewards[k]] * len(c))
        assert r.process_rewards[k][0] == pytest.approx(rewards[k] - 0.5, abs=1e-15)
        assert all(x == 0.0 for x in r.process_rewards[k][1:])
    v = r.verdict()
    assert isinstance(v, Refusal) and not v
    assert v.condition == "kill"
    assert v.numbers["informative_fraction"] == 0.0 and v.numbers["mean_divergence_depth"] == 1.0
    assert v.numbers["zero_reward_fraction"] == r.zero_reward_fraction
    assert "rung 1" in v.remedy and v.remedy == REMEDY
    assert "REFUSED (kill)" in r.render()


def test_four_rollouts_that_branch_give_the_hand_table():
    # A = 1 2 3 (R=1), B = 1 2 4 (R=0), C = 1 5 (R=1), D = 6 7 (R=0); q(root) = 1/2.
    # n([1]) = 3, q = 2/3; n([1,2]) = 2, q = 1/2; n([6]) = 1, q = 0; finished rollouts carry their R.
    completions = [[1, 2, 3], [1, 2, 4], [1, 5], [6, 7]]
    rewards = [1.0, 0.0, 1.0, 0.0]
    F = Fraction
    hand = {
        "counts": [(3, 2, 1), (3, 2, 1), (3, 1), (1, 1)],
        "values": [(F(2, 3), F(1, 2), F(1)), (F(2, 3), F(1, 2), F(0)), (F(2, 3), F(1)), (F(0), F(0))],
        "prs": [(F(1, 6), F(-1, 6), F(1, 2)), (F(1, 6), F(-1, 6), F(-1, 2)), (F(1, 6), F(1, 3)), (F(-1, 2), F(0))],
        "informative": [(True, True, False), (True, True, False), (True, False), (False, False)],
        "depth": (3, 3, 2, 1),
    }
    r = induced_process_reward(completions, rewards, key="branching")
    assert r.kill is False
    assert r.q_root == 0.5
    assert r.prefix_counts == tuple(hand["counts"])
    for got, want in zip(r.values, hand["values"]):
        assert got == pytest.approx([float(x) for x in want], abs=1e-15)
    for got, want in zip(r.process_rewards, hand["prs"]):
        assert got == pytest.approx([float(x) for x in want], abs=1e-15)
    assert r.informative == tuple(hand["informative"])
    assert r.divergence_depth == hand["depth"]
    assert r.mean_divergence_depth == pytest.approx(9 / 4)
    assert r.informative_fraction == pytest.approx(float((F(2, 3) + F(2, 3) + F(1, 2) + 0) / 4))
    assert r.zero_reward_fraction == pytest.approx(float(F(1, 2) / 4))
    # the function is not constant past the root
    assert len({x for row in r.process_rewards for x in row[1:]}) > 1
    decision, reason = r.verdict()
    assert decision is False and "can be read" in reason
    for k in range(4):  # telescoping
        assert math.fsum(r.process_rewards[k]) == pytest.approx(rewards[k] - r.q_root, abs=1e-15)


def test_equal_outcomes_fire_the_kill_even_with_shared_prefixes():
    r = induced_process_reward([[1, 2], [1, 3]], [0.5, 0.5])
    assert r.kill and r.informative_fraction == 0.0 and r.zero_reward_fraction == 1.0
    assert "same outcome" in r.verdict().reason


@pytest.mark.parametrize("completions", [[[5], [5]], [[5, 6], [5, 6]], [[5, 6, 7, 8], [5, 6, 7, 8]]])
def test_identical_completions_with_different_outcomes_fire_the_kill_with_their_own_reason(completions):
    """Two copies of one completion scored 1 and 0: they share every prefix, yet no token separates the outcomes."""
    r = induced_process_reward(completions, [1.0, 0.0])
    L = len(completions[0])
    # Every strict prefix is valued at the group mean: the process reward is zero until the last token.
    assert r.process_rewards == ((0.0,) * (L - 1) + (0.5,), (0.0,) * (L - 1) + (-0.5,))
    assert r.common_prefix_len == L and r.identical_mixed == ((0, 1),)
    assert r.kill and r.informative_fraction == 0.0
    v = r.verdict()
    assert isinstance(v, Refusal) and v.condition == "kill"
    assert "identical completions carry different outcomes" in v.reason and "rollouts [0, 1]" in v.reason
    assert "outcomes [1.0, 0.0]" in v.reason and "not a function of the completion" in v.reason
    assert "no prefix is shared" not in v.reason and "no other prefix" not in v.reason  # they share all of it
    assert "check the reward" in v.remedy


def test_copies_beside_a_lone_rollout_name_both_causes():
    r = induced_process_reward([[5, 6], [5, 6], [7]], [1.0, 0.0, 1.0])
    assert r.kill and r.identical_mixed == ((0, 1),)
    assert "rollouts [0, 1]" in r.verdict().reason and "no other prefix is shared" in r.verdict().reason


def test_copies_beside_a_different_continuation_are_informative():
    """[5] is shared by three rollouts, two distinct completions with different outcomes: a token below it decides."""
    r = induced_process_reward([[5, 6], [5, 6], [5, 7]], [1.0, 0.0, 0.0])
    assert r.informative == ((True, False), (True, False), (True, False)) and not r.kill
    assert r.identical_mixed == ((0, 1),)
    assert r.verdict()[0] is False


def test_bad_inputs_raise_with_the_fix():
    with pytest.raises(ValueError, match="one outcome per completion"):
        induced_process_reward([[1]], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one rollout"):
        induced_process_reward([], [])
    with pytest.raises(ValueError, match="finite"):
        induced_process_reward([[1]], [float("nan")])


_groups = st.integers(1, 6).flatmap(
    lambda K: st.tuples(
        st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=6), min_size=K, max_size=K),
        st.lists(st.sampled_from([0.0, 0.25, 1.0, -2.0, 3.5]), min_size=K, max_size=K),
    )
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_groups)
def test_random_groups_match_the_brute_force_definitions(group):
    completions, rewards = group
    r = induced_process_reward(completions, rewards)
    ref = _brute(completions, rewards)
    lo, hi = min(rewards), max(rewards)
    assert [list(x) for x in r.prefix_counts] == ref["counts"]
    assert [list(x) for x in r.informative] == ref["informative"]
    assert list(r.divergence_depth) == ref["depth"]
    for k in range(len(completions)):
        assert list(r.values[k]) == pytest.approx(ref["values"][k], abs=1e-12)
        assert list(r.process_rewards[k]) == pytest.approx(ref["prs"][k], abs=1e-12)
        assert all(lo - 1e-12 <= v <= hi + 1e-12 for v in r.values[k])
        if completions[k]:  # a rollout with no trained position carries no process reward
            assert math.fsum(r.process_rewards[k]) == pytest.approx(rewards[k] - r.q_root, abs=1e-12)
    assert r.kill == (not any(any(row) for row in ref["informative"]))
    assert lo - 1e-12 <= r.q_root <= hi + 1e-12


def test_audit_groups_aggregates_every_group():
    groups = [
        RolloutGroup("never_shared", [[1, 2], [3, 4, 5]], [1.0, 0.0]),
        ([[1, 2, 3], [1, 2, 4], [1, 5], [6, 7]], [1.0, 0.0, 1.0, 0.0]),
        {"key": "shared_equal", "completions": [[7, 7], [7, 8]], "rewards": [1.0, 1.0]},
    ]
    a = audit_groups(groups, source="unit")
    assert isinstance(a, ProcessAudit)
    singles = [
        induced_process_reward(g.completions, g.rewards) if isinstance(g, RolloutGroup) else None for g in groups
    ]
    assert a.n_groups == 3 and a.n_killed == 2
    assert a.kill_fraction == pytest.approx(2 / 3)
    depths = [r.mean_divergence_depth for r in a.readings]
    assert a.mean_divergence_depth_range == (min(depths), max(depths))
    assert a.readings[0].mean_divergence_depth == singles[0].mean_divergence_depth == 1.0
    assert a.informative_fraction_max == max(r.informative_fraction for r in a.readings) > 0
    assert a.zero_reward_fraction == pytest.approx(sum(r.zero_reward_fraction for r in a.readings) / 3)
    assert a.readings[2].key == "shared_equal" and a.readings[1].key == "1"
    text = a.render()
    assert "on 2 of 3" in text and "Across the 3 groups" in text
    decision, reason = a.verdict()
    assert decision is False and "2 of 3" in reason
    d = a.to_dict("process/")
    assert d["process/n_killed"] == 2.0


def test_audit_verdict_refuses_when_every_group_is_killed():
    a = audit_groups([([[1], [2]], [0.0, 1.0]), ([[3, 1], [4, 1]], [1.0, 0.0])])
    v = a.verdict()
    assert isinstance(v, Refusal) and v.condition == "kill" and v.numbers["n_killed"] == 2
    assert "on 2 of 2" in a.render() and "maximum over all of them" in a.render()
