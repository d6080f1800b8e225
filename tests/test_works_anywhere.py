"""The console script and every shipped config work from any directory, as after the README's install.

The subprocesses run in a fresh temporary directory, with the checkout on the path as an editable install
puts the package there: nothing resolves because the working directory happens to be the repository root.
A config naming a module that sits at the checkout's root (as ``examples.`` did, which only the root on the
path made importable) is caught by ``test_configs_name_only_installed_modules``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lens_callbacks.cli import OFFLINE_COMMANDS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "cli_configs").glob("*.yaml"))
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def _run(args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lens_callbacks", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_offline_commands_beside_lightnings(tmp_path):
    r = _run(["--help"], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    usage = r.stdout.splitlines()[0]
    assert usage.startswith("usage: lens-callbacks "), usage
    for name in (*LIGHTNING_COMMANDS, *OFFLINE_COMMANDS):
        assert name in usage, (name, usage)
    lines = r.stdout.splitlines()
    for name in OFFLINE_COMMANDS:
        line = [ln for ln in lines if ln.split()[:1] == [name]]
        assert len(line) == 1 and len(line[0].split()) > 3, (name, r.stdout[-1500:])  # one line, with words
    assert "No module named" not in r.stderr, r.stderr


def _named_paths(node):
    """Every import path a LightningCLI config names (class_path, and the record's batch_builder)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("class_path", "batch_builder") and isinstance(v, str):
                yield v
            else:
                yield from _named_paths(v)
    elif isinstance(node, list):
        for v in node:
            yield from _named_paths(v)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_configs_name_only_installed_modules(config):
    """A class path whose package sits at the checkout's root (as `examples.` did) resolves only from there."""
    paths = list(_named_paths(yaml.safe_load(config.read_text())))
    assert paths, config.name
    for path in paths:
        top = path.split(".", 1)[0]
        spec = importlib.util.find_spec(top)
        assert spec is not None, f"{config.name}: {path!r} names a package that is not installed"
        # The directory the top-level package sits in (site-packages, or the checkout for this package).
        home = (
            (
                Path(next(iter(spec.submodule_search_locations)))
                if spec.submodule_search_locations
                else Path(spec.origin)
            )
            .resolve()
            .parent
        )
        assert home != ROOT or top == "lens_callbacks", (
            f"{config.name}: {path!r} resolves only because the checkout's root is on the path ({home / top}); "
            "name an installed module (the examples are lens_callbacks.examples)"
        )


# One interpreter fits every single-process config in turn (imports paid once); the DDP config launches its
# ranks itself, so it runs through the console script alone.
_DRIVER = """
import os, sys
from lens_callbacks.cli import cli_main
for cfg in sys.argv[1:]:
    d = os.path.join(os.getcwd(), os.path.basename(cfg))
    os.makedirs(d)
    os.chdir(d)
    sys.argv = ["lens-callbacks"]
    cli_main(["fit", "--config", cfg, *FLAGS])
    os.chdir("..")
    print("fitted", cfg, flush=True)
"""
_FLAGS = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]
_DDP = [c for c in CONFIGS if "powersgd" in c.name]


def _check_runs(name: str, where: Path) -> None:
    runs = where / "runs"
    assert runs.is_dir() and any(runs.rglob("events.out.tfevents.*")), (name, sorted(map(str, where.rglob("*")))[:20])


@pytest.mark.slow
def test_every_single_process_config_fits_from_another_directory(tmp_path):
    configs = [c.resolve() for c in CONFIGS if c not in _DDP]
    code = _DRIVER.replace("FLAGS", repr(_FLAGS))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, configs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"from {tmp_path}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    for c in configs:
        assert f"fitted {c}" in r.stdout, (c.name, r.stdout[-1500:])
        _check_runs(c.name, tmp_path / c.name)
    # The printed tensorboard line is absolute: it works from wherever the user is next.
    version = (tmp_path / "grpo_credit.yaml" / "runs" / "grpo_credit" / "version_0").resolve()
    assert f"tensorboard --logdir {version}\n" in r.stdout, r.stdout[-1500:]
    assert (version / "credit_last.txt").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("config", _DDP, ids=[c.name for c in _DDP])
def test_the_ddp_config_fits_from_another_directory_through_the_console_script(config, tmp_path):
    r = _run(["fit", "--config", config.resolve(), *_FLAGS], tmp_path)
    assert r.returncode == 0, f"{config.name} from {tmp_path}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    _check_runs(config.name, tmp_path)
