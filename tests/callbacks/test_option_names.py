"""One name for one idea: an option's old name still works for one release, with a FutureWarning."""

import pytest

from lens_callbacks import ProcessRewardCallback
from lens_callbacks._compat import renamed


def test_process_log_prefix_is_the_old_name_of_prefix():
    assert ProcessRewardCallback().prefix == "process/"
    assert ProcessRewardCallback(prefix="p/").prefix == "p/"
    with pytest.warns(FutureWarning, match="`log_prefix` is deprecated.*use `prefix`"):
        assert ProcessRewardCallback(log_prefix="old/").prefix == "old/"
    with pytest.raises(ValueError, match="give only `prefix`"):
        ProcessRewardCallback(log_prefix="a/", prefix="b/")


def test_renamed_passes_the_new_value_through_untouched():
    assert renamed("X", "old", "new", None, 5, 1) == 5
    with pytest.warns(FutureWarning):
        assert renamed("X", "old", "new", 7, 1, 1) == 7


def test_two_credit_audits_that_read_differently_keep_apart_state():
    from lens_callbacks import CreditAuditCallback

    base = CreditAuditCallback()
    for other in (
        CreditAuditCallback(dtype="float64"),
        CreditAuditCallback(prefix="credit64/"),
        CreditAuditCallback(scope="rank"),
        CreditAuditCallback(partition="by_group"),
    ):
        assert other.state_key != base.state_key
    assert CreditAuditCallback().state_key == base.state_key  # the same audit resumes its own state


def test_the_readings_beyond_the_shares_are_one_option_and_their_old_names_still_work():
    import warnings

    from lens_callbacks import CreditAuditCallback, ExtraReadings

    new = CreditAuditCallback(
        extras=ExtraReadings(partitions=["by_advantage_sign"], noise_ema=0.5, update_shares=True, position_split=True)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped option warns about nothing
        CreditAuditCallback(extras=ExtraReadings(partitions=["by_source"]))
    with pytest.warns(FutureWarning, match=r"`extra_partitions`, `noise_ema`.*extras=ExtraReadings\(partitions=\.\.\."):
        old = CreditAuditCallback(
            extra_partitions=["by_advantage_sign"], noise_ema=0.5, update_shares=True, position_split=True
        )
    assert old.extras == new.extras
    for cb in (old, new):
        assert cb.extra_partitions == ["by_advantage_sign"] and cb.update_shares and cb.position_split
        assert cb.step_readings.noise_ema.beta == 0.5
    with pytest.raises(ValueError, match="give them in `extras` only"):
        CreditAuditCallback(extras=ExtraReadings(), update_shares=True)
    # a dict of its fields (a config read as plain data) is taken as the dataclass; anything else is an error
    assert CreditAuditCallback(extras={"update_shares": True}).extras == ExtraReadings(update_shares=True)
    with pytest.raises(ValueError, match=r"`extras` must name fields of ExtraReadings .*got \['update_share'\]"):
        CreditAuditCallback(extras={"update_share": True})
    with pytest.raises(ValueError, match="`extras` must be an ExtraReadings .* or a dict of its fields, got list"):
        CreditAuditCallback(extras=["by_source"])
    # a list as `partition` still adds its tail to the extra partitions
    assert CreditAuditCallback(partition=["by_rollout", "by_group"]).extras.partitions == ("by_group",)
