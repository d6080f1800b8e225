"""Where the SkyRL dump fixtures are, for the tests of this folder (imported by name: pytest puts it on sys.path)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fixture_dir() -> Path:
    # repo_root/../shared; a git worktree may sit one level deeper, so the ancestors are tried next.
    for base in [ROOT.parent, *ROOT.parents[1:]]:
        if (base / "shared" / "fixtures" / "skyrl").is_dir():
            return base / "shared" / "fixtures" / "skyrl"
    return ROOT.parent / "shared" / "fixtures" / "skyrl"


FIX = _fixture_dir()
CURRENT = FIX / "current" / "dumped_data" / "global_step_3_training_input.pkl"
LEGACY = FIX / "legacy" / "dumped_data" / "global_step_1_training_input.pkl"
HOSTILE = FIX / "hostile" / "global_step_0_training_input.pkl"
TRUNCATED = FIX / "hostile" / "truncated.pkl"

needs_fixtures = pytest.mark.skipif(not FIX.is_dir(), reason=f"SkyRL fixtures not found at {FIX}")
