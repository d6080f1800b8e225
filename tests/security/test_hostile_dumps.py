"""Hostile SkyRL dumps and checkpoints through the real commands: refused in one line, bounded in memory and time.

Every case runs `lens-callbacks skyrl|process|anchor-gate` in a forked child of a warm worker (isolated.py)
under an address-space limit and a timeout, and asserts: exit status 2, exactly one line on stderr naming
the file and what is wrong, a peak resident memory under 600 MB for the whole command, no timeout, and no
marker file where the input tried to run code. Without the bounds, the same inputs took 1.5 to 3.3 GB
or blocked forever.
"""

from __future__ import annotations

import hostile as H
import numpy as np
import pytest
import torch
from hostile import CURRENT, HOSTILE, LEGACY, TRUNCATED

PEAK_MB = 600
needs_fixtures = pytest.mark.skipif(not CURRENT.is_file(), reason=f"SkyRL fixtures not found at {H.FIX}")


@pytest.fixture(scope="session")
def bomb():
    return H.deflate_bomb()  # 1.5 GiB of zeros in 1.6 MB


def _refused(r, *needles: str, path=None, peak_mb: float = PEAK_MB, within_s: float = 20.0) -> None:
    lines = r.stderr.splitlines()
    assert r.rc == 2 and not r.timed_out, (r.rc, r.timed_out, r.stderr[-2000:], r.stdout[-500:])
    assert len(lines) == 1, r.stderr  # one line, never a traceback
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    if path is not None:
        assert str(path) in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.peak_mb < peak_mb, (r.peak_mb, lines[0])
    assert r.wall_s < within_s, (r.wall_s, lines[0])


# ------------------------------------------------------------------------------------- the SkyRL cases
SKYRL_CASES = {
    # name: (builder(tmp, bomb) -> path, words the one line must hold)
    "memo_index_2_27_in_9_bytes": (lambda t, b: H.dump_memo_index(t), ["memo index 134217728"]),
    "stride_0_view_14x2_24": (lambda t, b: H.dump_stride0(t), ["rollout_logprobs", "stride 0"]),
    "deflated_1_5GiB_storage_record": (
        lambda t, b: H.dump_zip_bomb(t, "data/0", b),
        ["rollout_logprobs", "read budget", "data/0"],
    ),
    "deflated_1_5GiB_data_pkl": (
        lambda t, b: H.dump_zip_bomb(t, "data.pkl", b),
        ["rollout_logprobs", "read budget", "data.pkl"],
    ),
    "boundaries_0_to_3e8": (lambda t, b: H.dump_boundaries(t), ["policy_prompt_boundaries"]),
    "one_MiB_bytes_referenced_3000_times": (lambda t, b: H.dump_shared_bytes(t), ["read budget", "extra_"]),
    "symlink_to_dev_zero": (lambda t, b: H.symlink_to(t, "/dev/zero"), ["must be a regular file", "character device"]),
    "eval_global_fixture": (lambda t, b: HOSTILE, ["builtins.eval"]),
    "truncated_fixture": (lambda t, b: TRUNCATED, ["truncated"]),
    "directory": (lambda t, b: t, ["must be a regular file", "directory"]),
}


@needs_fixtures
@pytest.mark.parametrize("case", sorted(SKYRL_CASES))
def test_hostile_dump_is_refused_in_one_line_within_memory(light, tmp_path, bomb, case):
    build, needles = SKYRL_CASES[case]
    path = build(tmp_path, bomb)
    for command in ("skyrl", "process") if case != "directory" else ("skyrl",):
        r = light.run(command, path, "--no-progress" if command == "process" else "--json", timeout=30, mem_mb=2048)
        _refused(r, *needles, path=path)


@needs_fixtures
def test_a_named_pipe_is_answered_in_under_5_seconds(light, tmp_path):
    path = H.fifo(tmp_path)
    r = light.run("skyrl", path, timeout=10)
    _refused(r, "named pipe", path=path, within_s=5.0)


