"""Importing the package never imports an optional training framework; the TRL adapter names its versions."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


def test_importing_lens_callbacks_loads_no_trl():
    code = (
        "import sys, lens_callbacks, lens_callbacks.integrations, lens_callbacks.credit, lens_callbacks.callbacks;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trl', 'peft')))"
    )
    assert _modules_after(code) == "[]"


def test_an_unsupported_trl_version_is_a_clear_import_error():
    # A stand-in `trl` module of another version, placed first on the path.
    code = (
        "import sys, types; fake = types.ModuleType('trl'); fake.__version__ = '0.9.0'; sys.modules['trl'] = fake\n"
        "try:\n"
        "    import lens_callbacks.integrations.trl\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = _modules_after(code)
    assert "supports trl >= 1.16, < 1.17, got trl 0.9.0" in out, out
    assert "pip install -e '.[trl]'" in out
