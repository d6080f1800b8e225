"""What ``CreditTerms`` and partitions say about bad input: the field that is wrong, how many, where, and the fix."""

from __future__ import annotations

import pytest
import torch

from lens_callbacks.credit import CreditTerms, Partition, by_segment, by_turn
from lens_callbacks.credit.inputs.partition import MissingSegmentsError, PartitionError
from lens_callbacks.credit.inputs.terms import CreditTermsError, validate_terms


def _terms(terms, trained=None, B=2, T=3, **kw):
    trained = torch.ones(B, T, dtype=torch.bool) if trained is None else trained
    return CreditTerms(terms, trained, torch.arange(B), torch.zeros(B, dtype=torch.long), **kw)


def _refused(terms, trained=None, **kw):
    """Construction never raises (it runs inside the training step); the audit's check does."""
    built = _terms(terms, trained, **kw)
    with pytest.raises(CreditTermsError) as err:
        validate_terms(built)
    return err.value


def test_non_zero_terms_at_untrained_positions_are_named_with_count_and_place():
    trained = torch.tensor([[True, True, False], [True, False, False]])
    terms = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.5, -7.0]], requires_grad=True)
    err = _refused(terms * 1.0, trained)  # a tensor with a graph, as credit_terms returns it
    assert err.field == "terms" and err.numbers["untrained_nonzero"] == 2
    msg = str(err)
    assert "`terms` must be exactly 0 at untrained positions" in msg and "(1, 1)" in msg and "(1, 2)" in msg
    # Exactly zero there (negative zero included) is accepted, and the graph is left alone.
    ok = torch.where(trained, terms, torch.zeros_like(terms)) * -1.0
    assert validate_terms(_terms(ok, trained)).terms.requires_grad
    # A non-finite value there is left to the non-finite-loss refusal, which names the real cause.
    nan = torch.where(trained, terms, torch.full_like(terms, float("nan")))
    assert not torch.isfinite(validate_terms(_terms(nan, trained)).loss())


def test_construction_never_raises_on_content():
    # Each of these would break the contract; building them (inside training_step) must not end the run.
    short = _terms(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))
    assert short.terms.sum() == 0
    _terms(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))  # stray terms everywhere
    _terms(torch.full((2, 3), float("nan")))
    _terms(torch.zeros(2, 3), torch.ones(2, 3))  # a float mask
    with pytest.raises(TypeError, match="must return a CreditTerms"):
        validate_terms(torch.zeros(2, 3))


def test_a_short_mask_is_blamed_on_trained_not_terms():
    err = _refused(torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    assert err.field == "trained" and "`trained` must have the shape of `terms` [B, T] = [2, 4], got [2, 3]" in str(err)
    # A mask whose rows disagree with the rollout ids and the terms is the wrong field too.
    err = _refused(torch.zeros(2, 3), torch.ones(3, 3, dtype=torch.bool))
    assert err.field == "trained" and "[2, 3]" in str(err) and "[3, 3]" in str(err)


def test_terms_of_the_wrong_shape_are_blamed_on_terms_when_the_other_fields_agree_with_the_mask():
    tokens = torch.zeros(2, 3, dtype=torch.long)  # agrees with the mask: the terms are the odd one out
    err = _refused(torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), tokens=tokens)
    assert err.field == "terms" and "`terms` must have the shape of `trained` [B, T] = [2, 3]" in str(err)
    assert "[2, 4]" in str(err)
    err = _refused(torch.zeros(3, 3), torch.ones(2, 3, dtype=torch.bool))  # rows disagree with rollout ids [2]
    assert err.field == "terms"


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(trained=torch.ones(2, 3)), "trained"),
        (dict(segment=torch.zeros(2, 2, dtype=torch.long)), "segment"),
        (dict(rewards=torch.zeros(3)), "rewards"),
        (dict(advantages=torch.zeros(2, dtype=torch.long)), "advantages"),
        (dict(source=torch.tensor([0, -1])), "source"),
    ],
)
def test_every_field_error_names_its_field(kw, field):
    trained = kw.pop("trained", None)
    assert _refused(torch.zeros(2, 3), trained, **kw).field == field


def test_partition_errors_are_partition_errors():
    terms = _terms(torch.zeros(2, 3))
    with pytest.raises(PartitionError, match="in no part"):
        Partition(torch.tensor([[0, 0, -1], [0, 0, 0]]), ("a",)).check_covers(terms.trained)
    with pytest.raises(PartitionError, match="must lie in"):
        Partition(torch.tensor([[0, 0, 5], [0, 0, 0]]), ("a",))
    assert issubclass(PartitionError, ValueError)  # callers catching ValueError still do


@pytest.mark.parametrize("fn", [by_segment, by_turn])
def test_segment_partitions_without_segments_raise_the_set_up_error(fn):
    with pytest.raises(MissingSegmentsError, match="needs `CreditTerms.segment`"):
        fn(_terms(torch.zeros(2, 3)))
