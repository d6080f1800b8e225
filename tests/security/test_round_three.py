"""Hostile files, round three: the unpickler's own classes, budgets that count what is built, work in the size of
what is listed, the probe path, and the lesser faults.

Every case runs through the real console script in a forked child of a warm worker (conftest.py): a refused
case must end in exit 2 (or 3 where documented), one line naming the file and the field, no traceback on
stdout or stderr, under 10 s and 600 MB.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import families as F
import hostile as H
import pytest

PEAK_MB = 600
WITHIN_S = 10.0
needs_fixtures = pytest.mark.skipif(not H.CURRENT.is_file(), reason=f"SkyRL fixtures not found at {H.FIX}")


def refused(r, path, *needles: str, rc: int = 2) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.rc == rc and not r.timed_out, (r.rc, r.timed_out, r.wall_s, r.stderr[-2000:], r.stdout[-500:])
    assert len(lines) == 1 and "Traceback" not in r.stderr + r.stdout and "Exception ignored" not in r.stderr, r.stderr[
        -2000:
    ]
    assert str(path) in lines[0], lines[0]
    for n in needles:  # "a|b": either
        assert any(alt in lines[0] for alt in n.split("|")), (n, lines[0])
    assert r.peak_mb < PEAK_MB, (r.peak_mb, lines[0])
    assert r.wall_s < WITHIN_S, (r.wall_s, lines[0])
    return lines[0]


# --------------------------------------------------------------------------------------------- 1. the gadgets
OUTER = [
    ("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch"),
    ("skyrl.backends.skyrl_train.training_batch", "TrainingInputBatch"),
    ("skyrl_train.training_batch", "TrainingInputBatch"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("collections", "OrderedDict"),
    ("torch", "device"),
]
INNER = [("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"), ("torch", "FloatStorage")]
DUNDERS = ["__del__", "__class__", "__reduce__", "__setstate__", "__getattr__", "__init__"]


def _glob(mod: str, name: str) -> bytes:
    return b"c" + f"{mod}\n{name}\n".encode()


def gadget(target: tuple[str, str], value: tuple[str, str], dunder: str, kind: str) -> bytes:
    """A pickle fragment that leaves one object on the stack, after BUILD sets ``dunder`` to ``value``:
    on the global itself (``slot``/``dict`` state), on it twice over (``ping_pong``: two classes whose finalisers
    build each other), or on an instance it made (``instance``)."""
    t, v = _glob(*target), _glob(*value)
    slot = b"N}" + F._str(dunder) + v + b"s\x86b"
    if kind == "slot":
        return t + slot
    if kind == "dict":
        return t + b"}" + F._str(dunder) + v + b"sb"
    if kind == "ping_pong":
        return t + b"N}" + F._str(dunder) + t + b"s\x86b" + b"0" + t + slot  # POP the first, keep the second
    return t + b")R" + slot  # an instance (REDUCE of the global), then BUILD on it


def _bare(tmp: Path, frag: bytes) -> Path:
    p = tmp / "global_step_1_training_input.pkl"
    p.write_bytes(b"\x80\x02" + frag + b".")
    return p


def _in_fixture(tmp: Path, frag: bytes) -> Path:
    return F.dump_with(tmp, lambda k: frag, "value", marker=tmp / "MARKER")


def _in_payload(tmp: Path, frag: bytes) -> Path:
    """The fixture with its rollout_logprobs torch.save payload's data.pkl replaced by the gadget."""
    state = H.current_state()
    entry = state["batch_dict"]["rollout_logprobs"]
    members = []
    for name, payload, method, crc, usize in H.torch_zip_members(entry["data"]):
        if name.endswith("data.pkl"):
            payload = b"\x80\x02" + frag + b"."
            import zlib

            crc, usize = zlib.crc32(payload), len(payload)
        members.append((name, payload, method, crc, usize))
    entry["data"] = H.zip_bytes(members)
    return H.write_state(tmp / "global_step_3_training_input.pkl", state)


PLACES = {"bare": _bare, "fixture": _in_fixture, "payload": _in_payload}


