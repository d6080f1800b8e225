"""Family "sparse and growing files": files whose size alone breaks the memory budget, and files that grow
while they are read.

A sparse 1.9 GiB `record.json` (no disk used) reached 4.0–4.2 GB; a trajectory file that grew while read
reached 2.27 GB before its refusal; an ordinary 600 MB trajectory file used 1.5 GB. Now a file larger than
the memory budget (``LENS_MEMORY_MB``, 256 MiB by default) is refused by its size before a byte is read,
a JSON text's parsed size is bounded before it is parsed, JSON Lines are streamed one line at a time, and
a file is read up to the size it had when opened. Each case: one line naming the file and what it is (the
manifest, the trajectory file), exit 2, within 600 MB and 10 s.
"""

from __future__ import annotations

import json
import os

import file_families as F
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lens_callbacks.io.safe import BoundedReadError, open_regular_file, read_exactly

FUZZ = settings(
    max_examples=40 if F.LONG else 6,
    deadline=None,
    derandomize=not F.LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SIZES = st.integers(1, 2 * F.GiB - 1) if F.LONG else st.sampled_from([1, 1 << 20, 80 << 20, 300 << 20, 1900 << 20])


def _record(tmp):
    return F.write_record(tmp / "record", lines_by_step={0: [F.traj_line()]})


@FUZZ
@given(size=SIZES, head=st.sampled_from([b"", b"{", b'{"schema": "', b"[" * 50]))
def test_sparse_manifest(families_worker, tmp_path_factory, size, head):
    rec = _record(tmp_path_factory.mktemp("sparse"))
    F.sparse(rec / "record.json", size, head[:size])
    r = families_worker.run("audit", rec, "--no-progress", timeout=60, mem_mb=2048)
    F.refused(r, "sparse and growing files", str(rec / "record.json"), "manifest")


@FUZZ
@given(size=SIZES, lines=st.integers(0, 1000))
def test_sparse_trajectory_file(families_worker, tmp_path_factory, size, lines):
    rec = _record(tmp_path_factory.mktemp("sparse"))
    head = "".join(json.dumps(F.traj_line(rollout=i)) + "\n" for i in range(lines)).encode()
    path = rec / "trajectories" / "step_000000.jsonl"
    F.sparse(path, max(size, len(head)), head)
    r = families_worker.run("process", rec, "--no-progress", timeout=60, mem_mb=2048)
    F.refused(r, "sparse and growing files", "step_000000.jsonl", rcs=(0, 2) if size <= len(head) else (2,))


def test_an_ordinary_600MB_trajectory_file_is_refused_by_size_unread(families_worker, tmp_path):
    rec = _record(tmp_path)
    F.sparse(rec / "trajectories" / "step_000000.jsonl", 600 << 20)
    r = families_worker.run("process", rec, "--no-progress", timeout=60)
    line = F.refused(
        r, "sparse and growing files", "step_000000.jsonl", "trajectory file", "memory budget", "LENS_MEMORY_MB"
    )
    assert r.wall_s < 5, (r.wall_s, line)
    # Raised for a file one trusts, it is read (a line of zeros longer than a quarter of the budget): within the raised budget.
    r = families_worker.run("process", rec, "--no-progress", timeout=60, env={"LENS_MEMORY_MB": "1024"}, mem_mb=2048)
    assert r.rc == 2 and "memory budget" not in r.stderr and "line is longer" in r.stderr and r.peak_mb < 1024 + 300, r


@pytest.mark.parametrize("step_mb", [1, 8, 64])
def test_a_growing_trajectory_file_stops_at_its_size(families_worker, tmp_path, step_mb):
    rec = _record(tmp_path)
    path = rec / "trajectories" / "step_000000.jsonl"
    path.write_text("".join(json.dumps(F.traj_line(rollout=i)) + "\n" for i in range(20000)))
    with F.Grower(path, step=step_mb * F.MiB):
        r = families_worker.run("process", rec, "--no-progress", timeout=60, mem_mb=2048)
    F.refused(r, "sparse and growing files", "step_000000.jsonl", rcs=(0, 2))


def test_read_exactly_refuses_a_file_that_grew_after_it_was_opened(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_bytes(b"x" * 100)
    fd, size = open_regular_file(p)
    try:
        with open(p, "ab") as f:
            f.write(b"y" * 10)
        with pytest.raises(BoundedReadError, match="grew while being read"):
            read_exactly(fd, size, str(p), "trajectory file")
    finally:
        os.close(fd)


def test_sparse_manifest_cost_scales_linearly(families_worker, tmp_path_factory):
    def run(mb):
        rec = _record(tmp_path_factory.mktemp("scale"))
        F.sparse(rec / "record.json", mb << 20, b"[" + b"0," * 1000)
        return families_worker.run("audit", rec, "--no-progress", timeout=60, mem_mb=2048)

    F.assert_scales(
        "sparse and growing files", run, [8, 16, 32, 64, 128, 256, 512] + ([1024, 1900] if F.LONG else []), tiny=1
    )
