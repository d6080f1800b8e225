"""Builders of hostile inputs: SkyRL dumps, checkpoints and run-record edits an attacker or a careless user makes.

Each builder writes real bytes to disk; nothing here reads them back. The dumps start from the real
current-layout fixture (decoded with a permissive stand-in unpickler, then pickled again as the plain
state dict the reader also accepts) and change one thing.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
from skyrl_fixtures import CURRENT, FIX, HOSTILE, LEGACY, TRUNCATED  # noqa: E402,F401

GiB = 1 << 30


def current_state() -> dict:
    """The current fixture's TrainingInputBatch state, as plain python (device as a string)."""

    class U(pickle.Unpickler):
        def find_class(self, module, name):
            return {
                ("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch"): lambda cls, state: state,
                ("skyrl.backends.skyrl_train.training_batch", "TrainingInputBatch"): object,
                ("torch", "device"): lambda *a: ":".join(map(str, a)),
            }[(module, name)]

    with open(CURRENT, "rb") as f:
        return U(f).load()


def np_entry(a: np.ndarray) -> dict:
    return {"format": "numpy", "data": a.tobytes(), "shape": tuple(a.shape), "dtype": str(a.dtype)}


def decode(entry: dict) -> np.ndarray:
    return np.frombuffer(entry["data"], dtype=entry["dtype"]).reshape(entry["shape"])


def write_state(path: Path, state: dict) -> Path:
    path.write_bytes(pickle.dumps(state, protocol=4))
    return path


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- zips
def zip_bytes(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive from (name, payload, method, crc, uncompressed size): payloads are written as given.

    ``zipfile`` cannot store a payload compressed elsewhere; a bomb's deflate stream is built without ever
    holding the inflated bytes, so the archive is laid out here by hand (APPNOTE 4.3: local headers, central
    directory, end record).
    """
    out, central = bytearray(), bytearray()
    for name, payload, method, crc, usize in members:
        n = name.encode()
        offset = len(out)
        out += (
            struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), usize, len(n), 0)
            + n
            + payload
        )
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0x21,
                crc,
                len(payload),
                usize,
                len(n),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + n
        )
    cd_offset = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), cd_offset, 0)
    return bytes(out)


def deflate_bomb(inflated: int = 3 * GiB // 2) -> tuple[bytes, int, int]:
    """A raw deflate stream of ``inflated`` zero bytes, its CRC-32 and size, built in about a second.

    One 64 MiB block of zeros is compressed once and ended with a full flush, which resets the compressor, so
    the same bytes encode every following block; the CRC is computed over the real zeros, block by block.
    """
    block = 64 << 20
    assert inflated % block == 0
    zeros = bytes(block)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    tail = c.flush(zlib.Z_FINISH)
    crc = 0
    for _ in range(inflated // block):
        crc = zlib.crc32(zeros, crc)
    return one * (inflated // block) + tail, crc, inflated


def torch_zip_members(data: bytes) -> list[tuple[str, bytes, int, int, int]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(i.filename, zf.read(i), zipfile.ZIP_STORED, i.CRC, i.file_size) for i in zf.infolist()]


def with_bomb(data: bytes, suffix: str, bomb: tuple[bytes, int, int]) -> bytes:
    """A torch.save archive whose member ending in ``suffix`` is replaced by a deflate bomb."""
    members = []
    for name, payload, method, crc, usize in torch_zip_members(data):
        if name.endswith(suffix):
            payload, crc, usize = bomb
            method = zipfile.ZIP_DEFLATED
        members.append((name, payload, method, crc, usize))
    return zip_bytes(members)


def deflated_copy(data: bytes) -> bytes:
    """The same torch.save archive with every member deflated (torch itself stores them)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for i in src.infolist():
            dst.writestr(i.filename, src.read(i))
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- dumps
def dump_memo_index(tmp: Path) -> Path:
    """9 bytes: PROTO 4, NONE, LONG_BINPUT 2**27, STOP — the C unpickler would grow its memo to 2**27 slots."""
    data = b"\x80\x04N" + b"r" + struct.pack("<I", 2**27) + b"."
    assert len(data) == 9
    p = tmp / "global_step_0_training_input.pkl"
    p.write_bytes(data)
    return p


def dump_stride0(tmp: Path) -> Path:
    """rollout_logprobs as a torch.save of a stride-0 view of shape (14, 2**24) over one bfloat16."""
    state = current_state()
    view = torch.zeros(1, dtype=torch.bfloat16).expand(14, 2**24)
    state["batch_dict"]["rollout_logprobs"] = {"format": "torch", "data": torch_bytes(view)}
    return write_state(tmp / "global_step_3_training_input.pkl", state)


def dump_zip_bomb(tmp: Path, member: str, bomb: tuple[bytes, int, int]) -> Path:
    """rollout_logprobs' torch.save archive with its storage record (``data/0``) or ``data.pkl`` inflating to 1.5 GiB."""
    state = current_state()
    entry = state["batch_dict"]["rollout_logprobs"]
    entry["data"] = with_bomb(entry["data"], member, bomb)
    return write_state(tmp / "global_step_3_training_input.pkl", state)


def dump_boundaries(tmp: Path) -> Path:
    state = current_state()
    state["metadata"]["policy_prompt_boundaries"] = [(0, int(3e8))]
    return write_state(tmp / "global_step_3_training_input.pkl", state)


def dump_shared_bytes(tmp: Path, n: int = 3000) -> Path:
    """One 1 MiB byte string, memo-referenced by ``n`` batch entries (each decodes to its own 1 MiB array)."""
    state = current_state()
    blob = bytes(14 * 74899)  # >= 1 MiB, 14 rows of uint8
    for k in range(n):
        state["batch_dict"][f"extra_{k}"] = {"format": "numpy", "data": blob, "shape": (14, 74899), "dtype": "uint8"}
    return write_state(tmp / "global_step_3_training_input.pkl", state)


def dump_edit(tmp: Path, edit: Callable[[dict], None]) -> Path:
    state = current_state()
    edit(state)
    return write_state(tmp / "global_step_3_training_input.pkl", state)


def symlink_to(tmp: Path, target: str, name: str = "global_step_0_training_input.pkl") -> Path:
    p = tmp / name
    os.symlink(target, p)
    return p


def fifo(tmp: Path, name: str = "global_step_0_training_input.pkl") -> Path:
    p = tmp / name
    os.mkfifo(p)
    return p


# --------------------------------------------------------------------------------------------- checkpoints
class Touch:
    """Pickles as ``pathlib.Path.touch(path)``: a marker file appears if anything unpickles it for real."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def garbage(n: int = 4096, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    """Load a JSON file, let ``edit`` change the object in place (its return value is ignored), write it back."""
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))