@needs_fixtures
@pytest.mark.parametrize("kind", ["slot", "dict", "ping_pong", "instance"])
@pytest.mark.parametrize("dunder", DUNDERS)
def test_every_allowed_global_refuses_build_of_special_attributes(light, tmp_path, kind, dunder):
    for i, target in enumerate(OUTER):
        for place in ("bare", "fixture"):
            d = tmp_path / f"{i}-{place}"
            d.mkdir()
            p = PLACES[place](d, gadget(target, ("torch", "device"), dunder, kind))
            for command in ("skyrl", "process"):
                r = light.run(
                    command, p, "--no-progress" if command == "process" else "--json", timeout=30, mem_mb=2048
                )
                refused(r, p, "BUILD|special attribute|stand-in|not a readable")
            assert not (d / "MARKER").exists()


@needs_fixtures
@pytest.mark.parametrize("dunder", ["__del__", "__class__"])
def test_an_embedded_payload_refuses_the_gadgets_too(light, tmp_path, dunder):
    for i, target in enumerate(INNER):
        for kind in ("slot", "ping_pong", "instance"):
            d = tmp_path / f"{i}-{kind}"
            d.mkdir()
            p = _in_payload(d, gadget(target, ("collections", "OrderedDict"), dunder, kind))
            r = light.run("skyrl", p, "--json", timeout=30, mem_mb=2048)
            refused(r, p, "BUILD|special attribute|stand-in|not a readable")


def test_the_stand_ins_hold_without_the_static_scan(tmp_path, monkeypatch):
    """The scan refuses the gadgets first; with it switched off the stand-ins still take no attribute."""
    import lens_callbacks.io.skyrl as sk

    monkeypatch.setattr(sk, "scan_pickle", lambda *a, **k: None)
    for target in OUTER:
        for kind in ("slot", "ping_pong", "instance"):
            p = _bare(tmp_path, gadget(target, ("collections", "OrderedDict"), "__del__", kind))
            with pytest.raises(sk.SkyRLDumpError):
                sk.read_skyrl_dump(p)
    assert "__del__" not in vars(sk._OrderedDict) and "__del__" not in vars(sk._TrainingInputBatch)


# --------------------------------------------------------------------------------------------- 2. a ceiling the input sets
def _copy(record: Path, tmp: Path) -> Path:
    import shutil

    rec = tmp / "rec"
    shutil.copytree(record, rec)
    return rec


@pytest.mark.parametrize("n_layer", [20_000, 100_000])
def test_one_large_tensor_does_not_lift_the_bound_of_a_layer_count(heavy, record, tmp_path, n_layer):
    import torch

    rec = _copy(record, tmp_path)
    ckpt = rec / "policy_step_000000.pt"
    state = torch.load(ckpt, weights_only=True)
    state["zz_extra"] = torch.zeros(300_000, dtype=torch.uint8)  # its dimension lifts no count
    torch.save(state, ckpt)
    H.edit_json(rec / "record.json", lambda m: m["init_args"].update(n_layer=n_layer))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, rec / "record.json", "`init_args.n_layer`", "more blocks than")


# --------------------------------------------------------------------------------------------- 3. count versus value
def _traj(step: int, k: int, n_tokens: int, text_only: bool = False) -> dict:
    ids = [(3 + i) % 20 for i in range(n_tokens)]
    turns = [
        {"role": "user", "text": "1 + 1 =", "token_ids": ids[:1], "trained": False, "tool_call": None},
        {
            "role": "assistant",
            "text": "2 <eot>",
            "token_ids": None if text_only else ids[1:],
            "trained": True,
            "tool_call": None,
        },
    ]
    return {
        "schema": "lens_callbacks.trajectory/1",
        "step": step,
        "group": k,
        "rollout": k,
        "prompt_id": str(k),
        "reward": float(k % 2),
        "turns": turns,
    }


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def test_a_huge_step_number_costs_the_steps_listed_not_its_value(heavy, record, tmp_path):
    import shutil

    rec = _copy(record, tmp_path)
    big = 10**12
    shutil.copy(rec / "steps" / "step_000001.json", rec / "steps" / f"step_{big:06d}.json")
    shutil.copy(rec / "trajectories" / "step_000001.jsonl", rec / "trajectories" / f"step_{big:06d}.jsonl")
    H.edit_json(rec / "record.json", lambda m: m.update(steps=[0, 1, big]))
    r = heavy.run("audit", rec, "--step", str(big), "--no-progress", cwd=tmp_path, timeout=60)
    assert r.rc == 3 and "missing_steps" in r.stdout and r.wall_s < WITHIN_S and r.peak_mb < PEAK_MB, (
        r.rc,
        r.stdout,
        r.stderr,
    )


