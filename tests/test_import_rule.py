"""The core never imports lightning: checked on the source and on a fresh interpreter."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ["credit", "process", "anchor", "io"]
FORBIDDEN = ("lightning", "pytorch_lightning", "skyrl", "skyrl_train")


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("sub", CORE)
def test_core_sources_do_not_import_lightning(sub):
    files = sorted((ROOT / "lens_callbacks" / sub).rglob("*.py"))
    assert files, f"lens_callbacks/{sub} has no sources"
    for f in files:
        bad = _imports(f) & set(FORBIDDEN)
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_importing_core_loads_no_lightning():
    code = (
        "import sys, lens_callbacks.credit, lens_callbacks.process, lens_callbacks.anchor, lens_callbacks.io;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('lightning','pytorch_lightning','skyrl','skyrl_train')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rule_catches_a_lightning_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import torch\nfrom lightning.pytorch import Callback\n")
    assert "lightning" in _imports(f)
