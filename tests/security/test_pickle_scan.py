"""The static pickle pass, the zip central-directory check and the walk-once tensor check, against independent counts.

The pass's expansion count is checked against a plain recursive count of the tree the unpickled object expands
to (every shared reference counted again), on random DAGs that ``pickle.dumps`` memoizes: a limit equal to the
count passes, one below it refuses.
"""

from __future__ import annotations

import io
import pickle
import time
import zipfile

import families as F
import hostile as H
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.io.pickle_scan import MAX_CONTAINER_KEYS, MAX_KEY_DEPTH, PickleRefused, scan_pickle_stream
from lens_callbacks.io.safe import BoundedReadError, ReadLimits, check_tensor_views, check_zip


def _scan(data: bytes, max_nodes: int = 10**9, max_bytes: int = 10**12) -> int:
    return scan_pickle_stream(data, "f.pkl", "pickle", max_opcodes=10**7, max_nodes=max_nodes, max_bytes=max_bytes)


def _tree(o) -> tuple[int, int]:
    """Nodes and str/bytes payload of the tree ``o`` expands to, every reference counted again."""
    if isinstance(o, dict):
        n, b = 1, 0
        for k, v in o.items():
            for x in (k, v):
                xn, xb = _tree(x)
                n, b = n + xn, b + xb
        return n, b
    if isinstance(o, (list, tuple)):
        n, b = 1, 0
        for x in o:
            xn, xb = _tree(x)
            n, b = n + xn, b + xb
        return n, b
    return 1, len(o) if isinstance(o, (str, bytes)) else 0


@st.composite
def _dags(draw):
    """A random structure whose later nodes reuse earlier ones (so pickle memoizes and refers back)."""
    atom = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.binary(max_size=9), st.none())
    pool = [draw(atom) for _ in range(3)]
    for _ in range(draw(st.integers(1, 12))):
        kids = draw(st.lists(st.integers(0, len(pool) - 1), max_size=4))
        kind = draw(st.sampled_from(["list", "tuple", "dict"]))
        if kind == "dict":
            pool.append({f"k{i}": pool[j] for i, j in enumerate(kids)})
        else:
            pool.append((list if kind == "list" else tuple)(pool[j] for j in kids))
    return pool[-1]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(obj=_dags(), proto=st.sampled_from([3, 4, 5]))  # protocol 2 writes bytes as a call of _codecs.encode
def test_expansion_counts_every_shared_reference_at_its_full_size(obj, proto):
    data = pickle.dumps(obj, protocol=proto)
    nodes, nbytes = _tree(obj)
    _scan(data, max_nodes=nodes, max_bytes=nbytes)  # exactly at the limits: read
    with pytest.raises(PickleRefused, match="expands to"):
        _scan(data, max_nodes=nodes - 1)
    if nbytes:
        with pytest.raises(PickleRefused, match="expands to"):
            _scan(data, max_bytes=nbytes - 1)


def test_a_dag_of_a_million_levels_is_refused_in_linear_time():
    """Counts saturate: the 2**levels of a deep DAG never become million-bit integers."""
    times = {}
    for levels in (50_000, 100_000):
        data = b"\x80\x04" + F.list_dag(levels)(0) + b"."
        t = time.perf_counter()
        with pytest.raises(PickleRefused, match="expands to more than"):
            _scan(data, max_nodes=2_000_000)
        times[levels] = time.perf_counter() - t
    assert times[100_000] < 3.0 * times[50_000] + 0.5, times


def test_a_structure_that_contains_itself_is_refused():
    a: list = []
    a.append([a, a])
    with pytest.raises(PickleRefused, match="contains itself"):
        _scan(pickle.dumps(a, protocol=4))
    shared = [1, 2]
    _scan(pickle.dumps([shared, [shared, shared]], protocol=4))  # shared but acyclic: read