def test_missing_steps_are_counted_in_the_steps_listed():
    import time

    from lens_callbacks.commands.replay import _missing_steps

    steps = list(range(0, 20_000, 2))
    n, first = _missing_steps(steps, 0, 20_000)
    assert (n, first) == (
        10_000,
        [1, 3, 5, 7, 9],
    )  # the naive reference: [s for s in range(0, 20000) if s not in steps]
    naive = [s for s in range(0, 2_000) if s not in set(steps)]
    assert _missing_steps(steps, 0, 2_000) == (len(naive), naive[:5])
    t = []
    for far in (10**6, 10**12):  # the distance grows a million-fold; the work does not
        t0 = time.perf_counter()
        assert _missing_steps(steps, 0, far)[0] == far - 10_000
        t.append(time.perf_counter() - t0)
    assert t[1] < 20 * t[0] + 0.05, t


def test_group_advantages_are_linear_in_groups_and_equal_the_naive_loop():
    import time

    import torch

    from lens_callbacks.examples.grpo_tools.module import group_advantages

    g = torch.tensor([0, 0, 1, 1, 1, 7, 7, 3])
    r = torch.tensor([1.0, 0.0, 2.0, 3.0, 4.0, 0.5, 0.5, 9.0])
    want = torch.zeros(len(r), dtype=torch.float64)
    for gid in torch.unique(g):  # the reference: one group at a time
        m = g == gid
        x = r[m].double()
        want[m] = (x - x.mean()) / (x.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(group_advantages(r, g), want, rtol=1e-12, atol=1e-12)
    t = []
    for n in (15_000, 150_000):  # every trajectory its own group: a loop over groups is quadratic here
        x = torch.rand(n, dtype=torch.float64)
        t0 = time.perf_counter()
        group_advantages(x, torch.arange(n))
        t.append(time.perf_counter() - t0)
    assert t[1] < 40 * t[0] + 0.5, t


# --------------------------------------------------------------------------------------------- 4. what is built
def _step_trajectories(rec: Path, rows) -> Path:
    return _write_jsonl(rec / "trajectories" / "step_000001.jsonl", rows)


@pytest.mark.parametrize("shape", ["padded", "many_short", "many_long"])
def test_a_step_batch_is_bounded_by_what_it_pads_to(heavy, record, tmp_path, shape):
    rec = _copy(record, tmp_path)
    n, lengths = {
        "padded": (20_000, lambda k: 120 if k == 0 else 2),
        "many_short": (50_000, lambda k: 9),
        "many_long": (3_000, lambda k: 120),
    }[shape]
    path = _step_trajectories(rec, (_traj(1, k, lengths(k)) for k in range(n)))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, path, "pads", "LENS_MEMORY_MB")


def test_many_parts_refuse_by_their_interference_matrix_and_a_coarser_partition_reads(heavy, record, tmp_path):
    rec = _copy(record, tmp_path)
    path = _step_trajectories(rec, (_traj(1, k, 3) | {"group": k % 4} for k in range(3_000)))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, path, "interference matrix", "3,000 parts", "LENS_MEMORY_MB")
    r = heavy.run("audit", rec, "--step", "1", "--partition", "by_group", "--no-progress", cwd=tmp_path, timeout=60)
    assert r.rc == 0 and "4 parts" in r.stdout, (r.rc, r.stdout[-800:], r.stderr[-800:])


