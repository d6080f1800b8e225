"""Every documented option table and docstring ``Args:`` list matches the signature it documents.

A page documents a class's options with a marker line before its table:

    <!-- options: lens_callbacks.CreditAuditCallback -->
    | argument | default | meaning |
    |---|---|---|
    | `partition` | `"by_rollout"` | ... |

Each row must name a parameter of the class, its default must equal the signature's, and every
parameter must have a row. A public callback's ``Args:`` section must list exactly its parameters.
Docs drift from code one option at a time; this catches the first one.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import lens_callbacks
from lens_callbacks.integrations import trl

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*options:\s*([\w.]+)\s*-->\s*$")
ROW = re.compile(r"^\|\s*`(\w+)`\s*\|\s*`([^`]*)`\s*\|")
CALLBACKS = [
    lens_callbacks.CreditAuditCallback,
    lens_callbacks.ConservationCheckCallback,
    lens_callbacks.ProbeCreditCallback,
    lens_callbacks.ProcessRewardCallback,
    lens_callbacks.RunRecordCallback,
    lens_callbacks.AnchorProjectionCallback,
    trl.LensTRLCallback,
]


def option_tables(page: Path) -> list[tuple[int, str, dict[str, str]]]:
    """(line of the marker, class path, {option: default as written}) for every marked table of a page."""
    lines = page.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        rows: dict[str, str] = {}
        j = i + 1
        while j < len(lines) and not lines[j].startswith("|"):
            j += 1
        while j < len(lines) and lines[j].startswith("|"):
            r = ROW.match(lines[j])
            if r:
                rows[r.group(1)] = r.group(2)
            j += 1
        out.append((i + 1, m.group(1), rows))
    return out


def _params(cls: type) -> dict[str, inspect.Parameter]:
    return {
        n: p
        for n, p in inspect.signature(cls).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "self"
    }


def table_problems(where: str, cls_path: str, rows: dict[str, str]) -> list[str]:
    mod, _, name = cls_path.rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    params = _params(cls)
    problems = [f"{where}: `{n}` is not a parameter of {name}" for n in rows if n not in params]
    problems += [f"{where}: {name}'s `{n}` has no row" for n in params if n not in rows]
    for n, written in rows.items():
        if n not in params or params[n].default is inspect.Parameter.empty:
            continue
        try:
            value = ast.literal_eval(written)
        except (ValueError, SyntaxError):
            problems.append(f"{where}: `{n}`'s default `{written}` is not a Python literal")
            continue
        if value != params[n].default or type(value) is not type(params[n].default):
            problems.append(f"{where}: `{n}` defaults to {params[n].default!r} in {name}, the table says `{written}`")
    return problems


def args_problems(cls: type) -> list[str]:
    doc = inspect.getdoc(cls) or ""
    if "Args:" not in doc:
        return [f"{cls.__name__}'s docstring has no Args: section"]
    block = []
    for line in doc.split("Args:", 1)[1].splitlines()[1:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section (``Example:``, prose) starts at the left margin
        block.append(line)
    text = "\n".join(block)
    listed = {n for names in re.findall(r"^ {4}(\w+(?:, \w+)*):", text, flags=re.M) for n in names.split(", ")}
    listed |= set(re.findall(r"^ {4}\w+:.*?\.\s+(\w+):", text, flags=re.M))  # "prefix: ... conservation_prefix: ..."
    params = set(_params(cls))
    return [f"{cls.__name__}'s Args: lists `{n}`, which it does not take" for n in sorted(listed - params)] + [
        f"{cls.__name__}'s Args: leaves out `{n}`" for n in sorted(params - listed)
    ]


TABLES = [(p, line, cls, rows) for p in PAGES for line, cls, rows in option_tables(p)]


def test_the_callback_pages_mark_their_option_tables():
    assert {cls for _, _, cls, _ in TABLES} >= {"lens_callbacks.CreditAuditCallback"}, TABLES


@pytest.mark.parametrize("page,line,cls,rows", TABLES, ids=[f"{p.name}:{line}" for p, line, _, _ in TABLES])
def test_an_option_table_matches_the_signature(page, line, cls, rows):
    problems = table_problems(f"{page.relative_to(ROOT)}:{line}", cls, rows)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_a_callback_docstring_lists_exactly_its_arguments(cls):
    problems = args_problems(cls)
    assert not problems, "\n".join(problems)


def test_a_planted_mismatch_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- options: lens_callbacks.ProcessRewardCallback -->\n\n| argument | default | meaning |\n|---|---|---|\n"
        '| `every_n_steps` | `2` | wrong default |\n| `log_prefix` | `"process/"` | right |\n| `bogus` | `1` | no such |\n'
    )
    [(line, cls, rows)] = option_tables(page)
    problems = "\n".join(table_problems(f"page.md:{line}", cls, rows))
    assert "`every_n_steps` defaults to 1" in problems
    assert "`bogus` is not a parameter" in problems
    assert "`log_text_every_n_steps` has no row" in problems

    class Documented:
        """A class.

        Args:
            a: the first.
            c: a name it does not take.
        """

        def __init__(self, a: int = 1, b: int = 2) -> None: ...

    found = "\n".join(args_problems(Documented))
    assert "lists `c`" in found and "leaves out `b`" in found
