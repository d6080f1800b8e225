"""The one place every callback puts its readings into the Trainer's loggers.

Scalars go straight to ``trainer.loggers`` at the step they describe, from rank 0 only. Not through
``LightningModule.log``: its results collection re-logs a key's last value on every later step of
the epoch, which would put stale readings on steps a callback skipped. Text and figures go to every
logger whose ``experiment`` has ``add_text``/``add_figure`` (TensorBoard's SummaryWriter, and loggers
shaped like it). A logging failure is swallowed: it never stops a training run.

Nothing here is a collective, so a call made on rank 0 alone cannot deadlock.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping, Optional

__all__ = ["log_scalars", "log_text", "log_figure", "log_dir", "tensorboard_dir"]


def _is_rank_zero(trainer: Any) -> bool:
    return int(getattr(trainer, "global_rank", 0)) == 0


def _experiments(trainer: Any, method: str):
    for logger in getattr(trainer, "loggers", None) or ():
        fn = getattr(getattr(logger, "experiment", None), method, None)
        if callable(fn):
            yield fn


def log_scalars(trainer: Any, values: Mapping[str, float], step: int) -> None:
    """``values`` (name -> float) at ``step``, to every logger, from rank 0."""
    if not values or not _is_rank_zero(trainer):
        return
    for logger in getattr(trainer, "loggers", None) or ():
        with contextlib.suppress(Exception):
            logger.log_metrics(dict(values), step=step)


def log_text(trainer: Any, tag: str, text: str, step: int) -> None:
    """``text`` as a preformatted block (TensorBoard renders text as markdown)."""
    if not _is_rank_zero(trainer):
        return
    body = "```\n" + text + "\n```"
    for add_text in _experiments(trainer, "add_text"):
        with contextlib.suppress(Exception):
            add_text(tag, body, global_step=step)


def log_figure(trainer: Any, tag: str, figure: Any, step: int) -> None:
    """A matplotlib figure; closed afterwards. ``figure`` may be None (no matplotlib): nothing is logged."""
    if figure is None:
        return
    try:
        if _is_rank_zero(trainer):
            for add_figure in _experiments(trainer, "add_figure"):
                with contextlib.suppress(Exception):
                    add_figure(tag, figure, global_step=step, close=False)
    finally:
        with contextlib.suppress(Exception):
            import matplotlib.pyplot as plt

            plt.close(figure)


def log_dir(trainer: Any) -> Optional[str]:
    """The first logger's directory; None without a logger (never write into the cwd).

    Not ``trainer.log_dir``: that is a broadcast, a collective that deadlocks when only rank 0 asks.
    """
    for logger in getattr(trainer, "loggers", None) or ():
        d = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        if d:
            return str(d)
    return None


def tensorboard_dir(trainer: Any) -> Optional[str]:
    """The directory to hand ``tensorboard --logdir``: the first logger that writes event files."""
    for logger in getattr(trainer, "loggers", None) or ():
        if callable(getattr(getattr(logger, "experiment", None), "add_scalar", None)):
            d = getattr(logger, "log_dir", None)
            if d:
                # Absolute, so that the printed ``tensorboard --logdir`` line works from any directory.
                return os.path.abspath(str(d))
    return None