def test_text_turns_are_bounded_like_id_turns(heavy, record, tmp_path):
    rec = _copy(record, tmp_path)
    row = _traj(1, 0, 3, text_only=True)
    row["turns"][1]["text"] = "7" * 40_000_000
    path = _step_trajectories(rec, [row])
    r = heavy.run(
        "audit",
        rec,
        "--step",
        "1",
        "--no-progress",
        cwd=tmp_path,
        timeout=60,
        env={"LENS_MEMORY_MB": "512"},
        mem_mb=1536,
    )
    refused(r, path, "`text`", "token_ids: null")
    row["turns"][1]["text"] = " ".join(["7"] * 200)  # 200 tokens of a 128-position policy
    path = _step_trajectories(rec, [row])
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, path, "positions")


# --------------------------------------------------------------------------------------------- 6. the probe path
def _probe_record(record: Path, tmp: Path) -> Path:
    rec = _copy(record, tmp)
    H.edit_json(
        rec / "record.json", lambda m: m.update(module="lens_callbacks.examples.grpo_tools.probe.ToolsProbeModule")
    )
    return rec


def test_a_probe_file_that_pads_past_the_budget_is_refused_by_its_name(heavy, record, tmp_path):
    rec = _probe_record(record, tmp_path)
    probe = _write_jsonl(tmp_path / "probe.jsonl", (_traj(0, k, 120 if k == 0 else 2) for k in range(20_000)))
    r = heavy.run("audit", rec, "--step", "1", "--probe", probe, "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, probe, "the probe batch pads", "LENS_MEMORY_MB")


def test_a_probe_on_a_module_without_a_probe_objective_names_the_module_field(heavy, record, tmp_path):
    probe = _write_jsonl(tmp_path / "probe.jsonl", [_traj(0, 0, 4)])
    r = heavy.run("audit", record, "--step", "1", "--probe", probe, "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, record / "record.json", "field `module`", "probe_terms")


@pytest.mark.parametrize("probe", [False, True])
def test_an_lr_list_of_the_wrong_length_is_an_error_with_and_without_probe(heavy, record, tmp_path, probe):
    rec = _probe_record(record, tmp_path) if probe else _copy(record, tmp_path)
    meta = rec / "steps" / "step_000001.json"
    H.edit_json(meta, lambda m: m.update(lr=[0.05, 0.05]))
    extra = ["--probe", _write_jsonl(tmp_path / "probe.jsonl", [_traj(0, 0, 4)])] if probe else []
    r = heavy.run("audit", rec, "--step", "1", *extra, "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, meta, "field `lr`", "param groups")


# --------------------------------------------------------------------------------------------- 7. the lesser faults
@pytest.mark.parametrize("how", ["nan_weights", "lr_overflow"])
def test_readings_a_file_makes_undefined_end_in_exit_3(heavy, record, tmp_path, how):
    import torch

    rec = _copy(record, tmp_path)
    if how == "nan_weights":
        ckpt = rec / "policy_step_000000.pt"
        state = torch.load(ckpt, weights_only=True)
        for v in state.values():
            if v.is_floating_point():
                v.fill_(float("nan"))
        torch.save(state, ckpt)
    else:
        H.edit_json(rec / "steps" / "step_000000.json", lambda m: m.update(lr=[1e308]))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    assert r.rc == 3 and "non_finite" in r.stdout and "Traceback" not in r.stdout + r.stderr, (r.rc, r.stdout, r.stderr)
    assert r.wall_s < WITHIN_S and r.peak_mb < PEAK_MB


def test_an_oversized_dropout_seed_names_its_field(heavy, record, tmp_path):
    rec = _copy(record, tmp_path)
    meta = rec / "steps" / "step_000001.json"
    H.edit_json(meta, lambda m: m.update(dropout_seed=2**70))
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    refused(r, meta, "field `dropout_seed`", "torch seed")


@pytest.mark.parametrize(
    "name,value",
    [
        ("LENS_READ_BUDGET_FACTOR", "1e308"),
        ("LENS_MEMORY_MB", "1e-30"),
        ("LENS_MEMORY_MB", "nan"),
        ("LENS_READ_BUDGET_FLOOR_MB", "lots"),
    ],
)
def test_environment_knobs_are_one_line_naming_the_variable(heavy, record, tmp_path, name, value):
    r = heavy.run("audit", record, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60, env={name: value})
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.rc == 2 and len(lines) == 1 and f"`{name}`" in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "name,shown",
    [
        ("run\x1b[2J\x1b[31mred", "run\\x1b[2J\\x1b[31mred"),
        ("run\nlens-callbacks: all good", "run\\nlens-callbacks: all good"),
        ("run\x07bell", "run\\x07bell"),
    ],
)
def test_file_names_are_shown_escaped_and_cannot_forge_a_line(heavy, record, tmp_path, name, shown):
    import shutil

    rec = tmp_path / name
    shutil.copytree(record, rec)
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)  # the report names the run
    assert r.rc == 0 and r.stdout.splitlines()[0] == f"step 1 of {tmp_path}/{shown}", r.stdout[:300]
    (rec / "record.json").write_text("{not json")
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    # one line: a newline of the name is whitespace there, collapsed with the rest (escaped in the report's own lines)
    assert r.rc == 2 and len(lines) == 1 and f"{shown.replace(chr(92) + 'n', ' ')}/record.json" in lines[0], r.stderr
    assert not any(c in r.stderr + r.stdout for c in "\x1b\x07"), lines[0]


def test_a_very_long_path_keeps_its_file_name(heavy, tmp_path):
    rec = tmp_path.joinpath(*[f"d{i:02d}" + "x" * 200 for i in range(25)], "my_record")  # 5,000 characters and more
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.rc == 2 and len(lines) == 1 and len(str(rec)) > 5_000, r.stderr[-500:]
    assert "/my_record" in lines[0] and str(tmp_path)[:40] in lines[0] and len(lines[0]) <= 1000, lines[0]


def test_a_non_utf8_file_name_under_a_strict_locale_is_one_line(record, tmp_path):
    import shutil
    import subprocess
    import sys

    rec = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"run\xff\xfe")))
    shutil.copytree(record, rec)
    (rec / "record.json").write_text("{not json")
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONIOENCODING="ascii:strict", PYTHONUTF8="0", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "lens_callbacks.cli", "audit", os.fsencode(rec), "--step", "1", "--no-progress"],
        capture_output=True,
        env=env,
        timeout=120,
    )
    err = r.stderr.decode("ascii", "replace")
    assert r.returncode == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "run\\udcff\\udcfe/record.json" in err or "run\\xff\\xfe/record.json" in err, err


