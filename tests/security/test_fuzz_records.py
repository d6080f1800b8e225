"""Fuzzing `lens-callbacks audit` with mutated run records: nothing named runs; read, refused (3) or one line (2).

Hypothesis replaces one value anywhere in the manifest, a step meta or a trajectory line with arbitrary
JSON (including import paths of code that would leave a marker file), or truncates one of the files,
then runs the real command in a forked child (isolated.py). The property: exit status 0, 2 or 3; on 2
exactly one line; never a traceback, never the timeout, never the marker.

Short by default (derandomized, for CI); ``LENS_FUZZ_LONG=1`` runs many more with fresh randomness.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real training run and a worker with lightning and transformers (~30 s to start)

LONG = os.environ.get("LENS_FUZZ_LONG", "") not in ("", "0")
FUZZ = settings(
    max_examples=300 if LONG else 12,
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_PATHS = st.sampled_from(
    [
        "os.system",
        "subprocess.getoutput",
        "builtins.eval",
        "evilpkg.Policy",
        "lens_callbacks.examples.grpo.module.RolloutBatch",
        "lens_callbacks.io.safe.read_regular_file",
        "lens_callbacks.examples.grpo_tools.module.GRPOToolsModule",
        "x",
        "",
    ]
)
_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
        _PATHS,
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def _slots(obj, path=()):
    """Every (container path) in a JSON object whose value can be replaced."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,)
            yield from _slots(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield path + (i,)
            yield from _slots(v, path + (i,))


def _replace(obj, path, value):
    if not path:
        return value
    d = obj
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return obj


@FUZZ
@given(
    target=st.sampled_from(["record.json", "steps/step_000000.json", "trajectories/step_000001.jsonl"]),
    pick=st.floats(0, 1, exclude_max=True),
    value=_JSON,
    truncate=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
)
def test_mutated_records(heavy, record, tmp_path, target, pick, value, truncate):
    marker = tmp_path / "MARKER"
    pkg = tmp_path / "evilpkg"
    if not pkg.exists():
        pkg.mkdir()
        (pkg / "__init__.py").write_text(
            f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass Policy:\n    pass\n"
        )
    rec = tmp_path / "record"
    if rec.exists():
        shutil.rmtree(rec)
    shutil.copytree(record, rec)
    f = rec / target
    text = f.read_text()
    if truncate is not None:
        f.write_text(text[: int(truncate * len(text))])
    else:
        # A .jsonl file: mutate its first line; a .json file: the whole object.
        lines = text.splitlines() if target.endswith(".jsonl") else [text]
        obj = json.loads(lines[0])
        slots = list(_slots(obj)) or [()]
        obj = _replace(obj, slots[int(pick * len(slots))], value)
        lines[0] = json.dumps(obj)
        f.write_text("\n".join(lines) + "\n")
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=120)
    assert not r.timed_out and r.rc in (0, 2, 3), (r.rc, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if r.rc == 2:
        assert len(r.stderr.splitlines()) == 1, r.stderr
    assert not marker.exists(), "a mutated record ran code"
    assert r.peak_mb < 1500, r.peak_mb
    assert Path(record, "record.json").is_file()
