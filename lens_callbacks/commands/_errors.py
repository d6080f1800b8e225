"""How every offline command reports a bad input: one line on stderr, exit status 2.

A file shared by someone else, a typo in an argument or a value out of range is the user's to fix, so it
is a message naming the file and field, never a traceback. ``--debug`` (on every command) prints the
traceback as well, for bug reports. A reading that cannot be made is a :class:`~lens_callbacks.refusal.Refusal`
and keeps its own exit status (3).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn

__all__ = ["OneLineArgumentParser", "one_line", "report_error", "add_debug_flag", "EXIT_BAD_INPUT", "EXIT_REFUSED"]

EXIT_BAD_INPUT = 2
EXIT_REFUSED = 3

_LIMIT = 1000


def one_line(text: str, limit: int = _LIMIT) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed, cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``prog: error: …; see --help``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(one_line(f"{self.prog}: error: {message}; see {self.prog} --help") + "\n")
        raise SystemExit(EXIT_BAD_INPUT)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="on a bad input, also print the traceback (for bug reports)")


def report_error(prog: str, err: BaseException, debug: bool = False) -> int:
    """Print ``err`` as one line on stderr (after its traceback when ``debug``); return exit status 2."""
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    text = str(err) or type(err).__name__
    # Errors raised by this package say what is wrong; anything else is named by its type, so the line stays useful.
    plain = _ours(err) or (type(err).__module__ == "builtins" and isinstance(err, (ValueError, OSError)))
    if not plain:
        text = f"{type(err).__name__}: {text}"
    sys.stderr.write(one_line(f"{prog}: {text}") + "\n")
    sys.stderr.flush()
    return EXIT_BAD_INPUT


def _ours(err: BaseException) -> bool:
    return type(err).__module__.startswith("lens_callbacks")
