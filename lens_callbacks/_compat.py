"""Deprecated option names, kept for one release: the same idea has the same name in every callback."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["renamed"]

_UNSET: Any = object()


def renamed(owner: str, old: str, new: str, old_value: Any, new_value: Any, default: Any) -> Any:
    """The value of option ``new``, taking a value given under its deprecated name ``old`` (with a warning).

    Giving both is an error. ``old_value`` is ``None`` when the old name was not used.

    Example:
        >>> renamed("ProcessRewardCallback", "log_prefix", "prefix", None, "process/", "process/")
        'process/'
    """
    if old_value is None:
        return new_value
    if new_value != default:
        raise ValueError(
            f"`{old}` is the old name of `{new}`; give only `{new}`, got both ({old_value!r}, {new_value!r})."
        )
    warnings.warn(
        f"{owner}: `{old}` is deprecated and will be removed in the next release; use `{new}` (the name every "
        "callback uses for it).",
        FutureWarning,
        stacklevel=3,
    )
    return old_value
