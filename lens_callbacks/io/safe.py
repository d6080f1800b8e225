"""Bounded reads of files other people wrote: regular files only, size caps, a pickle pre-scan, a budget.

Every reader in :mod:`lens_callbacks.io` (SkyRL dumps, run records, policy checkpoints) and the offline
commands go through this module, so that a hostile or careless file can neither hang a reader (a FIFO,
a device, ``/dev/zero`` behind a symlink) nor make it allocate far more than the file holds (a memo
index of 2**27 in a 9-byte pickle, a stride-0 view of 2**28 elements, a deflated zip member of 1.5 GiB).

The limits (:class:`ReadLimits`) default to a ceiling on file size and, per read, an allocation budget of
``budget_factor × file size + budget_floor`` bytes. Each can be raised for files one trusts, through the
``limits=`` argument of a reader or the environment variables ``LENS_MAX_FILE_MB``,
``LENS_READ_BUDGET_FACTOR``, ``LENS_READ_BUDGET_FLOOR_MB`` and ``LENS_MEMORY_MB`` (what a command may hold of
all it reads; a file larger is refused unread) (see docs/security.md). A refusal is a
:class:`BoundedReadError` (a ``ValueError``) whose message names the file, what exceeded which limit,
and how to raise it.
"""

from __future__ import annotations

import os
import reprlib
import stat
import zipfile
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from .pickle_scan import PickleRefused, scan_pickle_stream

__all__ = [
    "ReadLimits",
    "ReadBudget",
    "BoundedReadError",
    "open_regular_file",
    "read_regular_file",
    "read_exactly",
    "check_inside",
    "scan_pickle",
    "read_zip_member",
    "load_torch_checkpoint",
    "check_tensor_views",
]

PathLike = Union[str, "os.PathLike[str]"]

_MiB = 1 << 20


class BoundedReadError(ValueError):
    """A file refused before it could hang the reader or exhaust memory; the message names file and limit."""


#: The largest value an environment knob takes: a factor of a billion, a billion MiB (a petabyte). Past it a
#: budget is no bound at all, and the byte counts built from it overflow.
_ENV_MAX = 1e9


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BoundedReadError(
            f"`{name}` must be a number, got {raw[:40]!r}; unset it to use the default {default:g}."
        ) from None
    if not 0 < value <= _ENV_MAX:  # NaN fails this too
        raise BoundedReadError(
            f"`{name}` must be a number > 0 and at most {_ENV_MAX:g}, got {raw[:40]!r}; unset it to use "
            f"the default {default:g}."
        )
    return value


def _env_bytes(name: str, default_bytes: int) -> int:
    """An environment knob given in MiB, as bytes: at least one byte, or one line naming the variable."""
    n = int(_env_number(name, default_bytes / _MiB) * _MiB)
    if n < 1:
        raise BoundedReadError(
            f"`{name}` must be at least one byte ({1 / _MiB:.2g} MiB), got {os.environ.get(name)!r}; "
            "it is a size in MiB."
        )
    return n


