"""Every YAML in cli_configs/ parses and instantiates with LightningCLI; the demo config runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "cli_configs").glob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS, "cli_configs/ holds no YAML"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_parses_and_instantiates(config, monkeypatch, tmp_path):
    from lens_callbacks.cli import cli_main

    # The configs name installed class paths (lens_callbacks.examples...): they resolve from any directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lens-callbacks"])  # LightningCLI reads args=, not pytest's argv
    cli = cli_main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.model is not None and cli.trainer is not None
    names = [type(cb).__name__ for cb in cli.trainer.callbacks]
    text = config.read_text()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("- class_path: lens_callbacks.callbacks."):
            assert line.rsplit(".", 1)[1] in names


def test_grpo_credit_yaml_wires_the_callback_and_a_tensorboard_logger(monkeypatch, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from lens_callbacks.callbacks import CreditAuditCallback
    from lens_callbacks.cli import cli_main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lens-callbacks"])
    cli = cli_main(["--config", str(ROOT / "cli_configs" / "grpo_credit.yaml")], run=False)
    audits = [cb for cb in cli.trainer.callbacks if isinstance(cb, CreditAuditCallback)]
    assert len(audits) == 1 and audits[0].partition == "by_rollout"
    assert audits[0].extra_partitions == ["by_advantage_sign", "by_reward", "by_source"]
    assert not audits[0].log_positional_parts
    assert any(isinstance(lg, TensorBoardLogger) for lg in cli.trainer.loggers)
    assert type(cli.model).__name__ == "GRPOModule" and cli.model.hparams.optimizer == "adam"


@pytest.mark.slow
def test_demo_config_runs_end_to_end(tmp_path, run_cli):
    r = run_cli(
        "fit",
        "--config",
        ROOT / "cli_configs" / "grpo_credit.yaml",
        "--trainer.max_steps=3",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
        check=True,
    )
    version = tmp_path / "runs" / "grpo_credit" / "version_0"
    last = (version / "credit_last.txt").read_text()
    assert last.startswith("step 2\n") and "credit by by_rollout" in last
    assert "credit audit, step 2\n" in r.stdout and f"tensorboard --logdir {version}" in r.stdout
    assert any(p.name.startswith("events.out.tfevents") for p in version.iterdir())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(version), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    # By default no positional per-rollout scalar: rollout_k is another rollout at every step.
    assert not [t for t in scalars if "/rollout_" in t], sorted(t for t in scalars if "/rollout_" in t)
    for tag in (
        "credit/concentration/effective_parts_norm",
        "credit/concentration/top1_share",
        "credit/concentration/negative_fraction",
        "credit/concentration/gini_norm",
        "credit/noise/b_simple_ema",
        "credit/by_advantage_sign/projected_share/positive",
        "credit/by_advantage_sign/projected_share/negative",
        "credit/by_source/projected_share/carry",
        "credit/ledger/gradient/by_advantage_sign/positive",
        "credit/ledger/gradient/by_source/no_carry",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    images = set(acc.Tags()["images"])
    assert {"credit/concentration/lorenz", "credit/ledger/gradient/by_source"} <= images, sorted(images)
    # The docs' figures are drawn from such a run by one script.
    figs = tmp_path / "figures"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readings_figures.py"), "--run-dir", str(version), "--out", str(figs)],
        check=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
    )
    assert {p.name for p in figs.iterdir()} == {
        "concentration.png",
        "advantage_split.png",
        "noise_scale.png",
        "ledger.png",
        "lorenz.png",
    }


def test_every_picture_in_the_docs_exists():
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            assert (page.parent / link).is_file(), (page.name, link)
