"""Partitions of the trained positions of a step into parts.

A :class:`Partition` is an ordinary object: ``ids`` ``[B, T]`` (part id per position, ``-1`` = in no
part) and ``names`` (one per part id). Every trained position must lie in exactly one part; untrained
positions must lie in none. A partition of your own is a few lines::

    def by_first_half(terms):
        ids = torch.full_like(terms.trained, -1, dtype=torch.long)
        half = terms.trained.shape[1] // 2
        ids[:, :half][terms.trained[:, :half]] = 0
        ids[:, half:][terms.trained[:, half:]] = 1
        return Partition(ids, ("first_half", "second_half"))
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from .terms import CreditTerms

__all__ = [
    "Partition",
    "PartitionFn",
    "by_rollout",
    "packed_rollouts",
    "position_parts",
    "OUTSIDE_SEGMENTS",
    "by_group",
    "by_segment",
    "by_advantage_sign",
    "by_reward",
    "by_source",
    "reward_levels",
    "row_partition",
    "PARTITIONS",
    "POSITIONAL_PARTITIONS",
    "resolve_partition",
    "PartitionError",
    "MissingSegmentsError",
    "PARTITION_REMEDY",
]

PARTITION_REMEDY = (
    "fix the partition: every trained position in exactly one part, untrained ones in none (ids -1); "
    "see docs/credit_audit.md, Partitions"
)


class PartitionError(ValueError):
    """A partition that does not partition the trained positions (the remedy is in the partition, not the terms)."""


class MissingSegmentsError(PartitionError):
    """A segment partition (``by_segment``, ``by_turn``) on terms that carry no segment ids: a set-up error."""


@dataclass(frozen=True)
class Partition:
    """Part id per position (``-1`` = none) and the part names.

    Attributes:
        ids: ``[B, T]`` long, part id of each position in ``0 .. len(names) - 1`` or ``-1``.
        names: one name per part id.
        positions: optional ``[B, T]`` long: the part every position belongs to, trained or not (``-1``:
            none), for parts that are spans of a row — rollouts packed into one row, whose prompt positions
            belong to their rollout. Where attention stays inside each span, a part's gradient is the sum of
            the pieces at its own positions, and the one-pass engine reads it so (and checks it). A trained
            position's span must be its part.
    """

    ids: torch.Tensor  # [B, T]
    names: tuple[str, ...]
    positions: Optional[torch.Tensor] = None  # [B, T]

    def __post_init__(self) -> None:
        self._check_positions()
        if not isinstance(self.ids, torch.Tensor) or self.ids.dim() != 2:
            raise PartitionError(f"`ids` must be a [B, T] integer tensor, got {_desc(self.ids)}.")
        if self.ids.is_floating_point() or self.ids.dtype == torch.bool:
            raise PartitionError(f"`ids` must be an integer tensor, got dtype {self.ids.dtype}; use `ids.long()`.")
        object.__setattr__(self, "names", tuple(str(n) for n in self.names))
        if len(self.names) == 0:
            raise PartitionError("`names` must name at least one part, got an empty partition.")
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise PartitionError(f"`names` must be unique, got duplicates {dup!r}.")
        if self.ids.numel() == 0:
            return  # an empty batch: nothing to bound (check_covers still checks the shape)
        lo, hi = int(self.ids.min()), int(self.ids.max())
        if lo < -1 or hi >= len(self.names):
            raise PartitionError(
                f"`ids` must lie in -1 .. {len(self.names) - 1} (one id per name), got values in {lo} .. {hi}."
            )

    def _check_positions(self) -> None:
        pos = self.positions
        if pos is None:
            return
        if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != tuple(self.ids.shape) or pos.is_floating_point():
            raise PartitionError(
                f"`positions` must be a [B, T] = {list(self.ids.shape)} integer tensor, got {_desc(pos)}."
            )
        if pos.numel() and (int(pos.min()) < -1 or int(pos.max()) >= len(self.names)):
            raise PartitionError(
                f"`positions` must lie in -1 .. {len(self.names) - 1}, got values in "
                f"{int(pos.min())} .. {int(pos.max())}."
            )
        ids = self.ids.to(pos.device)
        off = (ids >= 0) & (pos != ids)
        if bool(off.any()):
            where = [tuple(q) for q in off.nonzero()[:5].tolist()]
            raise PartitionError(
                f"`positions` must put every position of a part in that part's span, got {int(off.sum())} position(s) "
                f"whose span differs from their part, e.g. (row, t) = {where}."
            )

    @property
    def n_parts(self) -> int:
        return len(self.names)

    def mask(self, part: int) -> torch.Tensor:
        """``[B, T]`` bool mask of one part."""
        return self.ids == part

    def check_covers(self, trained: torch.Tensor) -> None:
        """Raise ``ValueError`` unless every trained position is in exactly one part and no other is."""
        if tuple(trained.shape) != tuple(self.ids.shape):
            raise PartitionError(
                f"partition `ids` must have the shape of `trained` {list(trained.shape)}, got {list(self.ids.shape)}."
            )
        ids = self.ids.to(trained.device)
        uncovered = trained & (ids < 0)
        if uncovered.any():
            pos = [tuple(p) for p in uncovered.nonzero()[:5].tolist()]
            raise PartitionError(
                f"partition leaves {int(uncovered.sum())} trained position(s) in no part, e.g. (row, t) = {pos}; "
                "every trained position must be in exactly one part."
            )
        stray = (~trained) & (ids >= 0)
        if stray.any():
            pos = [tuple(p) for p in stray.nonzero()[:5].tolist()]
            raise PartitionError(
                f"partition puts {int(stray.sum())} untrained position(s) in a part, e.g. (row, t) = {pos}; "
                "set their id to -1."
            )

    @staticmethod
    def from_masks(masks: Sequence[torch.Tensor], names: Sequence[str]) -> "Partition":
        """Build a partition from one ``[B, T]`` bool mask per part; overlapping masks raise."""
        if len(masks) == 0:
            raise PartitionError("`masks` must hold at least one part mask, got an empty list.")
        if len(masks) != len(names):
            raise PartitionError(f"`names` must name each mask: got {len(masks)} masks and {len(names)} names.")
        stack = torch.stack([m.bool() for m in masks])  # [m, B, T]
        count = stack.sum(0)
        if (count > 1).any():
            pos = [tuple(p) for p in (count > 1).nonzero()[:5].tolist()]
            raise PartitionError(
                f"parts overlap at {int((count > 1).sum())} position(s), e.g. (row, t) = {pos}; "
                "each position may lie in one part only."
            )
        ids = torch.full(stack.shape[1:], -1, dtype=torch.long, device=stack.device)
        for i, m in enumerate(stack):
            ids[m] = i
        return Partition(ids, tuple(names))


PartitionFn = Callable[[CreditTerms], Partition]


def _dense_ids(values: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    uniq, inv = torch.unique(values, sorted=True, return_inverse=True)
    return inv, [int(u) for u in uniq.tolist()]


def by_rollout(terms: CreditTerms) -> Partition:
    """One part per rollout (row id in ``terms.rollout``).

    On the rows of an accumulated step (``terms.micro_batch`` set), a rollout id that repeats across
    micro-batches (``torch.arange(B)`` in each) names another rollout in each: the parts are then keyed by
    micro-batch, ``mb{j}/rollout_{id}``. Rollouts packed into rows (``terms.rollout`` of shape ``[B, T]``,
    an id per position, ``-1`` for padding) are parts of their trained positions, with their spans as
    :attr:`Partition.positions`.
    """
    if terms.rollout.dim() == 2:
        return _packed_rollouts(terms)
    rollout = terms.rollout.cpu().long()  # [B]
    if len(rollout) == 0:
        raise PartitionError("`by_rollout` needs at least one rollout, got an empty batch.")
    mb = terms.micro_batch.cpu().long() if terms.micro_batch is not None else None  # [B]
    if mb is not None and _repeats_across(rollout, mb):
        pairs, inv = torch.unique(torch.stack([mb, rollout], 1), dim=0, sorted=True, return_inverse=True)  # [m, 2]
        names = tuple(f"mb{int(j)}/rollout_{int(r)}" for j, r in pairs.tolist())
    else:
        inv, uniq = _dense_ids(rollout)
        names = tuple(f"rollout_{u}" for u in uniq)
    ids = inv.view(-1, 1).expand_as(terms.trained).clone()
    ids[~terms.trained.cpu()] = -1
    return Partition(ids.to(terms.trained.device), names)


def _packed_rollouts(terms: CreditTerms) -> Partition:
    """``by_rollout`` on rollouts packed into rows: a part per rollout id, its span every position with that id."""
    rollout = terms.rollout.cpu().long()  # [B, T]
    trained = terms.trained.cpu()  # [B, T]
    if bool((trained & (rollout < 0)).any()):
        pos = [tuple(q) for q in (trained & (rollout < 0)).nonzero()[:5].tolist()]
        raise PartitionError(
            f"packed `rollout` ids must be >= 0 at every trained position, got -1 at (row, t) = {pos}."
        )
    key = rollout
    mb = terms.micro_batch.cpu().long()[:, None].expand_as(rollout) if terms.micro_batch is not None else None
    keyed = mb is not None and _repeats_across(rollout[rollout >= 0], mb[rollout >= 0])
    if keyed:
        key = torch.where(rollout >= 0, mb * (int(rollout.max()) + 1) + rollout, -1)
    uniq = torch.unique(key[key >= 0], sorted=True)  # [m]
    if uniq.numel() == 0:
        raise PartitionError("`by_rollout` needs at least one rollout, got none (every packed id is -1).")
    spans = torch.where(key >= 0, torch.searchsorted(uniq, key.clamp(min=0)), -1)  # [B, T]
    ids = torch.where(trained, spans, -1)
    if keyed:
        width = int(rollout.max()) + 1
        names = tuple(f"mb{int(u) // width}/rollout_{int(u) % width}" for u in uniq)
    else:
        names = tuple(f"rollout_{int(u)}" for u in uniq)
    dev = terms.trained.device
    return Partition(ids.to(dev), names, positions=spans.to(dev))


def packed_rollouts(position_ids: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-position rollout ids ``[B, T]`` of rows that pack several rollouts, from their position ids.

    A rollout starts wherever ``position_ids`` does not grow by one (a restart at 0, as TRL's padding-free
    collator, verl's remove-padding and OpenRLHF's packing write them); ids count rollouts over the whole
    batch, row by row. ``valid`` (``[B, T]`` bool) marks the positions that hold a token (``-1`` elsewhere).

    Example:
        >>> packed_rollouts(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])).tolist()
        [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]
        >>> packed_rollouts(torch.tensor([[0, 1, 0, 0], [0, 1, 2, 0]]), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])).tolist()
        [[0, 0, -1, -1], [1, 1, 1, -1]]
    """
    pos = position_ids.long()
    if pos.dim() != 2:
        raise ValueError(f"`position_ids` must be [B, T], got a tensor of shape {list(pos.shape)}.")
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if valid is not None:
        valid = valid.to(pos.device).bool()
        start &= valid  # padding starts no rollout: the ids stay 0, 1, 2, … over the rollouts that hold tokens
    ids = start.reshape(-1).cumsum(0).reshape(pos.shape) - 1  # [B, T]
    if valid is not None:
        ids = torch.where(valid, ids, -1)
    return ids


