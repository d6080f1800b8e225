"""Every Python and YAML snippet in README.md and docs/*.md runs (or is checked) as written.

Python blocks are compiled, checked for names used but never defined (an import left out, a class the
page never introduces), and executed in a fresh namespace from a temporary directory. A comment on the
line before a block changes that, sparingly:

- ``<!-- snippet: skip REASON -->``: compiled and name-checked, not executed (e.g. it needs a run record);
- ``<!-- snippet: given NAME, NAME -->``: the reader supplies these names (their model, their batch):
  compiled and name-checked without them, not executed;
- ``<!-- snippet: continue -->``: executed in the namespace of the page's previous Python block.

YAML blocks are parsed; every ``class_path`` must import, its ``init_args`` must be parameters of the
class, and the package's own classes are instantiated with them, so a wrong value fails here. A comment
listing choices (``dtype: float32  # float32 | float64 | ...``) is held against the code: each listed
choice is accepted, and no accepted choice of that argument is missing from the list.

Failures name the page and the line of the block (``docs/interface.md:42``).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```\s*(\w+)?\s*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(skip|given|continue)\b(.*?)-->\s*$")


@dataclass
class Snippet:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str = ""
    arg: str = ""
    previous: "Snippet | None" = field(default=None, repr=False)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def extract(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    last_python = None
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or m.group(2) is None:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).lower(), i
        body = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mk = MARKER.match(lines[j]) if j >= 0 else None
        s = Snippet(
            page, start + 1, lang, "\n".join(body) + "\n", mk.group(1) if mk else "", mk.group(2).strip() if mk else ""
        )
        if lang == "python":
            s.previous, last_python = last_python, s
        if lang in ("python", "yaml"):
            out.append(s)
    return out


SNIPPETS = [s for page in PAGES for s in extract(page)]
PY = [s for s in SNIPPETS if s.lang == "python"]
YAML = [s for s in SNIPPETS if s.lang == "yaml"]


def test_the_pages_have_snippets_and_markers_are_few():
    assert len(PY) >= 10 and len(YAML) >= 5, (len(PY), len(YAML))
    marked = [s.where for s in PY if s.marker in ("skip", "given")]
    # Fragments that need the reader's model or files exist, but a page of them checks nothing.
    assert len(marked) <= (2 * len(PY)) // 3, f"most Python snippets should run; skipped or given: {marked}"
    for s in PY:
        if s.marker == "skip":
            assert s.arg, f"{s.where}: `<!-- snippet: skip REASON -->` needs its reason"
        if s.marker == "given":
            assert s.arg, f"{s.where}: `<!-- snippet: given NAME, ... -->` needs the names"
        if s.marker == "continue":
            assert s.previous is not None, f"{s.where}: `continue` but no Python block before it on the page"


# --------------------------------------------------------------------------------------------- Python
def _bound_and_used(tree: ast.AST) -> tuple[set[str], dict[str, int]]:
    """Names bound anywhere in the snippet, and names read (first line of each); a deliberately loose scope model."""
    bound: set[str] = set()
    used: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                used.setdefault(node.id, node.lineno)
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                bound.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return bound, used


def _chain(s: Snippet) -> list[Snippet]:
    """The snippet and the blocks it continues, oldest first."""
    chain = [s]
    while chain[0].marker == "continue" and chain[0].previous is not None:
        chain.insert(0, chain[0].previous)
    return chain


@pytest.mark.parametrize("s", PY, ids=[s.where for s in PY])
def test_python_snippet(s: Snippet, tmp_path, monkeypatch):
    try:
        tree = ast.parse(s.code, filename=s.where)
    except SyntaxError as e:
        pytest.fail(f"{s.where}: the snippet does not parse (its line {e.lineno}): {e.msg}\n{s.code}")
    known = set(dir(builtins))
    for earlier in _chain(s)[:-1]:
        known |= _bound_and_used(ast.parse(earlier.code))[0]
    given = {n.strip() for n in s.arg.split(",") if n.strip()} if s.marker == "given" else set()
    bound, used = _bound_and_used(tree)
    undefined = {n: ln for n, ln in used.items() if n not in bound | known | given}
    assert not undefined, (
        f"{s.where}: the snippet uses names it never defines or imports: "
        + ", ".join(f"{n!r} (its line {ln})" for n, ln in sorted(undefined.items(), key=lambda kv: kv[1]))
        + ". Import them in the snippet, or mark the block `<!-- snippet: given NAME -->` if the reader supplies them."
    )
    if s.marker in ("skip", "given"):
        return
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    namespace: dict = {"__name__": "__doc_snippet__"}
    for block in _chain(s):
        try:
            exec(compile(block.code, block.where, "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - any failure of a documented snippet is the finding
            pytest.fail(f"{block.where}: the snippet raised {type(e).__name__}: {e}\n{block.code}")


# ----------------------------------------------------------------------------------------------- YAML
def _choices_of(cls: type, arg: str) -> "set[str] | None":
    """The values an argument of one of the package's callbacks accepts, from the code itself (None: open-ended)."""
    if arg == "partition":
        import lens_callbacks.credit  # noqa: F401  (registers by_turn and by_role)
        from lens_callbacks.credit.inputs.partition import PARTITIONS

        return set(PARTITIONS)
    if arg == "dtype":
        return {"float32", "float64", "bfloat16", "float16", "native"}  # the canonical names; aliases in the table
    if arg == "readings":
        from lens_callbacks.credit.engines import READINGS

        return set(READINGS)
    if arg == "engine":
        from lens_callbacks.credit.engines import available_engines

        return {"auto", *available_engines()}
    if arg == "capture":
        from lens_callbacks.callbacks._capture import CAPTURES

        return set(CAPTURES)
    return None