@dataclass(frozen=True)
class ReadLimits:
    """What one read may cost.

    Attributes:
        max_file_bytes: the largest file read at all (default 2 GiB; ``LENS_MAX_FILE_MB``).
        budget_factor: the allocation budget per read is ``budget_factor × file size + budget_floor``
            (default 4; ``LENS_READ_BUDGET_FACTOR``). It is charged with every decoded array, every
            decompressed zip member and every tensor view a file asks for.
        budget_floor: see ``budget_factor`` (default 64 MiB; ``LENS_READ_BUDGET_FLOOR_MB``).
        max_pickle_opcodes: the most opcodes one pickle may hold (default 1,000,000). SkyRL dumps and
            checkpoints hold a few hundred to a few thousand: their tensors are single byte strings.
        max_zip_members: the most members one zip archive may hold (default 100,000).
        max_pickle_nodes: the most nodes a pickle's structure may hold once fully expanded, every shared
            reference counted at its full size (default 2,000,000): also the most objects one walk of a loaded
            structure visits.
        memory_bytes: what the data one command reads may hold in memory, all files together (default
            256 MiB; ``LENS_MEMORY_MB``): a file larger than this is refused by its size before any byte is
            read, whatever ``max_file_bytes`` allows, and no read's allocation budget exceeds it. With the
            interpreter and torch, the whole command stays under 600 MB.
    """

    max_file_bytes: int = 2048 * _MiB
    budget_factor: float = 4.0
    budget_floor: int = 64 * _MiB
    max_pickle_opcodes: int = 1_000_000
    max_zip_members: int = 100_000
    max_pickle_nodes: int = 2_000_000
    memory_bytes: int = 256 * _MiB

    def __post_init__(self) -> None:
        for name in (
            "max_file_bytes",
            "budget_floor",
            "max_pickle_opcodes",
            "max_zip_members",
            "max_pickle_nodes",
            "memory_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"`{name}` must be an int > 0, got {v!r}.")
        f = self.budget_factor
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f < float("inf"):
            raise ValueError(f"`budget_factor` must be a finite number > 0, got {f!r}.")

    @classmethod
    def from_env(cls) -> "ReadLimits":
        """The defaults, overridden by ``LENS_MAX_FILE_MB``, ``LENS_READ_BUDGET_FACTOR``, ``LENS_READ_BUDGET_FLOOR_MB``."""
        d = cls()
        return cls(
            max_file_bytes=_env_bytes("LENS_MAX_FILE_MB", d.max_file_bytes),
            budget_factor=_env_number("LENS_READ_BUDGET_FACTOR", d.budget_factor),
            budget_floor=_env_bytes("LENS_READ_BUDGET_FLOOR_MB", d.budget_floor),
            max_pickle_opcodes=d.max_pickle_opcodes,
            max_zip_members=d.max_zip_members,
            max_pickle_nodes=d.max_pickle_nodes,
            memory_bytes=_env_bytes("LENS_MEMORY_MB", d.memory_bytes),
        )

    def budget_for(self, file_bytes: int, path: str) -> "ReadBudget":
        return ReadBudget(int(min(self.budget_factor * file_bytes + self.budget_floor, self.memory_bytes)), path, self)


def _mib(n: float) -> str:
    return f"{n / _MiB:.1f} MiB"


class ReadBudget:
    """The bytes one read may still allocate; :meth:`charge` refuses, naming what, once they run out."""

    def __init__(self, total: int, path: str, limits: ReadLimits) -> None:
        self.total, self.used, self.path, self.limits = int(total), 0, path, limits

    @property
    def left(self) -> int:
        return self.total - self.used

    def charge(self, nbytes: int, what: str) -> None:
        nbytes = int(nbytes)
        if nbytes < 0 or nbytes > self.left:
            raise BoundedReadError(
                f"{self.path}: {what} needs {_mib(nbytes)}, beyond the read budget of {_mib(self.total)} "
                f"({self.limits.budget_factor:g} x file size + {_mib(self.limits.budget_floor)}, at most LENS_MEMORY_MB = "
                f"{_mib(self.limits.memory_bytes)}; {_mib(self.used)} already used); raise LENS_READ_BUDGET_FACTOR, "
                "LENS_READ_BUDGET_FLOOR_MB or LENS_MEMORY_MB only for a file you trust."
            )
        self.used += nbytes


#: Where the kernel serves files that say they are regular but are not data (``/proc/self/pagemap`` refuses reads
#: of the wrong size, ``/proc/self/mem`` fails with EIO, ``/sys`` files change while read).
_SPECIAL_ROOTS = ("/proc", "/sys", "/dev")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_inside(root: PathLike, path: PathLike, what: str = "file") -> None:
    """Refuse ``path`` when a symbolic link on its way down from ``root`` leads out of ``root``.

    A shared folder (a run record, a directory of checkpoints or dumps) may hold links between its own files;
    a link out of it would make the reader open whatever the link names (``/proc/self/mem``, a private file),
    so it is refused by the link's name, without reading or quoting its target.
    """
    root_abs, path_abs = os.path.abspath(os.fspath(root)), os.path.abspath(os.fspath(path))
    root_real = os.path.realpath(root_abs)
    rel = os.path.relpath(path_abs, root_abs)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise BoundedReadError(f"{path_abs}: the {what} lies outside the folder {root_abs}; refused.")
    cur = root_abs
    for comp in rel.split(os.sep):
        if comp in ("", os.curdir):
            continue
        cur = os.path.join(cur, comp)
        if os.path.islink(cur) and not _under(os.path.realpath(cur), root_real):
            raise BoundedReadError(
                f"{cur}: the {what} is reached through a symbolic link out of the folder {root_abs}; refused "
                "(links in a shared folder must stay inside it)."
            )


def open_regular_file(
    path: PathLike, limits: Optional[ReadLimits] = None, what: str = "file", root: Optional[PathLike] = None
) -> tuple[int, int]:
    """Open a regular file for reading; return ``(fd, size)``. The caller closes ``fd``.

    Symlinks are resolved and the target is checked again: a FIFO, socket, device or directory is refused
    without blocking (the file is opened ``O_NONBLOCK`` and checked with ``fstat`` on that descriptor, so it
    cannot be swapped between the check and the read), and so is anything under ``/proc``, ``/sys`` or
    ``/dev``. With ``root``, a link out of that folder is refused (:func:`check_inside`). Its size must be at
    most ``limits.max_file_bytes`` and ``limits.memory_bytes``: a file whose size alone breaks the memory
    budget is refused before any byte is read.

    Raises:
        FileNotFoundError: no such file.
        BoundedReadError: not a regular file, a link out of ``root``, or larger than a cap.
    """
    limits = limits or ReadLimits.from_env()
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown}: no such {what}.") from None
    except OSError as err:  # a link loop, a name too long, a folder without permission
        raise BoundedReadError(
            f"{shown}: the {what} cannot be opened ({err.strerror or type(err).__name__})."
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise BoundedReadError(
            f"{shown}: the {what} must be a regular file, got {_kind(st.st_mode)}"
            + (f" (resolved to {real})" if real != os.path.abspath(shown) else "")
            + "."
        )
    if any(_under(real, r) for r in _SPECIAL_ROOTS):
        raise BoundedReadError(
            f"{shown}: the {what} must be a regular file, got a kernel file under "
            f"{next(r for r in _SPECIAL_ROOTS if _under(real, r))}/ (resolved to {real}); refused."
        )
    if root is not None:  # after the kind of file is known: a FIFO or device out of the folder is named as such
        check_inside(root, shown, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(real, flags)
    except OSError as err:
        raise BoundedReadError(f"{shown}: the {what} cannot be opened ({err.strerror or err}).") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BoundedReadError(f"{shown}: the {what} must be a regular file, got {_kind(st.st_mode)}.")
        if st.st_size > limits.max_file_bytes:
            raise BoundedReadError(
                f"{shown}: the {what} is {_mib(st.st_size)}, above the cap of {_mib(limits.max_file_bytes)}; "
                "raise LENS_MAX_FILE_MB if you trust it."
            )
        if st.st_size > limits.memory_bytes:
            raise BoundedReadError(
                f"{shown}: the {what} is {_mib(st.st_size)}, more than the memory budget of {_mib(limits.memory_bytes)} "
                "(LENS_MEMORY_MB); refused before reading it. Raise LENS_MEMORY_MB only for a file you trust."
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, int(st.st_size)


def read_exactly(fd: int, size: int, shown: str, what: str) -> bytes:
    """The ``size`` bytes ``fstat`` promised, and not one more: a file that grows while read is refused at once.

    A read error (``/proc`` files behind a hard link, a disk error) is a :class:`BoundedReadError` naming the file.
    """
    chunks, got = [], 0
    try:
        while got < size:
            chunk = os.read(fd, size - got)
            if not chunk:  # it shrank: what is there is what is read
                break
            chunks.append(chunk)
            got += len(chunk)
        extra = os.read(fd, 1)
    except OSError as err:
        raise BoundedReadError(f"{shown}: the {what} cannot be read ({err.strerror or type(err).__name__}).") from None
    if extra:
        raise BoundedReadError(
            f"{shown}: the {what} grew while being read (it held {size:,} bytes when opened); refused: read "
            "it once nothing writes to it any more."
        )
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_regular_file(
    path: PathLike, limits: Optional[ReadLimits] = None, what: str = "file", root: Optional[PathLike] = None
) -> bytes:
    """The bytes of a regular file, at most ``limits.max_file_bytes`` and ``limits.memory_bytes`` of them.

    See :func:`open_regular_file` (``root``: the shared folder no link may leave). The file is read once, at the
    size it had when opened; one that grows meanwhile is refused before it can hold more.

    Raises:
        FileNotFoundError: no such file.
        BoundedReadError: not a regular file, larger than a cap, grown while read, or unreadable.
    """
    limits = limits or ReadLimits.from_env()
    shown = os.fspath(path)
    fd, size = open_regular_file(shown, limits, what, root)
    try:
        return read_exactly(fd, size, shown, what)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def scan_pickle(
    data: bytes,
    path: str,
    limits: Optional[ReadLimits] = None,
    what: str = "pickle",
    budget: Optional["ReadBudget"] = None,
) -> int:
    """Walk a pickle's opcodes without running any of them; refuse what its bytes cannot honestly hold.

    The static pass of :mod:`lens_callbacks.io.pickle_scan`: memo indices beyond the entries stored so far (the
    C unpickler would grow its memo table to that index: 2**27 costs 2 GiB), memo reads of entries never stored,
    declared lengths and frames beyond the bytes that remain, more than ``limits.max_pickle_opcodes`` opcodes, a
    stream without ``STOP``; a structure whose full expansion (shared references counted at their full size)
    holds more than ``limits.max_pickle_nodes`` nodes or more bytes than the read budget (``budget.total``, or the
    budget of a file of ``len(data)`` bytes); dict keys and set members that nest or expand too far to hash, or
    too many tuple keys; integers wider than 64 bits.

    Returns:
        The number of opcodes.
    """
    limits = limits or ReadLimits.from_env()
    total = budget.total if budget is not None else limits.budget_for(len(data), path).total
    note = (
        f" ({limits.budget_factor:g} x file size + {_mib(limits.budget_floor)}; raise LENS_READ_BUDGET_FACTOR only for a "
        "file you trust)"
    )
    try:
        return scan_pickle_stream(
            data,
            path,
            what,
            max_opcodes=limits.max_pickle_opcodes,
            max_nodes=limits.max_pickle_nodes,
            max_bytes=total,
            budget_note=note,
        )
    except PickleRefused as err:
        raise BoundedReadError(str(err)) from None


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 100
_REPR.maxlevel = 3


def short_repr(value: Any, limit: int = 120) -> str:
    """A bounded ``repr`` for messages about hostile values: no recursion limit, no megabyte strings."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a stand-in whose repr fails
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_zip_member(zf: zipfile.ZipFile, name: str, budget: ReadBudget, what: str) -> bytes:
    """One member of a zip archive, its declared size charged to ``budget`` before it is inflated."""
    info = zf.getinfo(name)
    budget.charge(info.file_size, f"{what} (zip member {name!r}, {info.file_size:,} bytes once inflated)")
    with zf.open(info) as f:
        # zipfile stops inflating at the declared size and checks the CRC, so a lying header cannot exceed it.
        return f.read(info.file_size + 1)


def _entry(name: str) -> str:
    """A zip entry's name for a message: the name itself when it is short and plain, else a placeholder."""
    return repr(name) if len(name) <= 80 and name.isprintable() else f"<an entry name of {len(name):,} characters>"


def check_zip(
    zf: zipfile.ZipFile, path: str, file_bytes: int, limits: ReadLimits, what: str, stored_only: bool, raw: Any = None
) -> None:
    """The central directory of a zip, checked before any member is read.

    Member count at most ``limits.max_zip_members``; names unique; every member's bytes (its local header, name,
    extra field and data) inside the file, before the central directory, and disjoint from every other member's,
    so that the sizes sum to at most the file: 1,000 entries pointing at one 1.5 MiB member would otherwise
    make ``torch.load`` allocate 1.5 GiB from a 1.8 MB file. For archives ``torch.save`` writes
    (``stored_only``), members must be stored uncompressed and no larger than the file. ``raw`` is the
    archive's bytes or seekable file object (default: the one ``zf`` reads).
    """
    infos = zf.infolist()
    if len(infos) > limits.max_zip_members:
        raise BoundedReadError(
            f"{path}: the {what} holds {len(infos):,} zip members, more than {limits.max_zip_members:,}."
        )
    if raw is None:
        raw = zf.fp
    if isinstance(raw, (bytes, bytearray, memoryview)):
        view = memoryview(raw)

        def head_at(off: int) -> bytes:
            return bytes(view[off : off + 30])
    else:

        def head_at(off: int) -> bytes:
            raw.seek(off)
            return raw.read(30)

    start_dir = getattr(zf, "start_dir", None)
    end_of_data = start_dir if isinstance(start_dir, int) and 0 <= start_dir <= file_bytes else file_bytes
    seen: set = set()
    spans = []
    total = 0
    for info in infos:
        name = info.filename
        if name in seen:
            raise BoundedReadError(
                f"{path}: zip entry {_entry(name)} of the {what} appears twice in its central directory; "
                "refused (an alias reads one member's bytes twice)."
            )
        seen.add(name)
        if stored_only:
            if info.compress_type != zipfile.ZIP_STORED:
                raise BoundedReadError(
                    f"{path}: member {_entry(name)} of the {what} is compressed (method {info.compress_type}); torch.save "
                    "stores members uncompressed, and a compressed one could inflate far beyond the file."
                )
            if info.file_size > file_bytes:
                raise BoundedReadError(
                    f"{path}: member {_entry(name)} of the {what} declares {info.file_size:,} bytes, "
                    f"more than the whole file ({file_bytes:,})."
                )
        off = int(info.header_offset)
        head = head_at(off) if 0 <= off <= end_of_data - 30 else b""
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise BoundedReadError(
                f"{path}: zip entry {_entry(name)} of the {what} points at byte {off:,}, where no member begins."
            )
        n_name = int.from_bytes(head[26:28], "little")
        n_extra = int.from_bytes(head[28:30], "little")
        end = off + 30 + n_name + n_extra + int(info.compress_size)
        if end > end_of_data:
            raise BoundedReadError(
                f"{path}: zip entry {_entry(name)} of the {what} declares {int(info.compress_size):,} bytes "
                f"at byte {off:,}, past the end of the members (byte {end_of_data:,})."
            )
        total += end - off
        spans.append((off, end, name))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise BoundedReadError(
                f"{path}: zip entry {_entry(bn)} of the {what} overlaps entry {_entry(an)} (bytes "
                f"{b0:,}-{b1:,} and {a0:,}-{a1:,}); refused (an alias reads the same bytes as two members)."
            )
    if total > file_bytes:  # disjoint spans inside the file cannot exceed it; kept as the invariant the loaders rely on
        raise BoundedReadError(
            f"{path}: the zip entries of the {what} declare {total:,} bytes, more than the file holds ({file_bytes:,})."
        )


def check_tensor_views(
    obj: Any, path: str, budget: ReadBudget, what: str = "checkpoint", max_visits: Optional[int] = None
) -> int:
    """Refuse tensors that view more elements than their storage holds (stride 0 included); count them.

    A stride-0 view of shape ``(14, 2**24)`` over one element costs nothing until someone copies it; the
    first copy allocates gigabytes. Every tensor's ``numel × element size`` is charged to ``budget``.

    The walk visits each container and tensor once (by identity), so a structure that shares sub-structures (a
    DAG of 50 levels, whose tree has 2**50 paths) costs its distinct objects, at most ``max_visits`` of them
    (default ``budget.limits.max_pickle_nodes``); a tensor referenced twice is checked and charged once.
    Containers may nest at most 64 deep.
    """
    import torch

    limit = budget.limits.max_pickle_nodes if max_visits is None else max_visits
    seen: set = set()
    todo = [(obj, 0)]
    n = visits = 0
    while todo:
        o, depth = todo.pop()
        if o is None or isinstance(o, (str, bytes, int, float)):
            continue
        if id(o) in seen:
            continue
        seen.add(id(o))
        visits += 1
        if visits > limit:
            raise BoundedReadError(
                f"{path}: the {what} holds more than {limit:,} distinct containers and tensors; refused (a "
                "walk of it would not end in reasonable time)."
            )
        if depth > 64:
            raise BoundedReadError(f"{path}: the {what} nests containers more than 64 deep.")
        if isinstance(o, torch.Tensor):
            sizes, strides = tuple(o.shape), tuple(o.stride())
            if any(st == 0 and sz > 1 for sz, st in zip(sizes, strides)):
                raise BoundedReadError(
                    f"{path}: a tensor of the {what} has shape {list(sizes)} with stride {list(strides)}: "
                    "stride 0 repeats one element; refused, since a copy of it would allocate memory the "
                    "file does not hold."
                )
            need = o.numel() * o.element_size()
            have = o.untyped_storage().nbytes()
            if need > have:
                raise BoundedReadError(
                    f"{path}: a tensor of the {what} of shape {list(sizes)} views {need:,} bytes of a storage "
                    f"that holds {have:,}; refused (overlapping strides)."
                )
            budget.charge(need, f"a tensor of the {what} of shape {list(sizes)}")
            n += 1
        elif isinstance(o, Mapping):
            todo.extend((v, depth + 1) for v in o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend((v, depth + 1) for v in o)
    return n


def load_torch_checkpoint(
    path: PathLike, limits: Optional[ReadLimits] = None, what: str = "checkpoint", root: Optional[PathLike] = None
) -> Any:
    """``torch.load(..., weights_only=True)`` of a file, bounded and checked before and after.

    Before: a regular file under the size cap (:func:`open_regular_file`); a ``torch.save`` zip archive (the
    legacy pre-1.6 stream is refused) whose members are stored uncompressed and no larger than the file; its
    ``data.pkl`` passes :func:`scan_pickle`. Checks and load read the one descriptor opened and checked, so the
    file cannot be swapped in between, and the weights are not held in memory twice. After:
    :func:`check_tensor_views` on everything loaded. Any failure is a :class:`BoundedReadError` naming the file.
    """
    import torch

    limits = limits or ReadLimits.from_env()
    shown = os.fspath(path)
    fd, size = open_regular_file(shown, limits, what, root)
    with os.fdopen(fd, "rb") as f:
        budget = limits.budget_for(size, shown)
        if f.read(4) != b"PK\x03\x04":
            raise BoundedReadError(
                f"{shown}: the {what} is not a torch.save zip archive (it does not start with a zip header); "
                "legacy torch.save streams and other formats are not read."
            )
        f.seek(0)
        try:
            with zipfile.ZipFile(f) as zf:
                check_zip(zf, shown, size, limits, what, stored_only=True, raw=f)
                pkls = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                if len(pkls) != 1:
                    raise BoundedReadError(f"{shown}: the {what} holds {len(pkls)} data.pkl members, expected 1.")
                scan_pickle(read_zip_member(zf, pkls[0], budget, what), shown, limits, f"{what}'s data.pkl", budget)
        except BoundedReadError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, KeyError) as err:
            raise BoundedReadError(f"{shown}: the {what} is not a readable zip archive ({_one_line(err)}).") from None
        f.seek(0)
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refusals, corrupt records, bad persistent ids: one message
            raise BoundedReadError(
                f"{shown}: the {what} cannot be loaded with weights_only=True ({type(err).__name__}: {_one_line(err)})."
            ) from None
    check_tensor_views(obj, shown, budget, what)
    return obj
