"""Every public callback's docstring has an ``Example:`` and it runs as written (doctest)."""

import doctest

import pytest

import lens_callbacks
from lens_callbacks.integrations import trl

CALLBACKS = [
    lens_callbacks.CreditAuditCallback,
    lens_callbacks.ConservationCheckCallback,
    lens_callbacks.ProbeCreditCallback,
    lens_callbacks.ProcessRewardCallback,
    lens_callbacks.RunRecordCallback,
    lens_callbacks.AnchorProjectionCallback,
    trl.LensTRLCallback,
]


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_the_callback_docstring_example_runs(cls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    assert "Example:" in (cls.__doc__ or ""), f"{cls.__name__}'s docstring has no `Example:` section"
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(cls, cls.__name__, globs={})
    examples = sum(len(t.examples) for t in tests)
    assert examples >= 2, f"{cls.__name__}'s example shows too little: {examples} statements"
    for t in tests:
        runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{cls.__name__}'s docstring example failed (see the doctest output above)"