#: The position split's part for positions outside every segment (a BOS token, a system prefix).
OUTSIDE_SEGMENTS = "outside_segments"


def position_parts(terms: CreditTerms) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The parts of the position split: every position by its segment, trained or not.

    ``(ids [B, T], names)``: segment ``j`` is named ``terms.segment_names[j]`` (``segment_{j}`` without names);
    positions whose segment is ``-1`` form one more part, :data:`OUTSIDE_SEGMENTS`, so the split covers every
    position and its shares sum to 1.

    Example:
        >>> from lens_callbacks.credit.inputs.terms import CreditTerms
        >>> t = CreditTerms(torch.zeros(1, 4), torch.tensor([[False, False, True, True]]), torch.arange(1),
        ...                 torch.zeros(1, dtype=torch.long), segment=torch.tensor([[-1, 0, 1, 1]]),
        ...                 segment_names=("user", "assistant"))
        >>> ids, names = position_parts(t)
        >>> ids.tolist(), names
        ([[2, 0, 1, 1]], ('user', 'assistant', 'outside_segments'))
    """
    if terms.segment is None:
        raise MissingSegmentsError(
            "the position split needs `CreditTerms.segment` ([B, T] turn ids at every position), got None. Return "
            "segment ids from `credit_terms` (see `turn_segments`), or turn the position split off."
        )
    seg = terms.segment.cpu().long()  # [B, T]
    if terms.segment_names is not None:
        names = list(terms.segment_names)
        ids = seg.clone()
    else:
        present = torch.unique(seg[seg >= 0], sorted=True)
        names = [f"segment_{int(u)}" for u in present]
        ids = torch.where(seg >= 0, torch.searchsorted(present, seg.clamp(min=0)), -1)
    if bool((seg < 0).any()):
        ids = torch.where(seg >= 0, ids, len(names))
        names.append(OUTSIDE_SEGMENTS)
    if ids.numel() and int(ids.max()) >= len(names):
        raise PartitionError(f"`segment` ids must be < len(segment_names) = {len(names)}, got {int(ids.max())}.")
    return ids.to(terms.trained.device), tuple(names)


def _repeats_across(rollout: torch.Tensor, mb: torch.Tensor) -> bool:
    """Whether some rollout id appears in more than one micro-batch."""
    pairs = torch.unique(torch.stack([rollout, mb], 1), dim=0)  # [n, 2] distinct (rollout, micro-batch)
    return bool(torch.unique(pairs[:, 0]).numel() < pairs.shape[0])


def by_group(terms: CreditTerms) -> Partition:
    """One part per prompt group (``terms.group``)."""
    inv, uniq = _dense_ids(terms.group.cpu())
    if len(uniq) == 0:
        raise PartitionError("`by_group` needs at least one group, got an empty batch.")
    ids = inv.view(-1, 1).expand_as(terms.trained).clone()
    ids[~terms.trained.cpu()] = -1
    return Partition(ids.to(terms.trained.device), tuple(f"group_{u}" for u in uniq))


def trained_segments(terms: CreditTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment, trained)`` on the CPU, after checking every trained position has a segment id."""
    seg = terms.segment.cpu()  # [B, T]
    trained = terms.trained.cpu()  # [B, T]
    bad = trained & (seg < 0)
    if bad.any():
        pos = [tuple(p) for p in bad.nonzero()[:5].tolist()]
        raise PartitionError(
            f"`segment` is -1 at {int(bad.sum())} trained position(s), e.g. (row, t) = {pos}; every trained "
            "position needs a segment id."
        )
    return seg, trained


