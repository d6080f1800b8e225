"""Family "wide and deep init_args": a real record whose `init_args` (or `module`) an attacker widened,
deepened or sized up, all with the right types.

`n_embd: 4096` built a 1.9 GB module and `n_layer: 200000` 4.9 GB before anything was compared with the
checkpoint; an 8 MB `module` string cost the import-path regex 582 MB. Now sizes are checked against the
checkpoint's tensor shapes before anything is built (a bound by name, then the module built on the `meta`
device, which holds no weights), and strings are length-checked before any regex. Each case: one line naming
record.json (or the checkpoint) and the field, exit 2, within 600 MB and 10 s.
"""

from __future__ import annotations

import shutil

import file_families as F
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real training run and a worker with lightning and transformers (~30 s to start)

FUZZ = settings(
    max_examples=60 if F.LONG else 8,
    deadline=None,
    derandomize=not F.LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: kind -> (largest parameter drawn in the short mode, in the long mode), the words the line must hold.
KINDS = {
    "wide": ((20_000, 300_000), ["record.json", "`init_args`"]),
    "deep": ((100_000, 1_000_000), ["record.json"]),
    "n_embd": ((2**20, 2**40), ["init_args"]),
    "n_layer": ((200_000, 10**9), ["init_args"]),
    "n_head": ((2**20, 2**40), ["init_args"]),
    "module_string": ((8 << 20, 32 << 20), ["record.json", "`module`"]),
    "builder_string": ((1 << 20, 32 << 20), ["record.json", "`batch_builder`"]),
    "long_key": ((1 << 20, 16 << 20), ["record.json", "`init_args`"]),
}


def _copy(record, tmp):
    dst = tmp / "record"
    shutil.copytree(record, dst)
    return dst


def _audit(w, rec, tmp):
    return w.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp, timeout=60, mem_mb=2048)


@FUZZ
@given(kind=st.sampled_from(sorted(KINDS)), frac=st.floats(0, 1))
def test_wide_deep_and_sized_init_args(heavy, record, tmp_path_factory, kind, frac):
    (short, long), needles = KINDS[kind]
    top = long if F.LONG else short
    low = {"n_embd": 34, "n_layer": 3, "n_head": 3, "deep": 1}.get(
        kind, 2
    )  # the smallest value that differs from the record
    n = int(low + frac * (top - low))
    tmp = tmp_path_factory.mktemp(kind)
    rec = _copy(record, tmp)
    F.edit_init_args(rec, kind, n)
    F.refused(_audit(heavy, rec, tmp), "wide and deep init_args", *needles)


@pytest.mark.parametrize("kind,n", [("n_embd", 4096), ("n_layer", 200_000), ("n_embd", 64), ("n_layer", 3)])
def test_the_issue_cases_are_refused_before_building(heavy, record, tmp_path, kind, n):
    rec = _copy(record, tmp_path)
    F.edit_init_args(rec, kind, n)
    line = F.refused(_audit(heavy, rec, tmp_path), "wide and deep init_args", "init_args", "policy_step_000000.pt")
    assert "nothing was built" in line, line


@pytest.mark.parametrize("kind", ["wide", "module_string"])
def test_init_args_checks_scale_linearly(heavy, record, tmp_path_factory, kind):
    def run(n):
        tmp = tmp_path_factory.mktemp("scale")
        rec = _copy(record, tmp)
        F.edit_init_args(rec, kind, n)
        return _audit(heavy, rec, tmp)

    base = {"wide": 25_000, "module_string": 1 << 20}[kind]
    F.assert_scales("wide and deep init_args", run, [base, 2 * base, 4 * base], tiny=2)
