"""The unit the process-reward instrument reads: one prompt's rollouts. Below both the instrument and its
sources (each builds or reads these), so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RolloutGroup"]


@dataclass(frozen=True)
class RolloutGroup:
    """The rollouts of one prompt: completion token ids (trained positions) and outcome rewards."""

    key: str
    completions: tuple[tuple[int, ...], ...]
    rewards: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "completions", tuple(tuple(int(t) for t in c) for c in self.completions))
        object.__setattr__(self, "rewards", tuple(float(r) for r in self.rewards))
