"""The docstring examples of the anchor modules run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "lens_callbacks.anchor.ring",
    "lens_callbacks.anchor.fit",
    "lens_callbacks.anchor.projector",
    "lens_callbacks.anchor.merger",
    "lens_callbacks.anchor.gate",
    "lens_callbacks.metrics.anchor",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
