"""LensGRPOMixin placed after GRPOTrainer in the bases: the warning says the order is wrong, and how to fix it."""

from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback  # noqa: E402


def test_the_mixin_after_grpotrainer_warns_that_the_order_is_wrong(caplog):
    with pytest.warns(UserWarning, match="The order is wrong") as rec, caplog.at_level(logging.WARNING):

        class Backwards(GRPOTrainer, LensGRPOMixin):
            pass

    msg = str(rec[0].message)
    assert "Backwards lists GRPOTrainer before LensGRPOMixin" in msg
    assert "class Backwards(LensGRPOMixin, GRPOTrainer)" in msg and "nothing is audited" in msg
    assert rec[0].filename == __file__  # points at the class definition, not at the library
    assert "The order is wrong" in caplog.text
    # Indeed the mixin is shadowed: GRPOTrainer's own methods come first.
    assert Backwards._generate_and_score_completions is GRPOTrainer._generate_and_score_completions


def test_the_documented_order_and_its_subclasses_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Audited(LensGRPOMixin, GRPOTrainer):
            pass

        class Further(Audited):  # overriding a mixin method in a subclass of the right order is fine
            def compute_loss(self, *a, **k):
                return super().compute_loss(*a, **k)

    assert Audited._generate_and_score_completions is LensGRPOMixin._generate_and_score_completions


def test_an_unbound_callback_names_the_order_at_train_begin(caplog):
    cb = LensTRLCallback()
    with caplog.at_level(logging.WARNING, logger="lens_callbacks"):
        cb.on_train_begin(None, None, None)
    assert "nothing will be audited" in caplog.text and "LensGRPOMixin, GRPOTrainer" in caplog.text
    assert "the order is wrong" in caplog.text
