r"""A second partition's shares from the first one's, without another backward pass.

When every part of a partition ``P`` (e.g. ``by_rollout``) lies inside exactly one part of a coarser
partition ``Q`` (``by_advantage_sign``, ``by_reward``, ``by_source``: unions of whole rows), then
``g_Q = Σ_{S ⊂ Q} g_S`` and, by linearity,

.. math:: \text{projected\_share}[Q] = \sum_{S \subset Q} \text{projected\_share}[S]

exactly. Norms do not add (``‖g_S + g_S'‖`` needs the cross term ``⟨g_S, g_S'⟩``), so a derived
reading has no ``part_norm``; a partition that is not a union of ``P``'s parts needs the engine run
for it (one more disintegration, at its engine's cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..inputs.partition import Partition

__all__ = ["PartitionShares", "coarsening", "derive_shares"]


@dataclass(frozen=True)
class PartitionShares:
    """Projected shares of one partition's parts in one step.

    Attributes:
        partition: the partition's name (``by_advantage_sign``).
        part_names: one name per part.
        projected_share: ``⟨g_Q, g_full⟩ / ‖g_full‖²`` per part.
        part_norm: ``‖g_Q‖`` per part when the engine ran for this partition, else ``None``.
        n_rows: how many rows (rollouts) fall in each part, when known.
        method: ``"derived"`` (summed from the primary partition's shares) or ``"engine"``.

    Example:
        >>> r = PartitionShares("by_advantage_sign", ("positive", "negative", "zero"), (0.75, 0.25, 0.0))
        >>> r.to_dict("credit/by_advantage_sign/")["credit/by_advantage_sign/projected_share/positive"]
        0.75
    """

    partition: str
    part_names: tuple[str, ...]
    projected_share: tuple[float, ...]
    part_norm: Optional[tuple[float, ...]] = None
    n_rows: Optional[tuple[int, ...]] = None
    method: str = "derived"

    @property
    def share_sum(self) -> float:
        return math.fsum(self.projected_share)

    def share(self, name: str) -> float:
        return self.projected_share[self.part_names.index(name)]

    def to_dict(self, prefix: str = "credit/") -> dict[str, float]:
        out = {f"{prefix}projected_share/{n}": float(v) for n, v in zip(self.part_names, self.projected_share)}
        if self.part_norm is not None:
            total = math.fsum(self.part_norm)
            for n, v in zip(self.part_names, self.part_norm):
                out[f"{prefix}norm_share/{n}"] = float(v / total) if total > 0 else float("nan")
        if self.n_rows is not None:
            for n, v in zip(self.part_names, self.n_rows):
                out[f"{prefix}n_rows/{n}"] = float(v)
        return out

    def render(self) -> str:
        w = max([len("part")] + [len(n) for n in self.part_names])
        lines = [
            f"credit by {self.partition} ({len(self.part_names)} parts, {self.method})",
            f"{'part':<{w}}  {'projected_share':>15}  {'rows':>5}",
        ]
        for i, n in enumerate(self.part_names):
            rows = "" if self.n_rows is None else str(self.n_rows[i])
            lines.append(f"{n:<{w}}  {self.projected_share[i]:>15.6f}  {rows:>5}")
        lines.append(f"{'sum':<{w}}  {self.share_sum:>15.6f}")
        return "\n".join(lines)


def coarsening(fine: Partition, coarse: Partition) -> Optional[list[int]]:
    """For each part of ``fine``, the one part of ``coarse`` that contains it; ``None`` if there is none.

    ``fine`` parts with no positions map to ``-1``. ``coarse`` must cover the same positions.
    """
    f = fine.ids.cpu().reshape(-1)  # [B*T]
    c = coarse.ids.cpu().reshape(-1)  # [B*T]
    if f.shape != c.shape or not torch.equal(f >= 0, c >= 0):
        return None
    sel = f >= 0
    f, c = f[sel], c[sel]
    out = [-1] * fine.n_parts
    if f.numel() == 0:
        return out
    lo = torch.full((fine.n_parts,), coarse.n_parts, dtype=torch.long).scatter_reduce(0, f, c, "amin")
    hi = torch.full((fine.n_parts,), -1, dtype=torch.long).scatter_reduce(0, f, c, "amax")
    present = hi >= 0
    if bool((lo[present] != hi[present]).any()):
        return None
    for i in torch.nonzero(present).reshape(-1).tolist():
        out[i] = int(lo[i])
    return out


def derive_shares(
    projected_share: Sequence[float],
    mapping: Sequence[int],
    coarse: Partition,
    name: str,
    n_rows: Optional[Sequence[int]] = None,
) -> PartitionShares:
    """Sum the fine parts' shares into the coarse parts (``mapping`` from :func:`coarsening`).

    Example:
        >>> ids = torch.tensor([[0, 0], [1, 1], [1, -1]])
        >>> derive_shares([0.5, 0.25, 0.25], [0, 1, 1], Partition(ids, ("a", "b")), "demo").projected_share
        (0.5, 0.5)
    """
    if len(mapping) != len(projected_share):
        raise ValueError(f"`mapping` must hold one coarse part per share ({len(projected_share)}), got {len(mapping)}.")
    acc: list[list[float]] = [[] for _ in range(coarse.n_parts)]
    for s, j in zip(projected_share, mapping):
        if j >= 0:
            acc[j].append(float(s))
    shares = tuple(math.fsum(a) for a in acc)
    if not all(math.isfinite(float(x)) for x in projected_share):
        # An undefined reading (g_full zero or not finite) is undefined for every part, empty ones too.
        shares = tuple(float("nan") for _ in acc)
    return PartitionShares(name, coarse.names, shares, None, None if n_rows is None else tuple(int(x) for x in n_rows))


def rows_per_part(partition: Partition, trained: torch.Tensor) -> tuple[int, ...]:
    """How many rows have a trained position in each part."""
    ids = partition.ids.cpu()  # [B, T]
    out = []
    for i in range(partition.n_parts):
        out.append(int((ids == i).any(dim=1).sum()))
    return tuple(out)