def by_segment(terms: CreditTerms) -> Partition:
    """One part per segment id (a turn, pooled over rows): ``terms.segment`` ``[B, T]``.

    Segment ids are shared across rows (turn 0 of every rollout is part ``segment_0``), so the
    part answers "which turn got the credit" over the whole step.
    """
    if terms.segment is None:
        raise MissingSegmentsError(
            "`by_segment` needs `CreditTerms.segment` ([B, T] turn ids), got None. Return segment ids from "
            "`credit_terms` (see `turn_segments`) or use partition='by_rollout'."
        )
    seg, trained = trained_segments(terms)
    vals = seg[trained]
    inv, uniq = _dense_ids(vals)
    if len(uniq) == 0:
        raise PartitionError("`by_segment` needs at least one trained position, got none.")
    ids = torch.full_like(seg, -1, dtype=torch.long)
    ids[trained] = inv
    names = terms.segment_names
    if names is not None:
        label = [names[u] if 0 <= u < len(names) else f"segment_{u}" for u in uniq]
    else:
        label = [f"segment_{u}" for u in uniq]
    return Partition(ids.to(terms.trained.device), tuple(label))


def row_partition(terms: CreditTerms, row_part: torch.Tensor, names: Sequence[str]) -> Partition:
    """Every trained position of row ``k`` in part ``row_part[k]`` (``[B]`` ids into ``names``)."""
    ids = row_part.cpu().long().view(-1, 1).expand_as(terms.trained).clone()  # [B, T]
    ids[~terms.trained.cpu()] = -1
    return Partition(ids.to(terms.trained.device), tuple(names))


