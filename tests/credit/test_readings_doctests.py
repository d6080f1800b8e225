"""The docstring examples of the reading, precision and graph modules run and print the exact values they show."""

import doctest
import importlib

import pytest

MODULES = [
    "lens_callbacks.credit.readings.summaries",
    "lens_callbacks.credit.readings.noise",
    "lens_callbacks.credit.readings.ledger",
    "lens_callbacks.credit.readings.derived",
    "lens_callbacks.credit.inputs.partition",
    "lens_callbacks.credit.readings.table",
    "lens_callbacks.credit.precision",
    "lens_callbacks.credit.graph",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
