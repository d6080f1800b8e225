"""A worked example in the docs prints what the docs say it prints.

Each ``<!-- worked: NAME ... -->`` mark in docs/*.md is followed by a Python block and, after the word
"prints", a text block: the Python block is run (float64 throughout, so kernels on any CPU agree to far
more than the digits shown) and its standard output must be the text block, line for line.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!-- worked: (.+?) -->\n+```python\n(.*?)\n```\n+prints\n+```text\n(.*?)\n```", re.S)


def _examples():
    for page in sorted((ROOT / "docs").glob("*.md")):
        for m in MARK.finditer(page.read_text()):
            yield pytest.param(m.group(2), m.group(3), id=f"{page.name}:{m.group(1).split(' (')[0]}")


EXAMPLES = list(_examples())


def test_the_docs_have_worked_examples():
    assert EXAMPLES, "no <!-- worked: ... --> example found in docs/"


@pytest.mark.parametrize("code, printed", EXAMPLES)
def test_a_worked_example_prints_what_the_docs_show(code, printed, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<worked example>", "exec"), {"__name__": "__worked__"})
    assert out.getvalue().rstrip().splitlines() == printed.rstrip().splitlines()
