"""Family "long step lists": a `record.json` that lists many steps whose trajectory files are missing.

690 KB listing 100,000 steps once took `audit` 705 s (the replay rebuilt the sorted step set once per step)
and ended in a dropout refusal. Now every record check is linear and the missing file is named: one line,
exit 2, the file and the field `steps`, within 600 MB and 10 s. Hypothesis draws the list's length and
shape; ``LENS_FUZZ_LONG=1`` draws more and longer lists (up to a million steps). The scaling test doubles
the length and checks that time and memory at most double.
"""

from __future__ import annotations

import file_families as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

N_MAX = 1_000_000 if F.LONG else 20_000
FUZZ = settings(
    max_examples=60 if F.LONG else 6,
    deadline=None,
    derandomize=not F.LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _run(w, d):
    return w.run("audit", d, "--no-progress", timeout=60, mem_mb=2048)


def _check(r, d, n, shape):
    first = 10**12 - n if shape == "huge" else (7 if shape == "strided" else 1)
    return F.refused(
        r, "long step lists", str(d / "trajectories" / f"step_{first:06d}.jsonl"), "record.json", "`steps`"
    )


def test_the_issue_case_100000_steps(families_worker, tmp_path):
    d = F.long_step_list(tmp_path / "record", 100_000)
    assert (d / "record.json").stat().st_size > 600_000
    line = _check(_run(families_worker, d), d, 100_000, "range")
    assert "99,998 more" in line and "dropout" not in line


@FUZZ
@given(n=st.integers(2, N_MAX), shape=st.sampled_from(["range", "reversed", "strided", "huge"]))
def test_long_step_lists(families_worker, tmp_path_factory, n, shape):
    d = F.long_step_list(tmp_path_factory.mktemp("steps") / "record", n, shape)
    _check(_run(families_worker, d), d, n, shape)


def test_step_list_checks_scale_linearly(families_worker, tmp_path_factory):
    def run(n):
        d = tmp_path_factory.mktemp("scale") / "record"
        F.long_step_list(d, n)
        return _run(families_worker, d)

    sizes = [100_000, 200_000, 400_000] + ([800_000] if F.LONG else [])
    F.assert_scales("long step lists", run, sizes, tiny=1_000)