ADVANTAGE_SIGN_NAMES = ("positive", "negative", "zero")


def by_advantage_sign(terms: CreditTerms) -> Partition:
    """Rows by the sign of their advantage: ``positive``, ``negative``, ``zero`` (always all three).

    The positive part is the credit that pulls toward rollouts that beat their group's baseline, the
    negative part the credit that pushes away from those that fell short. Names never change, so
    the three time series mean the same thing at every step (a part with no rows reads 0).
    """
    if terms.advantages is None:
        raise ValueError(
            "`by_advantage_sign` needs `CreditTerms.advantages` ([B] float, one advantage per row), got None. "
            "Return the advantages from `credit_terms`."
        )
    a = terms.advantages.detach().cpu()  # [B]
    row = torch.full(a.shape, 2, dtype=torch.long)  # [B] zero unless signed
    row[a > 0] = 0
    row[a < 0] = 1
    return row_partition(terms, row, ADVANTAGE_SIGN_NAMES)


def _level_name(v: float) -> str:
    return f"reward={v:g}"


def reward_levels(edges: Optional[Sequence[float]] = None, max_levels: int = 8, n_bins: int = 4) -> PartitionFn:
    """A partition of rows by outcome reward (``CreditTerms.rewards``).

    Args:
        edges: fixed bin edges ``e_0 < … < e_n``; a row lands in ``reward[e_i,e_{i+1})`` (the first
            and last bins are open: ``reward<e_0`` …, ``reward>=e_n``). Stable names across steps.
        max_levels: without ``edges``, a step whose rewards take at most this many distinct values
            gets one part per value (``reward=1.1``): verifiable rewards are discrete.
        n_bins: without ``edges``, continuous rewards are binned by rank within the step into this
            many equal-count bins (``reward_q1`` = lowest … ``reward_q<n_bins>`` = highest).

    Example:
        >>> from lens_callbacks.credit.inputs.terms import CreditTerms
        >>> t = CreditTerms(torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.bool), torch.arange(3),
        ...                 torch.zeros(3, dtype=torch.long), rewards=torch.tensor([1.0, 0.0, 1.0]))
        >>> reward_levels()(t).names, reward_levels(edges=[0.5])(t).names
        (('reward=0', 'reward=1'), ('reward<0.5', 'reward>=0.5'))
    """
    if edges is not None:
        e = [float(x) for x in edges]
        if not e or any(b <= a for a, b in zip(e, e[1:])):
            raise ValueError(f"`edges` must be a non-empty increasing sequence of floats, got {edges!r}.")
    if not isinstance(max_levels, int) or max_levels < 1:
        raise ValueError(f"`max_levels` must be an int >= 1, got {max_levels!r}.")
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"`n_bins` must be an int >= 1, got {n_bins!r}.")

    def by_reward(terms: CreditTerms) -> Partition:
        if terms.rewards is None:
            raise ValueError(
                "`by_reward` needs `CreditTerms.rewards` ([B] float outcome reward per row), got None. "
                "Return the rewards from `credit_terms`."
            )
        r = terms.rewards.detach().cpu().double()  # [B]
        if edges is not None:
            row = torch.bucketize(r, torch.tensor(e, dtype=torch.float64), right=True)  # [B] in 0 .. len(e)
            names = [f"reward<{e[0]:g}"] + [f"reward[{a:g},{b:g})" for a, b in zip(e, e[1:])] + [f"reward>={e[-1]:g}"]
            return row_partition(terms, row, names)
        levels = torch.unique(r, sorted=True)  # [L]
        if levels.numel() <= max_levels:
            row = torch.searchsorted(levels, r)  # [B]
            return row_partition(terms, row, [_level_name(float(v)) for v in levels])
        # Equal-count bins by rank (ties broken by row order): the top quarter is the top quarter at every step.
        rank = torch.empty(r.numel(), dtype=torch.long)
        rank[torch.argsort(r, stable=True)] = torch.arange(r.numel())
        row = rank * n_bins // r.numel()  # [B]
        return row_partition(terms, row, [f"reward_q{i + 1}" for i in range(n_bins)])

    by_reward.__name__ = "by_reward"
    return by_reward