# ------------------------------------------------------------------------------------- tracebacks that became messages
def _shape(key: str, shape):
    def edit(state):
        state["batch_dict"][key] = H.np_entry(H.decode(state["batch_dict"][key]).reshape(shape))

    return edit


def _first_column(key: str):
    def edit(state):
        state["batch_dict"][key] = H.np_entry(H.decode(state["batch_dict"][key])[:, :1].copy())

    return edit


def _nan_advantage(state):
    a = H.decode(state["batch_dict"]["advantages"]).copy()
    a[2, 5] = np.nan
    state["batch_dict"]["advantages"] = H.np_entry(a)


def _set(path, value):
    def edit(state):
        d = state
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return edit


DUMP_FIELD_CASES = {
    # name: (edit of the state, command, words the one line must hold)
    "advantages_1d": (_shape("advantages", (140,)), "skyrl", ["`advantages`", "[140]"]),
    "advantages_14x1": (_first_column("advantages"), "skyrl", ["`advantages`", "[12, 1]", "padding rows"]),
    "non_string_key": (_set(["batch_dict", 3], None), "skyrl", ["keys must be str", "3"]),
    "sequences_1d": (_shape("sequences", (224,)), "skyrl", ["`sequences`", "[224]"]),
    "nan_advantages_process": (_nan_advantage, "process", ["`advantages`", "non-finite", "row 2, column 5"]),
    "nan_advantages_skyrl": (_nan_advantage, "skyrl", ["`advantages`", "non-finite"]),
    "object_dtype": (_set(["batch_dict", "loss_mask", "dtype"], "object"), "skyrl", ["`loss_mask`", "dtype"]),
    "shape_beyond_bytes": (_set(["batch_dict", "sequences", "shape"], (14, 2**40)), "skyrl", ["`sequences`", "needs"]),
    "batch_size_string": (_set(["batch_size"], "14"), "skyrl", ["`batch_size`"]),
    "metadata_list": (_set(["metadata"], [1, 2]), "skyrl", ["`metadata`"]),
    "pad_size_float": (_set(["metadata", "pad_size"], 2.0), "skyrl", ["`pad_size`"]),
    "boundaries_not_pairs": (
        _set(["metadata", "policy_prompt_boundaries"], [(0, 4, 9)]),
        "skyrl",
        ["policy_prompt_boundaries"],
    ),
}


@needs_fixtures
@pytest.mark.parametrize("case", sorted(DUMP_FIELD_CASES))
def test_bad_dump_fields_are_one_line_naming_the_field(light, tmp_path, case):
    edit, command, needles = DUMP_FIELD_CASES[case]
    path = H.dump_edit(tmp_path, edit)
    r = light.run(command, path, *(["--no-progress"] if command == "process" else []))
    _refused(r, *needles, path=path)


# ------------------------------------------------------------------------------------- anchor-gate checkpoints
def _good_ckpt(step: int) -> bytes:
    g = torch.Generator().manual_seed(step)
    return H.torch_bytes({"state_dict": {"w": torch.randn(4, 3, generator=g)}, "global_step": step})


CKPT_CASES = {
    "garbage": (lambda t: H.garbage(), ["not a torch.save zip archive"]),
    "malicious_reduce": (
        lambda t: H.torch_bytes({"state_dict": {"w": H.Touch(t / "MARKER")}, "global_step": 30}),
        ["weights_only=True"],
    ),
    "stride_0": (
        lambda t: H.torch_bytes({"state_dict": {"w": torch.zeros(1).expand(14, 2**24)}, "global_step": 30}),
        ["stride 0"],
    ),
    "deflated_members": (lambda t: H.deflated_copy(_good_ckpt(30)), ["compressed"]),
    "truncated": (lambda t: _good_ckpt(30)[:300], ["epoch=0-step=30.ckpt"]),
}


