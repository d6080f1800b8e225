"""torchmetrics form of the process-reward instrument's per-group readings.

``_process_update`` turns per-group readings into additive sums and ``_process_compute`` turns the sums
into the logged fractions; :func:`process_reward_stats` (functional) and :class:`ProcessRewardMetric`
(module, summed over DDP ranks) share them.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torchmetrics import Metric

__all__ = ["ProcessRewardMetric", "process_reward_stats", "readings_to_tensors"]


def readings_to_tensors(readings: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kill [G] bool, mean_divergence_depth [G], informative_fraction [G], zero_reward_fraction [G])``."""
    f = torch.float64
    return (
        torch.tensor([bool(r.kill) for r in readings], dtype=torch.bool),
        torch.tensor([float(r.mean_divergence_depth) for r in readings], dtype=f),
        torch.tensor([float(r.informative_fraction) for r in readings], dtype=f),
        torch.tensor([float(r.zero_reward_fraction) for r in readings], dtype=f),
    )


def _process_update(
    kill: torch.Tensor, depth: torch.Tensor, informative: torch.Tensor, zero: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Additive sums over groups; groups without trained positions (NaN readings) count for kill only."""
    if not (kill.shape == depth.shape == informative.shape == zero.shape) or kill.dim() != 1:
        raise ValueError(
            f"`kill`, `depth`, `informative` and `zero` must be [G] tensors of one length, got shapes "
            f"{[list(t.shape) for t in (kill, depth, informative, zero)]}."
        )
    ok = torch.isfinite(depth) & torch.isfinite(informative) & torch.isfinite(zero)  # [G]
    f = torch.float64
    return {
        "n_groups": torch.tensor(float(kill.numel()), dtype=f),
        "n_killed": kill.to(f).sum(),
        "n_read": ok.to(f).sum(),
        "depth_sum": torch.where(ok, depth.to(f), torch.zeros((), dtype=f)).sum(),
        "informative_sum": torch.where(ok, informative.to(f), torch.zeros((), dtype=f)).sum(),
        "zero_sum": torch.where(ok, zero.to(f), torch.zeros((), dtype=f)).sum(),
    }


def _process_compute(
    n_groups: torch.Tensor,
    n_killed: torch.Tensor,
    n_read: torch.Tensor,
    depth_sum: torch.Tensor,
    informative_sum: torch.Tensor,
    zero_sum: torch.Tensor,
) -> dict[str, torch.Tensor]:
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return {
        "kill_fraction": n_killed / n_groups if n_groups > 0 else nan,
        "informative_fraction": informative_sum / n_read if n_read > 0 else nan,
        "mean_divergence_depth": depth_sum / n_read if n_read > 0 else nan,
        "zero_reward_fraction": zero_sum / n_read if n_read > 0 else nan,
        "n_groups": n_groups.clone(),
        "n_killed": n_killed.clone(),
    }


def process_reward_stats(
    kill: torch.Tensor, depth: torch.Tensor, informative: torch.Tensor, zero: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Fractions over groups: kill fraction, and group means of the other readings.

    ``kill_fraction = Σ kill / G``; ``informative_fraction``, ``mean_divergence_depth`` and
    ``zero_reward_fraction`` are means over the groups that have trained positions.

    Example:
        >>> s = process_reward_stats(torch.tensor([True, False]), torch.tensor([1.0, 2.0]),
        ...                          torch.tensor([0.0, 0.5]), torch.tensor([0.75, 0.25]))
        >>> float(s["kill_fraction"]), float(s["mean_divergence_depth"]), float(s["informative_fraction"])
        (0.5, 1.5, 0.25)
    """
    return _process_compute(**_process_update(kill, depth, informative, zero))


class ProcessRewardMetric(Metric):
    """Accumulates per-group readings; ``compute()`` returns the fractions (summed over ranks)."""

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        for name in ("n_groups", "n_killed", "n_read", "depth_sum", "informative_sum", "zero_sum"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, kill: torch.Tensor, depth: torch.Tensor, informative: torch.Tensor, zero: torch.Tensor) -> None:  # type: ignore[override]
        for name, v in _process_update(kill, depth, informative, zero).items():
            setattr(self, name, getattr(self, name) + v.to(getattr(self, name).device))

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return _process_compute(
            self.n_groups, self.n_killed, self.n_read, self.depth_sum, self.informative_sum, self.zero_sum
        )