def _key_pickle(key) -> bytes:
    """{key: 1} written by hand: pickle.dumps would hash the key while building the dict."""
    return b"\x80\x04}" + pickle.dumps(key, protocol=4)[2:-1] + b"K\x01s."


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_key_depth_is_bounded(depth):
    key = 1
    for _ in range(depth):
        key = (key, 2)
    data = _key_pickle(key)
    if depth <= MAX_KEY_DEPTH:
        _scan(data)
        assert pickle.loads(data) == {key: 1}  # the hand-written stream is the dict it claims to be
    else:
        with pytest.raises(PickleRefused, match=f"nesting containers {depth} deep"):
            _scan(data)


def test_tuple_keys_are_counted_and_ints_bounded_to_64_bits():
    ok = pickle.dumps({p: 0 for p in F.colliding_pairs(MAX_CONTAINER_KEYS)}, protocol=4)
    _scan(ok)
    frag = F.tuple_collision_dict(MAX_CONTAINER_KEYS + 1)(0)
    with pytest.raises(PickleRefused, match="tuple keys"):
        _scan(b"\x80\x04" + frag + b".")
    for v in (2**64 - 1, -(2**63), 0, 7 * F.M61):
        _scan(pickle.dumps([v], protocol=4))
    for v in (2**64, -(2**63) - 1, 2**200):
        with pytest.raises(PickleRefused, match=f"integer of {v.bit_length()} bits"):
            _scan(pickle.dumps([v], protocol=4))


def test_hashing_constructors_have_their_pair_keys_checked():
    """OrderedDict([(key, v)]) hashes key: a deep key inside the pairs is refused as a dict key is."""
    deep = ((((1,),),),)
    data = (
        b"\x80\x04\x8c\x0bcollections\x8c\x0bOrderedDict\x93](" + pickle.dumps((deep, 1), protocol=4)[2:-1] + b"e\x85R."
    )
    with pytest.raises(PickleRefused, match="nesting containers"):
        _scan(data)


# ------------------------------------------------------------------------------------------- zip central directory
def _limits() -> ReadLimits:
    return ReadLimits()


def test_zip_aliases_are_refused_naming_the_entry_and_a_torch_save_archive_passes():
    good = H.torch_bytes({"w": torch.arange(6.0), "v": torch.ones(3)})
    with zipfile.ZipFile(io.BytesIO(good)) as zf:
        check_zip(zf, "good.pt", len(good), _limits(), "checkpoint", stored_only=True, raw=good)
    bad = F.ckpt_zip_aliases(3, 1 << 12)
    with zipfile.ZipFile(io.BytesIO(bad)) as zf:
        with pytest.raises(
            BoundedReadError, match=r"bad\.pt: zip entry 'archive/data/\d' of the checkpoint overlaps entry"
        ):
            check_zip(zf, "bad.pt", len(bad), _limits(), "checkpoint", stored_only=True, raw=bad)
    # The archive is what it claims: torch itself reads three tensors from the one member.
    assert len(torch.load(io.BytesIO(bad), weights_only=True)["state_dict"]) == 3


def test_zip_duplicate_names_are_refused():
    buf = io.BytesIO()
    with pytest.warns(UserWarning):
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("a/data.pkl", b"x")
            zf.writestr("a/data.pkl", b"y")
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        with pytest.raises(BoundedReadError, match="appears twice"):
            check_zip(zf, "dup.pt", len(data), _limits(), "checkpoint", stored_only=False, raw=data)


# ------------------------------------------------------------------------------------------- walk once
def test_tensor_check_visits_each_object_once():
    """A 60-level DAG of lists over one tensor: 2**60 paths, 61 lists and one tensor, charged once."""
    t = torch.arange(10.0)
    node: object = [t]
    for _ in range(60):
        node = [node, node]
    budget = _limits().budget_for(0, "dag.pt")
    start = time.perf_counter()
    assert check_tensor_views({"state_dict": node}, "dag.pt", budget) == 1
    assert time.perf_counter() - start < 5.0
    assert budget.used == t.numel() * t.element_size()
    with pytest.raises(BoundedReadError, match="more than 30 distinct containers"):
        check_tensor_views({"state_dict": node}, "dag.pt", _limits().budget_for(0, "dag.pt"), max_visits=30)