by_reward = reward_levels()


def by_source(terms: CreditTerms) -> Partition:
    """Rows by the label the module supplies (``CreditTerms.source``: dataset, task type, difficulty).

    With ``source_names`` every name is a part at every step (a source absent from the batch reads
    0), so the time series are stable; without them, one part ``source_<id>`` per id present.
    """
    if terms.source is None:
        raise ValueError(
            "`by_source` needs `CreditTerms.source` ([B] int label per row, names in `source_names`), got None. "
            "Return a per-row source label from `credit_terms`."
        )
    src = terms.source.detach().cpu().long()  # [B]
    if terms.source_names is not None:
        return row_partition(terms, src, terms.source_names)
    inv, uniq = _dense_ids(src)
    if len(uniq) == 0:
        raise ValueError("`by_source` needs at least one row, got an empty batch.")
    return row_partition(terms, inv, [f"source_{u}" for u in uniq])


PARTITIONS: dict[str, PartitionFn] = {
    "by_rollout": by_rollout,
    "by_group": by_group,
    "by_segment": by_segment,
    "by_advantage_sign": by_advantage_sign,
    "by_reward": by_reward,
    "by_source": by_source,
}

# Partitions whose part names are batch positions (``rollout_7`` is another rollout at every step):
# their per-part time series mean nothing over steps, so the callback logs them only on request.
POSITIONAL_PARTITIONS = frozenset({"by_rollout", "by_group"})


