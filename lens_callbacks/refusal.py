"""The shape every reading that cannot be made takes.

A read-only instrument never crashes the user's training run: when a reading cannot be made (the
optimizer is outside the exact set, the full gradient is zero, a group is degenerate), the instrument
returns a :class:`Refusal` carrying the condition that broke, the value that broke it, the numbers it
had, and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


class ReadingWarning(RuntimeWarning, UserWarning):
    """What the instruments warn with: a refused reading, or a reading that says the run is not what it claims.

    Said once per cause (the counts come in a summary at the end of fit); filter it with
    ``warnings.filterwarnings("ignore", category=ReadingWarning)``.
    """


@dataclass(frozen=True)
class Refusal:
    """A reading that was declined, with its reason and numbers.

    A ``Refusal`` is falsy, so ``if reading:`` reads as "a reading was made".

    Example:
        >>> r = Refusal("optimizer", "`optimizer` must be torch.optim.SGD, got 'Adam'.", remedy="use plain SGD")
        >>> bool(r), r.condition
        (False, 'optimizer')
    """

    condition: str
    reason: str
    numbers: Mapping[str, Any] = field(default_factory=dict)
    remedy: str = ""

    def __bool__(self) -> bool:
        return False

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """Numeric fields only (for loggers), plus ``refused = 1.0``."""
        out = {f"{prefix}refused": 1.0}
        for k, v in self.numbers.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{prefix}{k}"] = float(v)
        return out

    def render(self) -> str:
        lines = [f"REFUSED ({self.condition}): {self.reason}"]
        for k, v in self.numbers.items():
            lines.append(f"  {k}: {v}")
        if self.remedy:
            lines.append(f"  remedy: {self.remedy}")
        return "\n".join(lines)
