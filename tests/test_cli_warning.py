"""The console script hands LightningCLI its arguments one way only."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_console_script_passes_arguments_once(run_cli):
    r = run_cli("fit", "--config", ROOT / "cli_configs" / "grpo_credit.yaml", "--print_config", check=True)
    assert "class_path: lens_callbacks.callbacks.CreditAuditCallback" in r.stdout  # the config was really parsed
    assert "not recommended to provide both args and command line arguments" not in r.stdout + r.stderr
