"""Families of hostile pickles and archives, each scaled by one parameter the attacker controls.

Each builder writes real bytes (nothing here reads them back):

- hash DAG: a dict key ``t_k = (t_{k-1}, t_{k-1})`` of ``levels`` levels (``levels`` memo references; its
  hash visits 2**levels nodes);
- path DAG: a value ``l_k = [l_{k-1}, l_{k-1}]`` of ``levels`` levels (a walk that follows every path visits
  2**levels nodes);
- collision keys: ``n`` dict keys that all hash alike: ``k * (2**61 - 1)`` (ints), or int pairs chosen so that
  their tuple hashes are equal (:func:`colliding_pairs`; tuple hashes are not randomized);
- amplification: one 1 MiB byte string handed ``n`` times to the ``torch.device`` stand-in of a SkyRL dump;
- zip aliases: a ``torch.save`` archive whose ``n`` central-directory entries all point at one member.

Pickle fragments are spliced into a real pickle in place of the string ``"__HOLE__"``; their memo entries
start at the number of entries stored before the hole, so every later memo read still finds what it read
before.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile
import zlib
from pathlib import Path

import hostile as H
import torch

HOLE = "__HOLE__"
M61 = (1 << 61) - 1
MiB = 1 << 20


# --------------------------------------------------------------------------------------------- fragments
def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _long(v: int) -> bytes:
    return b"\x8a" + bytes([len(pickle.encode_long(v))]) + pickle.encode_long(v)


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def tuple_dag(levels: int):
    def frag(k: int) -> bytes:
        # (t_0, t_1, ..., t_levels): every level stays on the stack (torch's unpickler has no POP), then one tuple.
        out = b"()" + _put(k)
        for j in range(1, levels + 1):
            out += _get(k + j - 1) + _get(k + j - 1) + b"\x86" + _put(k + j)
        return out + b"t"

    return frag


def list_dag(levels: int):
    def frag(k: int) -> bytes:
        out = b"](]" + _put(k)
        for j in range(1, levels + 1):
            out += b"](" + _get(k + j - 1) + _get(k + j - 1) + b"e" + _put(k + j)
        return out + b"e"

    return frag


def int_collision_dict(n: int):
    """A dict of ``n`` int keys ``k * (2**61 - 1)``, k = 1..n: every one hashes to 0."""

    def frag(k: int) -> bytes:
        return b"}(" + b"".join(_long(j * M61) + b"K\x00" for j in range(1, n + 1)) + b"u"

    return frag


def tuple_collision_dict(n: int):
    """A dict of ``n`` keys ``(a, b)`` of 64-bit ints whose tuple hashes are all equal."""

    def frag(k: int) -> bytes:
        return b"}(" + b"".join(_long(a) + _long(b) + b"\x86K\x00" for a, b in colliding_pairs(n)) + b"u"

    return frag


def device_amplification(n: int, blob_bytes: int = MiB):
    """A list of ``n`` ``torch.device(blob)`` calls on one memo-shared byte string of ``blob_bytes``."""

    def frag(k: int) -> bytes:
        out = b"B" + struct.pack("<I", blob_bytes) + bytes(blob_bytes) + _put(k) + b"0"
        out += b"ctorch\ndevice\n" + _put(k + 1) + b"0"  # stored once, then popped
        out += b"](" + (_get(k + 1) + _get(k) + b"\x85R") * n + b"e"
        return out

    return frag


def splice(data: bytes, frag) -> bytes:
    """``data`` (a protocol 2/3 pickle) with the op pushing ``"__HOLE__"`` replaced by ``frag(first free memo index)``."""
    memo = 0
    for op, arg, pos in pickletools.genops(io.BytesIO(data)):
        if op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo = max(memo, int(arg) + 1)
        if arg == HOLE and op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE"):
            end = pos + 1 + (4 if op.name == "BINUNICODE" else 1) + len(HOLE)
            return data[:pos] + frag(memo) + data[end:]
    raise AssertionError("no hole in the pickle")


# --------------------------------------------------------------------------------------------- tuple-hash collisions
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_U = (1 << 64) - 1


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _U


def _tuple_hash2(h1: int, h2: int) -> int:
    """CPython's (3.8+, 64-bit) xxHash-based hash of a 2-tuple from its items' hashes, as an unsigned int."""
    acc = _P5
    for lane in (h1 & _U, h2 & _U):
        acc = (acc + lane * _P2) & _U
        acc = _rotl(acc, 31)
        acc = (acc * _P1) & _U
    return (acc + (2 ^ (_P5 ^ 3527539))) & _U


def colliding_pairs(n: int, target: int = 12345) -> list[tuple[int, int]]:
    """``n`` distinct pairs of 64-bit ints ``(a, b)`` with ``hash((a, b))`` all equal (a = 0, 1, 2, ...; b solved)."""
    inv1, inv2 = pow(_P1, -1, 1 << 64), pow(_P2, -1, 1 << 64)
    acc2 = (target - (2 ^ (_P5 ^ 3527539))) & _U
    pre = (acc2 * inv1) & _U
    pre = ((pre >> 31) | (pre << 33)) & _U  # undo the rotation by 31
    out, a = [], 0
    while len(out) < n:
        acc1 = _rotl((_P5 + a * _P2) & _U, 31) * _P1 & _U
        lane = ((pre - acc1) * inv2) & _U
        b = lane - (1 << 64) if lane >= 1 << 63 else lane
        if abs(b) < M61 and b != -1 and hash(b) == b:  # an int is its own hash in (-M61, M61)
            out.append((a, b))
        a += 1
    return out


# --------------------------------------------------------------------------------------------- SkyRL dumps
def dump_with(tmp: Path, frag, where: str, marker: Path | None = None) -> Path:
    """The real fixture's state with ``frag`` as a metadata key (``where="key"``) or a metadata value; with
    ``marker``, also an entry that creates that file if anything unpickles it for real."""
    state = H.current_state()
    if where == "key":
        state["metadata"][HOLE] = 1
    else:
        state["metadata"]["extra"] = HOLE
    if marker is not None:
        state["metadata"]["zz"] = H.Touch(marker)
    p = tmp / "global_step_3_training_input.pkl"
    p.write_bytes(splice(pickle.dumps(state, protocol=3), frag))
    return p


# --------------------------------------------------------------------------------------------- checkpoints
def _archive(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, payload in members:
            zf.writestr(name, payload)
    return buf.getvalue()


def good_ckpt(step: int) -> bytes:
    g = torch.Generator().manual_seed(step)
    return H.torch_bytes({"state_dict": {"w": torch.randn(4, 3, generator=g)}, "global_step": step})


def ckpt_with(frag, where: str, step: int = 30, marker: Path | None = None) -> bytes:
    """A Lightning-style checkpoint whose data.pkl holds ``frag`` as a top-level key or the value of ``extra``
    (and, with ``marker``, an entry that creates that file if anything unpickles it for real)."""
    g = torch.Generator().manual_seed(step)
    obj = {"state_dict": {"w": torch.randn(4, 3, generator=g)}, "global_step": step}
    if where == "key":
        obj[HOLE] = 1
    else:
        obj["extra"] = HOLE
    if marker is not None:
        obj["zz"] = H.Touch(marker)
    members = []
    with zipfile.ZipFile(io.BytesIO(H.torch_bytes(obj))) as zf:
        for info in zf.infolist():
            payload = zf.read(info)
            if info.filename.endswith("data.pkl"):
                payload = splice(payload, frag)
            members.append((info.filename, payload))
    return _archive(members)


def ckpt_zip_aliases(n: int, member_bytes: int = 3 * MiB // 2, step: int = 30) -> bytes:
    """A torch.save archive of ``n`` float32 tensors whose storage entries ``data/0 .. data/{n-1}`` in the central
    directory all point at the one stored member ``data/0`` of ``member_bytes``: ``torch.load`` reads it ``n``
    times."""
    numel = member_bytes // 4
    pkl = b"\x80\x02}(" + _str("state_dict") + b"}("
    for i in range(n):
        pkl += (
            _str(f"w{i}")
            + b"ctorch._utils\n_rebuild_tensor_v2\n("
            + b"("
            + _str("storage")
            + b"ctorch\nFloatStorage\n"
            + _str(str(i))
            + _str("cpu")
            + b"J"
            + struct.pack("<i", numel)
            + b"tQ"
            + b"K\x00J"
            + struct.pack("<i", numel)
            + b"\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRr"
            + struct.pack("<I", i)
        )
    pkl += b"u" + _str("global_step") + b"J" + struct.pack("<i", step) + b"u."
    members = [("archive/data.pkl", pkl), ("archive/byteorder", b"little"), ("archive/version", b"3\n")]
    out, central = bytearray(), bytearray()
    offsets = {}
    for name, payload in members + [("archive/data/0", bytes(member_bytes))]:
        nb = name.encode()
        offsets[name] = len(out)
        crc = zlib.crc32(payload)
        out += (
            struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(payload), len(payload), len(nb), 0)
            + nb
            + payload
        )
    entries = [(name, payload, offsets[name]) for name, payload in members]
    blob = bytes(member_bytes)
    crc0 = zlib.crc32(blob)
    entries += [(f"archive/data/{i}", None, offsets["archive/data/0"]) for i in range(n)]
    for name, payload, off in entries:
        nb = name.encode()
        size = member_bytes if payload is None else len(payload)
        crc = crc0 if payload is None else zlib.crc32(payload)
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, size, size, len(nb), 0, 0, 0, 0, 0, off
            )
            + nb
        )
    cd = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central), cd, 0)
    return bytes(out)


# --------------------------------------------------------------------------------------------- run records
def record_lines(pairs: list[tuple[int, int]]) -> str:
    """Trajectory lines (schema lens_callbacks.trajectory/1) with the given (step, group) ids, one rollout each."""
    lines = []
    for s, g in pairs:
        lines.append(
            '{"schema": "lens_callbacks.trajectory/1", "step": %d, "group": %d, "rollout": 0, "prompt_id": "p", '
            '"reward": 1.0, "turns": [{"role": "user", "text": "q", "token_ids": [1], "trained": false, '
            '"tool_call": null}, {"role": "assistant", "text": "a", "token_ids": [2, 3], "trained": true, '
            '"tool_call": null}]}' % (s, g)
        )
    return "\n".join(lines) + "\n"


def record_dir(tmp: Path, pairs: list[tuple[int, int]]) -> Path:
    d = tmp / "record"
    (d / "trajectories").mkdir(parents=True, exist_ok=True)
    (d / "trajectories" / "step_000000.jsonl").write_text(record_lines(pairs))
    return d
