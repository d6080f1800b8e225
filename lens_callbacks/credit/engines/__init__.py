"""Registry of disintegration engines, and the choice ``engine="auto"`` makes.

Every engine takes ``(module, batch, partition, *, dtype, reference_grads, terms_fn, preserve_rng,
readings, ...)`` and returns a :class:`~lens_callbacks.credit.report.CreditReport`. The reference
engine (one backward pass per part) is the oracle every other engine is tested against.

- ``"reference"``: one backward per part plus an independent full one; any partition.
- ``"ghost"``: one forward and one backward for partitions whose parts are unions of whole rows
  (``by_rollout``, ``by_group``); per-layer hooks capture what gives every part's readings.
- ``"jvp"``: one forward-mode pass for within-row partitions (``by_segment``, ``by_turn``), when
  ``lens_callbacks.credit.engines.jvp`` is present.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch

from ..inputs.partition import Partition

__all__ = ["ENGINES", "READINGS", "available_engines", "get_engine", "is_row_separable", "choose_engine"]

READINGS = ("all", "shares", "projected")

# Partitions known by name to be unions of whole rows: "auto" needs no terms to pick the one-pass engine.
ROW_PARTITIONS = ("by_rollout", "by_group", "by_advantage_sign", "by_reward", "by_source")


def _ghost() -> Callable[..., Any]:
    from .ghost import disintegrate_ghost

    return disintegrate_ghost


def _jvp() -> Optional[Callable[..., Any]]:
    try:
        mod = importlib.import_module(__name__ + ".jvp")
    except ImportError:
        return None
    return getattr(mod, "disintegrate_jvp", None)


ENGINES: dict[str, Callable[[], Optional[Callable[..., Any]]]] = {"ghost": _ghost, "jvp": _jvp}


def available_engines() -> tuple[str, ...]:
    """The engine names this installation accepts (``"auto"`` and ``"reference"`` always)."""
    return ("auto", "reference") + tuple(n for n, load in ENGINES.items() if load() is not None)


def get_engine(name: str) -> Callable[..., Any]:
    """The engine function registered under ``name`` (not ``"auto"``/``"reference"``)."""
    load = ENGINES.get(name) if isinstance(name, str) else None
    fn = load() if load is not None else None
    if fn is None:
        raise ValueError(f"`engine` must be one of {list(available_engines())}, got {name!r}.")
    return fn


def check_engine(engine: Any, readings: Any) -> None:
    """Raise a ``ValueError`` for an unknown engine or readings name."""
    if engine not in available_engines():
        raise ValueError(f"`engine` must be one of {list(available_engines())}, got {engine!r}.")
    if readings not in READINGS:
        raise ValueError(
            f"`readings` must be one of {list(READINGS)}, got {readings!r}: 'all' = projected and norm shares, "
            "cancellation (and the interference matrix where the engine makes it); 'shares' = the same without the "
            "interference matrix; 'projected' = projected shares only."
        )


def is_row_separable(partition: Partition) -> bool:
    """Whether every row's positions lie in at most one part (the parts are unions of whole rows)."""
    ids = partition.ids  # [B, T]
    if ids.numel() == 0:
        return True
    big = int(ids.max()) + 2
    lo = torch.where(ids >= 0, ids, torch.full_like(ids, big)).min(dim=1).values  # [B]
    hi = ids.max(dim=1).values  # [B]
    return bool(((hi < 0) | (lo == hi)).all())


def choose_engine(partition: Any, readings: str) -> str:
    """``"auto"``'s pick before the terms are known: ``"ghost"`` for a row partition, else the best exact one.

    A callable or unknown-by-name partition is first tried on ``"ghost"``, which hands over when the
    partition it builds turns out to split a row.
    """
    if isinstance(partition, Partition):
        if is_row_separable(partition):
            return "ghost"
        return "jvp" if readings == "projected" and _jvp() is not None else "reference"
    if not isinstance(partition, str):
        # The shipped partition functions (and wrappers that keep their name) are known by name; a wrong
        # guess costs only time: "ghost" hands a row-splitting partition over, the others are exact for any.
        partition = getattr(partition, "__name__", None)
    if isinstance(partition, str) and partition in ROW_PARTITIONS:
        return "ghost"
    if isinstance(partition, str) and partition in ("by_segment", "by_turn", "by_role"):
        return "jvp" if readings == "projected" and _jvp() is not None else "reference"
    return "ghost"
