"""What one command may hold, all files together; shared folders walked without following links.

:mod:`lens_callbacks.io.safe` bounds each read; a command that reads many files (``process`` over a run
record's steps, ``anchor-gate`` over a folder of checkpoints) also keeps what it read. :class:`HeldBudget`
charges what is kept against ``ReadLimits.memory_bytes`` (``LENS_MEMORY_MB``), so the whole command stays
bounded however many files the folder holds. :func:`json_cost` bounds, before parsing, what a JSON text
becomes in memory; :func:`walk_files` lists a folder without following links to folders (a link loop ends)
and refuses links to files out of the folder by name; :func:`same_file_as` finds a file met twice through
links, so that it is read once. :func:`shown_value` describes a value from a file in a message without
quoting more of the file than a short scalar.

Pure python: no torch, no lightning here.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable, Optional

from .safe import BoundedReadError, PathLike, ReadLimits, check_inside

__all__ = ["HeldBudget", "json_cost", "walk_files", "same_file_as", "shown_value", "MAX_NAME"]

_MiB = 1 << 20

#: The longest import path, key or name a file may hold where a name is expected (checked before any regex).
MAX_NAME = 512

#: Folder entries :func:`walk_files` visits before it refuses (a folder of dumps holds a few hundred).
MAX_ENTRIES = 1_000_000


def _mib(n: float) -> str:
    return f"{n / _MiB:.1f} MiB"


class HeldBudget:
    """The bytes a command may still keep from the files it reads (``limits.memory_bytes`` in all).

    Example:
        >>> b = HeldBudget(ReadLimits(memory_bytes=1 << 20))
        >>> b.charge(1000, "f.jsonl", "line 1"); b.used
        1000
    """

    def __init__(self, limits: Optional[ReadLimits] = None) -> None:
        self.limits = limits or ReadLimits.from_env()
        self.total, self.used = int(self.limits.memory_bytes), 0

    @property
    def left(self) -> int:
        return self.total - self.used

    def check(self, nbytes: int, path: str, what: str) -> None:
        """Refuse unless ``nbytes`` more fit (a transient need: nothing is charged)."""
        if nbytes > self.left:
            raise BoundedReadError(
                f"{path}: {what} would need {_mib(nbytes)} in memory, beyond the memory budget of {_mib(self.total)} "
                f"(LENS_MEMORY_MB; {_mib(self.used)} already held from the files read before); refused. Raise "
                "LENS_MEMORY_MB only for files you trust."
            )

    def charge(self, nbytes: int, path: str, what: str) -> None:
        """Keep ``nbytes`` more, or refuse naming the file and what it held."""
        self.check(nbytes, path, what)
        self.used += int(nbytes)


def json_cost(text: str) -> int:
    """An upper bound of the bytes ``json.loads(text)`` allocates (CPython), computed before parsing.

    Every JSON value is a scalar or a container introduced after ``[``, ``{``, ``,`` or ``:`` (or is the
    whole text); none costs more than 80 bytes of object header and slot (an empty dict, the largest, is
    64 bytes plus its 8-byte slot) besides its characters, which cost at most 4 bytes each once decoded.
    """
    seps = text.count(",") + text.count(":") + text.count("[") + text.count("{") + 1
    return 80 * seps + 4 * len(text)


def shown_value(v: Any) -> str:
    """A value from a file as a message shows it: short scalars as themselves, anything else by type and size.

    A message names the file and the field; it must not become a way to print another file's content.
    """
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        if abs(v) < 10**18:
            return repr(v)
        return f"an integer of {len(str(abs(v))) if v.bit_length() < 13000 else 'over 4000'} digits"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        if len(v) <= 40 and v.isprintable():
            return repr(v)
        return f"a string of {len(v):,} characters"
    if isinstance(v, list):
        return f"a list of {len(v):,} items"
    if isinstance(v, dict):
        return f"an object of {len(v):,} fields"
    return f"a {type(v).__name__}"


def walk_files(root: PathLike, keep: Callable[[str], bool], what: str = "file") -> list[str]:
    """Paths under ``root`` whose file name passes ``keep``, sorted; links to folders are not followed.

    A link to a file is kept only if it resolves inside ``root`` (else refused by its name); a link to a
    folder is skipped (``ln -s . d/a`` would make the walk endless, ``ln -s / d/r`` walk the filesystem).
    The walk visits at most :data:`MAX_ENTRIES` entries.
    """
    root = os.fspath(root)
    out: list[str] = []
    stack, seen = [root], 0
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as err:
            raise BoundedReadError(
                f"{d}: the folder cannot be listed ({err.strerror or type(err).__name__})."
            ) from None
        seen += len(entries)
        if seen > MAX_ENTRIES:
            raise BoundedReadError(f"{root}: the folder holds more than {MAX_ENTRIES:,} entries; refused.")
        for e in entries:
            try:
                if e.is_symlink():
                    if not keep(e.name):
                        continue
                    check_inside(root, e.path, what)
                    if os.path.isdir(e.path):
                        continue
                    out.append(e.path)
                elif e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif keep(e.name):
                    out.append(e.path)
            except OSError as err:
                raise BoundedReadError(
                    f"{e.path}: cannot be examined ({err.strerror or type(err).__name__})."
                ) from None
    return sorted(out)


def same_file_as(paths: list[str]) -> dict[str, str]:
    """``{path: earlier path}`` for each path that is the same file (device and inode) as an earlier one."""
    first: dict[tuple[int, int], str] = {}
    dup: dict[str, str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue  # the reader names it when it opens it
        if not stat.S_ISREG(st.st_mode):
            continue
        key = (st.st_dev, st.st_ino)
        if key in first:
            dup[p] = first[key]
        else:
            first[key] = p
    return dup
