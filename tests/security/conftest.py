"""Warm workers that run each hostile case through the real console script, in a forked child of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]

if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):  # the worker forks and reads /proc (Linux)
    collect_ignore_glob = ["test_*.py"]
HERE = Path(__file__).resolve().parent

#: What the offline commands that read dumps and checkpoints import: a worker with these is as heavy as a
#: real `lens-callbacks skyrl` process, so its children's peak memory is the command's.
LIGHT = [
    "lens_callbacks.cli",
    "lens_callbacks.commands.skyrl",
    "lens_callbacks.commands.process",
    "lens_callbacks.commands.anchor_gate",
    "lens_callbacks.io.skyrl",
    "lens_callbacks.process",
]
#: `audit` also builds the recorded module (transformers, lightning).
HEAVY = LIGHT + [
    "lens_callbacks.commands.audit",
    "lens_callbacks.examples.grpo_tools.module",
    "lens_callbacks.examples.grpo_tools.single_turn",
]


class Worker:
    """A process that imported the package once and forks a child per case (see isolated.py)."""

    def __init__(self, modules: list[str]) -> None:
        env = dict(
            os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "isolated.py"), *modules],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        ready = self.proc.stdout.readline()
        assert json.loads(ready) == {"ready": True}, ready

    def run(self, *argv: str, timeout: float = 30, mem_mb: int = 1024, cwd=None, env=None) -> SimpleNamespace:
        case = {
            "argv": [str(a) for a in argv],
            "timeout": timeout,
            "mem_mb": mem_mb,
            "cwd": str(cwd or ROOT),
            "env": env or {},
        }
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        return SimpleNamespace(**json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def light():
    w = Worker(LIGHT)
    yield w
    w.close()


#: The offline commands of the second-round families (audit before it builds a module, anchor-arms' config reader).
FAMILIES = LIGHT + [
    "lens_callbacks.commands.audit",
    "lens_callbacks.commands.anchor_arms",
    "lens_callbacks.io.config",
    "yaml",
]


@pytest.fixture(scope="session")
def families_worker():
    w = Worker(FAMILIES)
    yield w
    w.close()


@pytest.fixture(scope="session")
def heavy():
    w = Worker(HEAVY)
    yield w
    w.close()


@pytest.fixture(scope="session")
def record(tmp_path_factory) -> Path:
    """A clean run record from a real two-step training run of the tools example (RunRecordCallback)."""
    pytest.importorskip("transformers")
    import torch
    from lightning.pytorch import Trainer

    from lens_callbacks.callbacks.records import RunRecordCallback
    from lens_callbacks.examples.grpo_tools import GRPOToolsModule, ToolsAdditionDataModule

    d = tmp_path_factory.mktemp("clean")
    torch.manual_seed(0)
    trainer = Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(d),
        callbacks=[RunRecordCallback(str(d / "record"))],
    )
    trainer.fit(GRPOToolsModule(seed=0, group_size=2), ToolsAdditionDataModule(prompts_per_step=1))
    return d / "record"
