"""Inputs whose refusal once named neither file nor field: each is now one line naming both, exit 2.

`OverflowError: int too large to convert to float` (a reward of 1 followed by 400 zeros), `Overflow when
unpacking long long` (a group of 2**64), `IndexError: index out of range in self` (token ids past what the
policy embeds), `[Errno 22]` / `[Errno 5]` (files linked to /proc/self/pagemap, /proc/self/mem),
`KeyError: 'layer.weight'` (anchor-gate on checkpoints with other keys, in test_fuzz_links.py) and
`TypeError: ... not GRPOModule` (a trusted but wrong batch_builder).
"""

from __future__ import annotations

import json
import os
import shutil

import file_families as F
import pytest


def _process(w, rec):
    return w.run("process", rec, "--no-progress", timeout=60)


@pytest.mark.parametrize(
    "field,value",
    [
        ("reward", 10**400),
        ("reward", -(10**400)),
        ("group", 2**64),
        ("group", -(2**63) - 1),
        ("rollout", 2**64),
        ("step", 2**70),
    ],
)
def test_overflowing_numbers_name_the_field(families_worker, tmp_path, field, value):
    line = F.traj_line(**{field: 0})
    text = json.dumps(line).replace(f'"{field}": 0', f'"{field}": {value}')
    rec = F.write_record(tmp_path / "record")
    (rec / "trajectories" / "step_000000.jsonl").write_text(text + "\n")
    out = F.refused(_process(families_worker, rec), "messages", "step_000000.jsonl:1", f"`{field}`", "digits")
    assert str(value)[:30] not in out


def test_token_ids_beyond_64_bits_name_the_field(families_worker, tmp_path):
    rec = F.write_record(tmp_path / "record", lines_by_step={0: [F.traj_line()]})
    p = rec / "trajectories" / "step_000000.jsonl"
    p.write_text(p.read_text().replace("[3, 4, 5]", f"[3, {2**64}, 5]"))
    F.refused(_process(families_worker, rec), "messages", "step_000000.jsonl:1", "`token_ids`")


@pytest.mark.parametrize("target", ["/proc/self/pagemap", "/proc/self/mem"])
def test_kernel_files_given_directly_are_one_line(families_worker, tmp_path, target):
    link = tmp_path / "global_step_0_training_input.pkl"
    os.symlink(target, link)
    for argv in (["skyrl", link], ["process", link]):
        F.refused(families_worker.run(*argv), "messages", str(link), "/proc", forbidden=("Errno",))


def _copy(record, tmp):
    dst = tmp / "record"
    shutil.copytree(record, dst)
    return dst


def _set(rec, step, edit):
    p = rec / "trajectories" / f"step_{step:06d}.jsonl"
    lines = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    edit(lines)
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.slow
@pytest.mark.parametrize("step", [0, 1])
def test_sequences_longer_than_the_positions_name_the_file(heavy, record, tmp_path, step):
    pytest.importorskip("transformers")
    rec = _copy(record, tmp_path)
    _set(rec, step, lambda ls: ls[0]["turns"][0].update(token_ids=[3] * 300))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    F.refused(r, "messages", f"step_{step:06d}.jsonl", "`token_ids`", "positions")


@pytest.mark.slow
def test_a_trusted_but_wrong_batch_builder_names_the_field(heavy, record, tmp_path):
    pytest.importorskip("transformers")
    rec = _copy(record, tmp_path)
    m = json.loads((rec / "record.json").read_text())
    m["batch_builder"] = "lens_callbacks.examples.grpo_tools.single_turn.grpo_rollout_batch"
    (rec / "record.json").write_text(json.dumps(m))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    F.refused(r, "messages", "record.json", "`batch_builder`", "step_000000.jsonl")
