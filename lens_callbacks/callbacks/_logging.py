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
import logging
import os
import warnings
from typing import Any, Mapping, Optional

from ..refusal import ReadingWarning

__all__ = ["log_scalars", "log_text", "log_figure", "log_dir", "tensorboard_dir", "OncePerCause"]

log = logging.getLogger("lens_callbacks")


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


class OncePerCause:
    """Warnings said once per cause, not once per step, and a tally of refusals for the end of fit.

    ``warn(trainer, cause, message)`` warns (rank 0 only) the first time ``cause`` is seen;
    ``refused(trainer, refusal, step)`` counts a :class:`~lens_callbacks.refusal.Refusal` under its
    condition and warns on the first of each condition; ``summary(n)`` is the one-paragraph account of
    every refusal, said at the end of fit.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.seen: set[str] = set()
        # condition -> [count, first step, last step, first reason]
        self.refusals: dict[str, list[Any]] = {}

    def warn(self, trainer: Any, cause: str, message: str) -> bool:
        if cause in self.seen:
            return False
        self.seen.add(cause)
        if _is_rank_zero(trainer):
            # stacklevel 2: the callback line that decided to warn, not this helper or Lightning's dispatcher
            warnings.warn(f"{self.owner}: {message}", ReadingWarning, stacklevel=2)
        return True

    def refused(self, trainer: Any, refusal: Any, step: int, what: str = "step") -> None:
        entry = self.refusals.setdefault(refusal.condition, [0, step, step, refusal.reason])
        entry[0] += 1
        entry[2] = step
        if entry[0] == 1 and _is_rank_zero(trainer):
            warnings.warn(
                f"{self.owner}: {what} at step {step} declined: {refusal.render()}\nLater refusals for this reason are "
                "not repeated; they are counted and summarised at the end of fit.",
                ReadingWarning,
                stacklevel=2,
            )

    def summary(self, n_readings: int, noun: str = "audited steps") -> Optional[str]:
        """``None`` when nothing was refused; else the counts per reason, first and last step of each."""
        if not self.refusals:
            return None
        total = sum(e[0] for e in self.refusals.values())
        lines = [f"{self.owner}: {total} reading(s) declined over {n_readings} {noun}:"]
        for cond, (count, first, last, reason) in sorted(self.refusals.items(), key=lambda kv: -kv[1][0]):
            where = f"step {first}" if first == last else f"steps {first}..{last}"
            lines.append(f"  {cond}: {count} ({where}); first reason: {reason}")
        return "\n".join(lines)

    def say_summary(
        self, trainer: Any, n_readings: int, tag: str, step: int, noun: str = "audited steps"
    ) -> Optional[str]:
        """Log the summary as text under ``tag`` and once to the ``lens_callbacks`` logger (rank 0)."""
        text = self.summary(n_readings, noun)
        if text is None or not _is_rank_zero(trainer):
            return text
        log.warning(text)
        log_text(trainer, tag, text, step)
        return text

    def state_dict(self) -> dict[str, Any]:
        return {"seen": sorted(self.seen), "refusals": {k: list(v) for k, v in self.refusals.items()}}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        if not state:
            return
        self.seen = set(state.get("seen", ()))
        self.refusals = {k: list(v) for k, v in dict(state.get("refusals", {})).items()}
