"""Hostile files, round three: the unpickler's own classes, budgets that count what is built, work in the size of
what is listed, the probe path, and the lesser faults.

Every case runs through the real console script in a forked child of a warm worker (conftest.py): a refused
case must end in exit 2 (or 3 where documented), one line naming the file and the field, no traceback on
stdout or stderr, under 10 s and 600 MB.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest

import families as F
import hostile as H

PEAK_MB = 600
WITHIN_S = 10.0
needs_fixtures = pytest.mark.skipif(not H.CURRENT.is_file(), reason=f"SkyRL fixtures not found at {H.FIX}")


def refused(r, path, *needles: str, rc: int = 2) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.rc == rc and not r.timed_out, (r.rc, r.timed_out, r.wall_s, r.stderr[-2000:], r.stdout[-500:])
    assert len(lines) == 1 and "Traceback" not in r.stderr + r.stdout and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert str(path) in lines[0], lines[0]
    for n in needles:  # "a|b": either
        assert any(alt in lines[0] for alt in n.split("|")), (n, lines[0])
    assert r.peak_mb < PEAK_MB, (r.peak_mb, lines[0])
    assert r.wall_s < WITHIN_S, (r.wall_s, lines[0])
    return lines[0]


# --------------------------------------------------------------------------------------------- 1. the gadgets
OUTER = [("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch"),
         ("skyrl.backends.skyrl_train.training_batch", "TrainingInputBatch"),
         ("skyrl_train.training_batch", "TrainingInputBatch"), ("torch._utils", "_rebuild_tensor_v2"),
         ("torch.storage", "_load_from_bytes"), ("collections", "OrderedDict"), ("torch", "device")]
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
                r = light.run(command, p, "--no-progress" if command == "process" else "--json", timeout=30, mem_mb=2048)
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
