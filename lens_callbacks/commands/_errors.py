"""How every offline command reports a bad input: one line on stderr, exit status 2.

A file shared by someone else, a typo in an argument or a value out of range is the user's to fix, so it
is a message naming the file and field, never a traceback. ``--debug`` (on every command) prints the
traceback as well, for bug reports. A reading that cannot be made is a :class:`~lens_callbacks.refusal.Refusal`
and keeps its own exit status (3).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

__all__ = [
    "OneLineArgumentParser",
    "one_line",
    "report_error",
    "add_debug_flag",
    "print_safely",
    "shown_path",
    "EXIT_BAD_INPUT",
    "EXIT_REFUSED",
]

EXIT_BAD_INPUT = 2
EXIT_REFUSED = 3

_LIMIT = 1000
#: A word (a path, an import path) longer than this is shown by its head and its tail, which keeps a file's name.
_LONG_WORD = 240


def escaped(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on (ANSI escapes, other control characters, the
    undecodable bytes of a file name) written as an escape, so that a file's name can neither move the cursor nor
    forge a line of the report."""
    out = []
    for ch in str(text):
        if ch.isprintable() or ch == " " or (keep_newlines and ch == "\n"):
            out.append(ch)
        else:
            out.append(
                ch.encode("unicode_escape", "backslashreplace").decode("ascii")
                if 0xD800 <= ord(ch) <= 0xDFFF or ord(ch) < 0x100
                else f"\\u{ord(ch):04x}"
            )
    return "".join(out)


def shown_path(path: object) -> str:
    """A path as a message shows it: escaped (:func:`escaped`), and a very long one by its head and its tail."""
    return _short_word(escaped(os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)))


def _short_word(word: str) -> str:
    return word if len(word) <= _LONG_WORD else f"{word[:60]}...({len(word) - 230:,} characters)...{word[-170:]}"


def one_line(text: str, limit: int = _LIMIT) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed, control characters escaped, very long
    words (paths) cut in their middle, and the whole cut to ``limit`` characters."""
    flat = " ".join(_short_word(w) for w in escaped(" ".join(str(text).split())).split(" "))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def print_safely(text: str) -> None:
    """Print a report to stdout whatever the terminal's encoding: escaped, and what the encoding cannot write
    (a file name's undecodable bytes under a strict locale) as backslash escapes."""
    body = escaped(text, keep_newlines=True) + "\n"
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        sys.stdout.write(body)
    except UnicodeEncodeError:
        sys.stdout.write(body.encode(enc, "backslashreplace").decode(enc, "replace"))
    sys.stdout.flush()


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``prog: error: …; see --help``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(one_line(f"{self.prog}: error: {message}; see {self.prog} --help") + "\n")
        raise SystemExit(EXIT_BAD_INPUT)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug", action="store_true", help="on a bad input, also print the traceback (for bug reports)"
    )


def report_error(prog: str, err: BaseException, debug: bool = False) -> int:
    """Print ``err`` as one line on stderr (after its traceback when ``debug``); return exit status 2."""
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    text = str(err) or type(err).__name__
    # Errors raised by this package say what is wrong; anything else is named by its type, so the line stays useful.
    plain = _ours(err) or (type(err).__module__ == "builtins" and isinstance(err, (ValueError, OSError)))
    if not plain:
        text = f"{type(err).__name__}: {text}"
    line = one_line(f"{prog}: {text}") + "\n"
    try:
        sys.stderr.write(line)
    except UnicodeEncodeError:  # a strict locale: the line as escapes, never an error about the error
        enc = getattr(sys.stderr, "encoding", None) or "ascii"
        sys.stderr.write(line.encode(enc, "backslashreplace").decode(enc, "replace"))
    sys.stderr.flush()
    return EXIT_BAD_INPUT


def _ours(err: BaseException) -> bool:
    return type(err).__module__.startswith("lens_callbacks")