# ------------------------------------------------------------------ fit --config: read bounded before LightningCLI
def _bomb(depth: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("spelling", ["--config", "-c", "--config="])
def test_fit_refuses_an_alias_bomb_config_before_lightning_reads_it(light, tmp_path, spelling):
    p = tmp_path / "bomb.yaml"
    p.write_text(_bomb())
    argv = ["fit", spelling + str(p)] if spelling.endswith("=") else ["fit", spelling, str(p)]
    refused(light.run(*argv), p, "200,000")


def test_fit_refuses_a_fifo_config_and_a_number_too_long_to_read(light, tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    refused(light.run("fit", "--config", fifo), fifo, "regular file|FIFO|fifo")
    big = tmp_path / "big.yaml"
    big.write_text("trainer:\n  max_steps: " + "9" * 200_000 + "\n")
    refused(light.run("fit", "--config", big), big, "cannot be read")


def test_fit_reads_every_shipped_config_through_the_same_check():
    import yaml

    from lens_callbacks.cli import check_configs, config_paths
    from lens_callbacks.io.config import read_config_yaml

    configs = sorted((Path(__file__).resolve().parents[2] / "cli_configs").glob("*.yaml"))
    assert configs
    for c in configs:
        assert config_paths(["fit", "-c", str(c), "--trainer.max_steps=1"]) == [str(c)]
        assert check_configs(["fit", "--config=" + str(c)]) is None
        assert read_config_yaml(c) == yaml.safe_load(c.read_text())  # the same document PyYAML reads