def resolve_partition(spec: Union[str, PartitionFn, Partition]) -> Union[PartitionFn, Partition]:
    """A partition by name (``"by_rollout"``), import path (``"pkg.mod.fn"``), callable or object."""
    if isinstance(spec, Partition) or callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"`partition` must be one of {sorted(PARTITIONS)}, an import path 'module.function', or a callable, "
            f"got {spec!r}."
        )
    if spec in PARTITIONS:
        return PARTITIONS[spec]
    if "." in spec:
        mod_name, _, attr = spec.rpartition(".")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"`partition` import path {spec!r} could not be imported: {err}.") from err
        if not callable(fn):
            raise ValueError(f"`partition` import path {spec!r} must name a callable, got {type(fn).__name__}.")
        return fn
    raise ValueError(
        f"`partition` must be one of {sorted(PARTITIONS)} or an import path 'module.function', got {spec!r}."
    )


def apply_partition(spec: Union[PartitionFn, Partition], terms: CreditTerms) -> Partition:
    """The :class:`Partition` of ``terms`` that ``spec`` (resolved) gives, checked to cover the trained positions."""
    part = spec if isinstance(spec, Partition) else spec(terms)
    if not isinstance(part, Partition):
        raise TypeError(
            f"`partition` callable must return a Partition, got {type(part).__name__}; return "
            "Partition(ids, names) or Partition.from_masks(masks, names)."
        )
    part.check_covers(terms.trained)
    return part


def _desc(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {list(v.shape)} and dtype {v.dtype}"
    return repr(v)