@pytest.mark.parametrize("case", sorted(CKPT_CASES))
def test_bad_checkpoint_for_anchor_gate_is_one_line_and_runs_nothing(light, tmp_path, case):
    build, needles = CKPT_CASES[case]
    for s in (0, 10, 20):
        (tmp_path / f"epoch=0-step={s}.ckpt").write_bytes(_good_ckpt(s))
    bad = tmp_path / "epoch=0-step=30.ckpt"
    bad.write_bytes(build(tmp_path))
    r = light.run("anchor-gate", tmp_path, "--cadence", "10", "--delay-K", "10", "--no-progress")
    _refused(r, *needles, path=bad)
    assert not (tmp_path / "MARKER").exists()


def test_checkpoint_behind_a_symlink_or_a_pipe_is_refused_at_once(light, tmp_path):
    (tmp_path / "epoch=0-step=0.ckpt").write_bytes(_good_ckpt(0))
    H.symlink_to(tmp_path, "/dev/zero", "epoch=0-step=10.ckpt")
    r = light.run("anchor-gate", tmp_path, "--cadence", "10", "--delay-K", "10", "--no-progress")
    _refused(r, "character device")
    (tmp_path / "epoch=0-step=10.ckpt").unlink()
    H.fifo(tmp_path, "epoch=0-step=10.ckpt")
    r = light.run("anchor-gate", tmp_path, "--cadence", "10", "--delay-K", "10", "--no-progress", timeout=10)
    _refused(r, "named pipe", within_s=5.0)


def test_debug_shows_the_traceback(light, tmp_path):
    path = H.dump_memo_index(tmp_path)
    r = light.run("skyrl", path, "--debug")
    assert (
        r.rc == 2 and "Traceback" in r.stderr and r.stderr.rstrip().splitlines()[-1].startswith("lens-callbacks skyrl:")
    )


def test_argument_errors_are_one_line_too(light):
    for argv in (
        ["skyrl"],
        ["process", "--groups", "x", "p"],
        ["anchor-gate", ".", "--cadence", "x", "--delay-K", "1"],
    ):
        r = light.run(*argv)
        assert r.rc == 2 and len(r.stderr.splitlines()) == 1 and "--help" in r.stderr, (argv, r.stderr)


# ------------------------------------------------------------------------------------- the real fixtures, as before
@needs_fixtures
@pytest.mark.parametrize("fixture", [CURRENT, LEGACY], ids=["current", "legacy"])
def test_real_fixtures_read_exactly_as_an_independent_decoder_does(light, fixture):
    """Every tensor equals numpy's decoding of the state's bytes (bfloat16: torch.load of the embedded payload)."""
    import io
    import pickle

    from lens_callbacks.io.skyrl import read_skyrl_dump

    class U(pickle.Unpickler):
        def find_class(self, module, name):
            if name == "TrainingInputBatch":
                return type("B", (dict,), {"__setstate__": lambda self, s: setattr(self, "state", s)})
            return {
                "_rebuild_tensor_batch": lambda cls, state: state,
                "device": lambda *a: "cpu",
                "_rebuild_tensor_v2": lambda *a: None,
                "_load_from_bytes": lambda b: None,
                "OrderedDict": dict,
            }[name]

    obj = U(open(fixture, "rb")).load()
    state = getattr(obj, "state", obj)
    n = state["batch_size"] - state["metadata"]["pad_size"]
    dump = read_skyrl_dump(fixture)
    assert list(dump.batch) == list(state["batch_dict"])
    for key, e in state["batch_dict"].items():
        if e is None:
            assert dump.batch[key] is None
            continue
        if e["format"] == "numpy":
            ref = torch.from_numpy(H.decode(e).copy())[:n]
        else:
            ref = torch.load(io.BytesIO(e["data"]), weights_only=True)[:n]
        got = dump.batch[key]
        assert got.dtype == ref.dtype and torch.equal(
            got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
            ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref,
        ), key
    r = light.run("skyrl", fixture)
    assert r.rc == 0 and r.stderr == "" and "rows 12" in r.stdout and r.peak_mb < PEAK_MB