def _class_nodes(node, path="") -> list[tuple[str, dict]]:
    out = []
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            out.append((path, node))
        for k, v in node.items():
            out += _class_nodes(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _class_nodes(v, f"{path}[{i}]")
    return out


def _import(path: str):
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def _build(s: Snippet, cls: type, where: str, args: dict):
    try:
        return cls(**args)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{s.where}: {where}: {cls.__name__}(**{args!r}) raised {type(e).__name__}: {e}")


@pytest.mark.parametrize("s", YAML, ids=[s.where for s in YAML])
def test_yaml_snippet(s: Snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        doc = yaml.safe_load(s.code)
    except yaml.YAMLError as e:
        pytest.fail(f"{s.where}: the YAML does not parse: {e}")
    nodes = _class_nodes(doc)
    for where, node in nodes:
        try:
            cls = _import(node["class_path"])
        except (ImportError, AttributeError) as e:
            pytest.fail(f"{s.where}: {where}.class_path {node['class_path']!r} does not import: {e}")
        args = node.get("init_args") or {}
        params = inspect.signature(cls).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            unknown = sorted(set(args) - set(params))
            assert not unknown, f"{s.where}: {where}: {cls.__name__} takes no {unknown}; it takes {sorted(params)}"
        if node["class_path"].startswith("lens_callbacks."):
            _build(s, cls, where, args)
            _check_choice_comments(s, cls, where, args)


def _check_choice_comments(s: Snippet, cls: type, where: str, args: dict) -> None:
    for lineno, line in enumerate(s.code.splitlines(), s.line + 1):
        m = re.match(r"^\s*(\w+):\s*[^#]*#\s*(.*)$", line)
        if not m or m.group(1) not in args or "|" not in m.group(2):
            continue
        arg = m.group(1)
        listed = {c.strip().split()[0].strip("`'\"") for c in m.group(2).split("|") if c.strip()}
        names = {c for c in listed if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", c)}  # "pkg.module.function" is a pattern
        for c in sorted(names):
            _build(s, cls, f"{where} (the comment's choice {arg}={c!r}, line {lineno})", {**args, arg: c})
        accepted = _choices_of(cls, arg)
        if accepted is not None:
            missing = sorted(accepted - names)
            assert not missing, (
                f"{s.page.relative_to(ROOT)}:{lineno}: the comment lists {arg} choices {sorted(names)} but the code also "
                f"accepts {missing}"
            )


# ------------------------------------------------------------------------------------- the checker itself
def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = lens_callbacks.CreditAuditCallback()\n```\n\n"
        "<!-- snippet: given module -->\n```python\nprint(module)\n```\n"
        "  ```yaml\n  a: 1\n  ```\n"
    )
    first, second, third = extract(page)
    assert (first.line, second.line, third.line) == (3, 8, 11) and third.code == "a: 1\n"
    assert second.marker == "given" and second.arg == "module" and second.previous is first
    bound, used = _bound_and_used(ast.parse(first.code))
    assert "lens_callbacks" in used and "lens_callbacks" not in bound
    bound, used = _bound_and_used(ast.parse("import a.b as c\nfor i in c: print(i, [j for j in i])\n"))
    assert {"c", "i", "j"} <= bound and "a" not in used
