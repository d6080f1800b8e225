"""Fuzzing `lens-callbacks skyrl` with mutated pickles: every input is read or refused in one line, bounded.

Hypothesis mutates the real fixtures (truncation, byte flips), generates pickles opcode by opcode (memo
indices, declared lengths, frames) and batch states with hostile shapes, dtypes and tensor views. Each
input runs through the real command in a forked child (isolated.py) under an address-space limit and a
timeout; the property: exit status 0 or 2, on 2 exactly one line naming the file, never a traceback,
peak memory under 600 MB, never the timeout.

Short by default (a few dozen inputs per strategy, derandomized, for CI); ``LENS_FUZZ_LONG=1`` runs
thousands with fresh randomness.
"""

from __future__ import annotations

import os
import pickle
import struct

import hostile as H
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

LONG = os.environ.get("LENS_FUZZ_LONG", "") not in ("", "0")
N = 2000 if LONG else 25
FUZZ = settings(
    max_examples=N,
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

needs_fixtures = pytest.mark.skipif(not H.CURRENT.is_file(), reason=f"SkyRL fixtures not found at {H.FIX}")


@pytest.fixture(scope="module")
def fixtures() -> dict:
    return {"current": H.CURRENT.read_bytes(), "legacy": H.LEGACY.read_bytes()}


def _check(light, path, data: bytes) -> None:
    path.write_bytes(data)
    r = light.run("skyrl", path, "--json", timeout=20, mem_mb=2048)
    lines = r.stderr.splitlines()
    assert not r.timed_out, (r.wall_s, data[:64])
    assert r.rc in (0, 2), (r.rc, r.stderr[-3000:])
    if r.rc == 2:
        assert len(lines) == 1 and lines[0].startswith("lens-callbacks skyrl: ") and str(path) in lines[0], r.stderr[
            -3000:
        ]
        assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    assert r.peak_mb < 600, (r.peak_mb, lines)


@needs_fixtures
@FUZZ
@given(
    which=st.sampled_from(["current", "legacy"]),
    cut=st.floats(0, 1, exclude_max=True),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=6),
)
def test_truncated_and_flipped_fixtures(light, tmp_path, fixtures, which, cut, flips):
    data = bytearray(fixtures[which])
    for where, byte in flips:
        data[int(where * len(data))] = byte
    if not flips or cut < 0.5:
        data = data[: int(cut * len(data))]
    _check(light, tmp_path / "global_step_1_training_input.pkl", bytes(data))


# Opcode-level generator: the grammar of pickles an attacker writes by hand.
_BIG = st.sampled_from([0, 1, 2, 7, 255, 2**16, 2**20, 2**27, 2**31 - 1, 2**32 - 1])


def _op(draw) -> bytes:
    kind = draw(
        st.sampled_from(
            [
                "none",
                "dict",
                "list",
                "memoize",
                "put",
                "get",
                "bytes8",
                "bytes4",
                "unicode",
                "frame",
                "int",
                "tuple2",
                "setitem",
                "append",
                "mark",
                "long4",
            ]
        )
    )
    n = draw(_BIG)
    short = draw(st.binary(max_size=16))
    return {
        "none": b"N",
        "dict": b"}",
        "list": b"]",
        "memoize": b"\x94",
        "tuple2": b"\x86",
        "setitem": b"s",
        "append": b"a",
        "mark": b"(",
        "put": b"r" + struct.pack("<I", n),
        "get": b"j" + struct.pack("<I", n),
        "bytes8": b"\x8e" + struct.pack("<Q", n) + short,
        "bytes4": b"B" + struct.pack("<I", n) + short,
        "unicode": b"X" + struct.pack("<I", n) + short,
        "frame": b"\x95" + struct.pack("<Q", n),
        "int": b"J" + struct.pack("<i", n & 0x7FFFFFFF),
        "long4": b"\x8b" + struct.pack("<I", n) + short,
    }[kind]


@st.composite
def _opcode_pickles(draw) -> bytes:
    body = b"".join(_op(draw) for _ in range(draw(st.integers(0, 12))))
    return b"\x80\x04" + body + (b"." if draw(st.booleans()) else b"")


@FUZZ
@given(data=_opcode_pickles())
def test_hand_written_opcode_streams(light, tmp_path, data):
    _check(light, tmp_path / "global_step_0_training_input.pkl", data)


_SHAPES = st.lists(st.sampled_from([-1, 0, 1, 2, 12, 14, 16, 2**20, 2**31, 2**40]), max_size=4)


@needs_fixtures
@FUZZ
@given(
    key=st.sampled_from(
        ["sequences", "attention_mask", "response_mask", "loss_mask", "advantages", "action_log_probs"]
    ),
    shape=_SHAPES,
    dtype=st.sampled_from(["int64", "float32", "bool", "object", "V1048576", "<U9", "float16", 7]),
    nbytes=st.sampled_from([0, 1, 7, 1120, 1792, 2240]),
    extra=st.dictionaries(
        st.sampled_from(["pad_size", "policy_prompt_boundaries", "response_length"]),
        st.one_of(
            st.integers(-3, 2**40),
            st.lists(st.tuples(st.integers(-1, 2**33), st.integers(-1, 2**33)), max_size=4),
            st.text(max_size=4),
            st.none(),
        ),
        max_size=2,
    ),
)
def test_hostile_shapes_dtypes_and_metadata(light, tmp_path, key, shape, dtype, nbytes, extra):
    state = H.current_state()
    state["batch_dict"][key] = {"format": "numpy", "data": bytes(nbytes), "shape": tuple(shape), "dtype": dtype}
    state["metadata"].update(extra)
    _check(light, tmp_path / "global_step_3_training_input.pkl", pickle.dumps(state, protocol=4))


@needs_fixtures
@FUZZ
@given(
    numel=st.integers(1, 64),
    offset=st.integers(0, 64),
    size=st.lists(st.sampled_from([0, 1, 2, 10, 14, 2**12, 2**24]), min_size=1, max_size=3),
    stride=st.lists(st.sampled_from([0, 1, 2, 10, 2**10]), min_size=3, max_size=3),
)
def test_hostile_tensor_views_in_torch_payloads(light, tmp_path, numel, offset, size, stride):
    base = torch.zeros(numel, dtype=torch.bfloat16)
    try:
        view = torch.as_strided(base, size, stride[: len(size)], offset)  # torch itself refuses views past the storage
    except RuntimeError:
        assume(False)
    state = H.current_state()
    state["batch_dict"]["rollout_logprobs"] = {"format": "torch", "data": H.torch_bytes(view)}
    _check(light, tmp_path / "global_step_3_training_input.pkl", pickle.dumps(state, protocol=4))


@needs_fixtures
def test_fuzz_properties_hold_on_the_clean_fixtures(light, tmp_path, fixtures):
    """The property the fuzzers check is not vacuous: the clean fixtures read with exit 0."""
    for which, data in fixtures.items():
        p = tmp_path / f"{which}_global_step_1_training_input.pkl"
        p.write_bytes(data)
        r = light.run("skyrl", p)
        assert r.rc == 0 and "rows 12" in r.stdout, r.stderr
    assert np.dtype("float32").itemsize == 4
