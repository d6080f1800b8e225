"""Family "link farms and loops": shared folders whose links point back at themselves, at one file many times,
or out of the folder (the kernel's files, a device, a private file).

`anchor-gate` on one 40 MiB checkpoint and 39 links to it read 3.2 GB in 85–98 s; `process DIR` with
`ln -s . d/a; ln -s . d/b` never ended; a `record.json` linked to an outside file had its content quoted.
Now a folder is walked without following links to folders, a file met twice is read once (by inode), and a
link out of a run or checkpoint folder is refused by its name, quoting nothing of its target. Each case:
one line, exit 2, the link (file) and the field named, within 600 MB and 10 s.
"""

from __future__ import annotations

import os
import shutil

import file_families as F
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=40 if F.LONG else 5,
    deadline=None,
    derandomize=not F.LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
LINKS_MAX = 2000 if F.LONG else 100


def _gate(w, d):
    return w.run("anchor-gate", d, "--cadence", "10", "--delay-K", "10", "--no-progress", timeout=60, mem_mb=2048)


@FUZZ
@given(n=st.integers(1, LINKS_MAX), named=st.booleans())
def test_checkpoint_link_farm_is_read_once(families_worker, tmp_path_factory, n, named):
    d = F.checkpoint_farm(tmp_path_factory.mktemp("farm") / "ckpts", n, named_steps=named)
    r = _gate(families_worker, d)
    if named:  # the same weights under another step's name
        F.refused(r, "link farms and loops", str(d / "step_10.pt"), "same file as", "step_0.pt")
    else:  # links that name no step are skipped: one step is left
        F.refused(r, "link farms and loops", str(d), "at least 2 steps")


def test_a_link_to_the_same_step_is_skipped_and_the_gate_runs(families_worker, tmp_path):
    """Lightning's `last.ckpt` links to the newest checkpoint, whose `global_step` it shares: read once, not refused."""
    d = tmp_path / "ckpts"
    d.mkdir()
    for t in range(0, 60, 10):
        torch.save({"global_step": t, "state_dict": {"w": torch.full((4,), 0.1 * t)}}, d / f"epoch=0-step={t}.ckpt")
    os.symlink("epoch=0-step=50.ckpt", d / "last.ckpt")
    r = _gate(families_worker, d)
    assert r.rc == 0 and "decision:" in r.stdout, r.stderr


def test_checkpoints_with_other_keys_name_the_file_and_tensor(families_worker, tmp_path):
    d = tmp_path / "ckpts"
    d.mkdir()
    torch.save({"layer.weight": torch.zeros(4)}, d / "step_0.pt")
    torch.save({"other.weight": torch.zeros(4)}, d / "step_10.pt")
    F.refused(_gate(families_worker, d), "link farms and loops", str(d / "step_10.pt"), "`layer.weight`")


@FUZZ
@given(breadth=st.integers(1, 64 if F.LONG else 8), depth=st.integers(1, 30 if F.LONG else 4), root=st.booleans())
def test_process_walks_link_loops_to_an_end(families_worker, tmp_path_factory, breadth, depth, root):
    d = F.link_loops(tmp_path_factory.mktemp("loops") / "dumps", breadth, depth, root)
    r = families_worker.run("process", d, "--no-progress", timeout=60, mem_mb=2048)
    F.refused(r, "link farms and loops", str(d), "neither")


def _record(tmp_path):
    return F.write_record(tmp_path / "record", lines_by_step={0: [F.traj_line()]})


@pytest.mark.parametrize("target", F.OUTSIDE + ["dangling", "loop", "chain_out"])
@pytest.mark.parametrize("which", ["record.json", "trajectories/step_000000.jsonl"])
def test_a_link_out_of_the_run_folder_is_refused_by_name(families_worker, tmp_path, target, which):
    rec = _record(tmp_path)
    link = rec / which
    link.unlink()
    if target == "dangling":
        os.symlink(tmp_path / "nowhere", link)
    elif target == "loop":
        os.symlink(link.name, link)
    elif target == "chain_out":  # a link to a link inside, which leaves
        os.symlink("/etc/passwd", rec / "inner")
        os.symlink(os.path.relpath(rec / "inner", link.parent), link)
    else:
        os.symlink(target, link)
    if which == "record.json":
        r = families_worker.run("audit", rec, "--no-progress", timeout=60)
        what = "manifest"
    else:
        r = families_worker.run("process", rec, "--no-progress", timeout=60)
        what = "trajectory file"
    needles = [str(link), what] if target not in ("dangling",) else [str(link)]
    F.refused(r, "link farms and loops", *needles, forbidden=("root:x:", "Errno"))  # nothing of the target quoted


def test_links_inside_the_run_folder_are_read(families_worker, tmp_path):
    rec = _record(tmp_path)
    traj = rec / "trajectories" / "step_000000.jsonl"
    shutil.move(traj, rec / "kept.jsonl")
    os.symlink("../kept.jsonl", traj)
    r = families_worker.run("process", rec, "--no-progress", "--json", timeout=60)
    assert r.rc == 0, r.stderr


def test_link_farm_cost_scales_linearly(families_worker, tmp_path_factory):
    def run(n):
        return _gate(families_worker, F.checkpoint_farm(tmp_path_factory.mktemp("farm") / "c", n, numel=1 << 22))

    F.assert_scales("link farms and loops", run, [250, 500, 1000] + ([2000, 4000] if F.LONG else []), tiny=1)


def test_link_loop_walk_scales_linearly(families_worker, tmp_path_factory):
    def run(b):
        return families_worker.run(
            "process", F.link_loops(tmp_path_factory.mktemp("loops") / "d", b, 8), "--no-progress"
        )

    F.assert_scales("link farms and loops", run, [250, 500, 1000], tiny=1)
