"""The ``lens-callbacks`` console script.

``lens-callbacks fit --config cli_configs/grpo_credit.yaml`` is a plain :class:`~lightning.pytorch.cli.LightningCLI`
(``fit``/``validate``/``test``/``predict``): model, data and callbacks come from YAML by ``class_path``.
Offline subcommands (``audit``, ``process``, ``skyrl``, ``anchor-gate``, ``anchor-arms``) work on saved records,
dumps and checkpoints; ``lens-callbacks --help`` lists them beside LightningCLI's own.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
from typing import Optional, Sequence

# subcommand -> module with `main(argv) -> int`; imported only when used.
OFFLINE_COMMANDS = {
    "audit": "lens_callbacks.commands.audit",
    "process": "lens_callbacks.commands.process",
    "skyrl": "lens_callbacks.commands.skyrl",
    "anchor-gate": "lens_callbacks.commands.anchor_gate",
    "anchor-arms": "lens_callbacks.commands.anchor_arms",
}

# One line each for ``lens-callbacks --help`` (the modules are not imported to print it).
OFFLINE_HELP = {
    "audit": "Re-audit one recorded step of a run record offline (exact replay), any partition.",
    "process": "The process-reward table over every group of a run record or SkyRL dump.",
    "skyrl": "Summary of a SkyRL training-batch dump: rows, groups, keys, advantages per group.",
    "anchor-gate": "Replay saved checkpoints: the anchor projection against its baselines (the offline gate).",
    "anchor-arms": "Run a config once per arm and seed, each in its own process: the anchor's online decision.",
}


def cli_main(args: Optional[Sequence[str]] = None, run: bool = True):
    """Build the LightningCLI (``run=False`` parses and instantiates without fitting)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    # A user's own class paths in YAML (``mypkg.MyModule``) resolve from the working directory, as they do
    # under ``python -m``; the shipped configs name ``lens_callbacks.examples`` and resolve from anywhere.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=list(args) if args is not None else None,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def help_text() -> str:
    """LightningCLI's help with the offline commands added to its usage line and listed after it."""
    out = io.StringIO()
    saved = sys.argv
    # LightningCLI reads --help from sys.argv (given as ``args`` too, it warns that both were given).
    sys.argv = [saved[0] if saved else "lens-callbacks", "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli_main(None)
    finally:
        sys.argv = saved
    names = ",".join(["fit", "validate", "test", "predict", *OFFLINE_COMMANDS])
    text = out.getvalue().replace("{fit,validate,test,predict}", "{" + names + "}", 1)
    width = max(map(len, OFFLINE_COMMANDS))
    lines = [
        "",
        "offline commands (on saved records, dumps and checkpoints; `lens-callbacks COMMAND --help` for each):",
    ]
    lines += [f"    {name:<{width}}  {OFFLINE_HELP[name]}" for name in OFFLINE_COMMANDS]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def config_paths(argv: Sequence[str]) -> list[str]:
    """The files named by ``--config X``, ``--config=X`` and ``-c X`` (LightningCLI's spellings), in order."""
    paths = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg[len("--config=") :])
    return paths


def check_configs(argv: Sequence[str]) -> Optional[int]:
    """Read every ``--config`` file bounded before LightningCLI parses it (jsonargparse reads YAML unbounded:
    an alias bomb, a FIFO or a 200,000-digit number would hang it or end in a traceback). Exit status 2 and
    one line for a config that fails; ``None`` when all pass. ``class_path`` names in a config are imported,
    as LightningCLI always does: a config from someone else is code, checked here only for its size and shape."""
    from lens_callbacks.commands._errors import report_error
    from lens_callbacks.io.config import read_config_yaml

    for path in config_paths(argv):
        if path.lstrip().startswith(("{", "[")) or "\n" in path:
            continue  # an inline YAML/JSON string (jsonargparse accepts those too), not a file
        try:
            read_config_yaml(path)
        except (ValueError, OSError) as err:
            return report_error("lens-callbacks", err)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(help_text(), end="")
        return 0
    if argv and argv[0] in OFFLINE_COMMANDS:
        mod = importlib.import_module(OFFLINE_COMMANDS[argv[0]])
        return int(mod.main(argv[1:]) or 0)
    bad = check_configs(argv)
    if bad is not None:
        return bad
    # Arguments reach LightningCLI one way only: from sys.argv when they are the process's own (it reads
    # them itself), as ``args`` otherwise; both at once make it warn that one of them may be a mistake.
    cli_main(None if argv == sys.argv[1:] else argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
