"""What ``CreditTerms`` and partitions say about bad input: the field that is wrong, how many, where, and the fix."""

from __future__ import annotations

import pytest
import torch

from lens_callbacks.credit import CreditTerms, Partition, by_segment, by_turn
from lens_callbacks.credit.partition import MissingSegmentsError, PartitionError
from lens_callbacks.credit.terms import CreditTermsError


def _terms(terms, trained=None, B=2, T=3, **kw):
    trained = torch.ones(B, T, dtype=torch.bool) if trained is None else trained
    return CreditTerms(terms, trained, torch.arange(B), torch.zeros(B, dtype=torch.long), **kw)


def test_non_zero_terms_at_untrained_positions_are_named_with_count_and_place():
    trained = torch.tensor([[True, True, False], [True, False, False]])
    terms = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.5, -7.0]], requires_grad=True)
    with pytest.raises(CreditTermsError) as err:
        _terms(terms * 1.0, trained)  # a tensor with a graph, as credit_terms returns it
    assert err.value.field == "terms" and err.value.numbers["untrained_nonzero"] == 2
    msg = str(err.value)
    assert "`terms` must be exactly 0 at untrained positions" in msg and "(1, 1)" in msg and "(1, 2)" in msg
    # Exactly zero there (negative zero included) is accepted, and the graph is left alone.
    ok = torch.where(trained, terms, torch.zeros_like(terms)) * -1.0
    assert _terms(ok, trained).terms.requires_grad
    # A non-finite value there is left to the non-finite-loss refusal, which names the real cause.
    nan = torch.where(trained, terms, torch.full_like(terms, float("nan")))
    assert not torch.isfinite(_terms(nan, trained).loss())


def test_terms_of_the_wrong_shape_are_reported_as_terms_not_trained():
    with pytest.raises(CreditTermsError) as err:
        _terms(torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    assert err.value.field == "terms" and "`terms` must have the shape of `trained`" in str(err.value)
    assert "[2, 3]" in str(err.value) and "[2, 4]" in str(err.value)
    # A mask whose rows disagree with the rollout ids is the wrong field.
    with pytest.raises(CreditTermsError) as err:
        _terms(torch.zeros(2, 3), torch.ones(3, 3, dtype=torch.bool))
    assert err.value.field == "trained" and "`trained` must be a [B, T] = [2, 3]" in str(err.value)


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
