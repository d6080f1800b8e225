r"""Does GRPO's outcome reward induce a usable process reward? The instrument and its kill condition.

GRPO with an outcome reward is equivalent to a PRM-aware objective whose process reward is the
Monte-Carlo value of the prefix, ``q(s) = E[R | prefix s]``. Per group (the rollouts of one prompt):

- a prefix trie over the completions (the token ids of the trained positions); ``n(s)`` rollouts pass
  through prefix ``s`` and ``q(s)`` is their mean outcome; ``q(root)`` is the group mean;
- the state after position ``t`` of rollout ``k`` is ``s_{≤t}``, its first ``t`` tokens; the state
  after its last token is the finished rollout itself, whose value is its own outcome ``R_k``;
- the process reward at position ``t`` is ``r_{k,t} = q(s_{≤t}) − q(s_{<t})``, so
  ``Σ_t r_{k,t} = R_k − q(root)``: it telescopes to the rollout's outcome advantage (a rollout with
  no trained position carries none);
- the divergence depth of a rollout is the 1-based position where it first stands alone
  (``n(s_{≤t}) = 1``; the finished rollout always does);
- a position is *informative* when its state is shared by ≥ 2 rollouts with different outcomes that are
  not all one and the same completion: the only place a prefix has more than one sample to average, and
  a token choice below it can separate the outcomes (identical completions scored differently say that
  the outcome is not a function of the tokens; no prefix of theirs can tell the outcomes apart);
- ``informative_fraction`` and ``zero_reward_fraction`` are shares of a rollout's trained positions,
  averaged over the group's rollouts;
- kill condition: no position of the group is informative. The induced function is then constant
  past the root (every value is the rollout's own outcome, the whole advantage lands on token one),
  and the verdict is a :class:`~lens_callbacks.refusal.Refusal` carrying the numbers and the remedy.

The peer for cross-checks is the ``InfPRMTree`` of coli-saar/grpo-prm (Sullivan & Koller 2025).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, Union

from ..refusal import Refusal
from . import sources
from .groups import RolloutGroup
from .trie import PrefixTrie

__all__ = [
    "InducedProcessReward",
    "ProcessAudit",
    "RolloutGroup",
    "induced_process_reward",
    "audit_groups",
    "REMEDY",
]

REMEDY = (
    "re-roll at prefixes the sampler never revisited (rung 1): resample continuations from the prefixes "
    "of these rollouts so that a prefix holds more than one sample, then read q(s) there"
)


@dataclass(frozen=True)
class InducedProcessReward:
    r"""The process reward one group's outcomes induce, with the kill condition's numbers.

    Per rollout ``k`` and trained position ``t = 1 … L_k``:
    ``prefix_counts[k][t-1] = n(s_{≤t})``, ``values[k][t-1] = q(s_{≤t})`` (the last one is ``R_k``),
    ``process_rewards[k][t-1] = q(s_{≤t}) − q(s_{<t})`` (summing to ``R_k − q_root``).

    Attributes:
        rewards: ``R_k`` per rollout.
        lengths: ``L_k``, trained positions per rollout.
        q_root: the group mean outcome.
        prefix_counts, values, process_rewards, informative: per rollout, per position.
        common_prefix: the longest completion prefix shared by every rollout.
        divergence_depth: per rollout, the 1-based position where it first stands alone (0 if empty).
        mean_divergence_depth: mean over rollouts with at least one position.
        informative_fraction: share of positions that are informative, averaged over rollouts.
        zero_reward_fraction: share of positions with exactly zero process reward, averaged over rollouts.
        kill: no position is informative (the induced function is constant past the root).
        key: the group's name.
        identical_mixed: sets of rollouts (indices) with identical completions and different outcomes.
    """

    rewards: tuple[float, ...]
    lengths: tuple[int, ...]
    q_root: float
    prefix_counts: tuple[tuple[int, ...], ...]
    values: tuple[tuple[float, ...], ...]
    process_rewards: tuple[tuple[float, ...], ...]
    informative: tuple[tuple[bool, ...], ...]
    common_prefix: tuple[int, ...]
    divergence_depth: tuple[int, ...]
    mean_divergence_depth: float
    informative_fraction: float
    zero_reward_fraction: float
    kill: bool
    key: str = ""
    identical_mixed: tuple[tuple[int, ...], ...] = ()

    @property
    def n_rollouts(self) -> int:
        return len(self.rewards)

    @property
    def n_positions(self) -> int:
        return sum(self.lengths)

    @property
    def common_prefix_len(self) -> int:
        return len(self.common_prefix)

    @property
    def n_informative(self) -> int:
        return sum(sum(row) for row in self.informative)

    @property
    def n_zero(self) -> int:
        return sum(sum(1 for r in row if r == 0.0) for row in self.process_rewards)

    def numbers(self) -> dict[str, Any]:
        return {
            "n_rollouts": self.n_rollouts,
            "n_positions": self.n_positions,
            "common_prefix_len": self.common_prefix_len,
            "mean_divergence_depth": self.mean_divergence_depth,
            "informative_fraction": self.informative_fraction,
            "zero_reward_fraction": self.zero_reward_fraction,
            "q_root": self.q_root,
        }

    def verdict(self) -> Union[tuple[bool, str], Refusal]:
        """``(False, reason)`` when the kill condition does not fire; a :class:`Refusal` when it does."""
        if not self.kill:
            return (
                False,
                f"{self.n_informative} of {self.n_positions} trained positions sit on prefixes shared by rollouts "
                f"with different outcomes (informative_fraction {self.informative_fraction:.3f}); the induced "
                "process reward is not constant and can be read.",
            )
        remedy = REMEDY
        if self.n_positions and len(set(self.rewards)) == 1:
            why = "every rollout has the same outcome, so every process reward is zero"
        elif self.identical_mixed:
            first = self.identical_mixed[0]
            rest = sum(map(len, self.identical_mixed)) < self.n_rollouts
            why = (
                f"{len(self.identical_mixed)} set(s) of identical completions carry different outcomes (e.g. rollouts "
                f"{list(first)}: outcomes {[self.rewards[k] for k in first]}), so the outcome is not a function of "
                "the completion's tokens: every prefix they share is valued at their mean and no token choice "
                "separates their outcomes"
                + ("; no other prefix is shared by rollouts with different outcomes" if rest else "")
            )
            remedy = (
                "check the reward: identical completions scored differently mean it reads something besides the "
                "completion (a sampled judge, hidden state of the environment); make it a function of the "
                "completion or average repeated scores; then " + REMEDY
            )
        else:
            why = (
                f"no prefix is shared by rollouts with different outcomes (longest common completion prefix "
                f"{self.common_prefix_len} tokens, mean divergence depth {self.mean_divergence_depth:.2f}); every "
                "value past the root is a rollout's own outcome and the whole advantage lands where it stands alone"
            )
        return Refusal(
            condition="kill",
            reason=f"the induced process reward is constant past the root: {why}.",
            numbers=self.numbers(),
            remedy=remedy,
        )

    def to_dict(self, prefix: str = "process/") -> dict[str, float]:
        out = {f"{prefix}{k}": float(v) for k, v in self.numbers().items()}
        out[f"{prefix}kill"] = 1.0 if self.kill else 0.0
        return out

    def render(self, max_positions: int = 12) -> str:
        """One line per rollout: outcome, length, depth, then ``token:n:q:r`` for its first positions."""
        v = self.verdict()
        head = (
            f"group {self.key or '-'}: {self.n_rollouts} rollouts, {self.n_positions} trained positions, "
            f"q(root) {self.q_root:.4f}, common prefix {self.common_prefix_len}, mean divergence depth "
            f"{self.mean_divergence_depth:.2f}, informative_fraction {self.informative_fraction:.3f}, "
            f"zero_reward_fraction {self.zero_reward_fraction:.4f}"
        )
        lines = [head, f"{'k':>3} {'R_k':>9} {'L':>4} {'depth':>5}  n(s) / q(s) / r per position"]
        for k in range(self.n_rollouts):
            cells = [
                f"{n}/{q:.3g}/{r:+.3g}"
                for n, q, r in list(zip(self.prefix_counts[k], self.values[k], self.process_rewards[k]))[:max_positions]
            ]
            more = " …" if self.lengths[k] > max_positions else ""
            lines.append(
                f"{k:>3} {self.rewards[k]:>9.4f} {self.lengths[k]:>4} {self.divergence_depth[k]:>5}  {' '.join(cells)}{more}"
            )
        lines.append(v.render() if isinstance(v, Refusal) else f"verdict: kill does not fire: {v[1]}")
        return "\n".join(lines)


def induced_process_reward(
    completions: Sequence[Sequence[int]], rewards: Sequence[float], *, key: str = ""
) -> InducedProcessReward:
    r"""The process reward one group's outcome rewards induce through shared prefixes.

    ``q(s) = mean{R_j : completion j begins with s}``; ``r_{k,t} = q(s_{≤t}) − q(s_{<t})``, with the
    finished rollout's value its own ``R_k``, so ``Σ_t r_{k,t} = R_k − q(root)``.

    Args:
        completions: per rollout, the token ids of its trained positions, in order.
        rewards: per rollout, its outcome reward.
        key: a name for the group (shown in tables).

    Returns:
        An :class:`InducedProcessReward`; its ``verdict()`` is a Refusal when the kill condition fires.

    Example:
        >>> r = induced_process_reward([[5, 1], [5, 2], [6, 3]], [1.0, 0.0, 1.0])
        >>> r.prefix_counts, r.process_rewards
        (((2, 1), (2, 1), (1, 1)), ((-0.16666666666666663, 0.5), (-0.16666666666666663, -0.5), (0.33333333333333337, 0.0)))
        >>> r.divergence_depth, r.informative_fraction, r.kill
        ((2, 2, 1), 0.3333333333333333, False)
    """
    if len(completions) != len(rewards):
        raise ValueError(
            f"`rewards` must hold one outcome per completion, got {len(rewards)} rewards for {len(completions)} completions."
        )
    if len(completions) == 0:
        raise ValueError("`completions` must hold at least one rollout, got an empty group.")
    comps = [tuple(int(t) for t in c) for c in completions]
    outs = [float(r) for r in rewards]
    bad = [r for r in outs if not math.isfinite(r)]
    if bad:
        raise ValueError(f"`rewards` must be finite, got {bad[:3]!r}.")

    trie = PrefixTrie()
    for c, r in zip(comps, outs):
        trie.insert(c, r)
    q_root = trie.root.q

    # Rollouts with the same completion pass through every prefix of it together: a prefix whose rollouts
    # are all copies of one completion has no token below it that could separate their outcomes.
    copies: dict[tuple[int, ...], list[int]] = {}
    for k, c in enumerate(comps):
        copies.setdefault(c, []).append(k)

    counts, values, prs, infos, depths = [], [], [], [], []
    zero_fr, info_fr, depth_vals = [], [], []
    for c, r in zip(comps, outs):
        nodes = trie.path(c)
        L = len(nodes)
        n_k = tuple(node.n for node in nodes)
        # The finished rollout is a state of its own: its value is its outcome, so the sum telescopes to R_k.
        v_k = tuple(node.q for node in nodes[:-1]) + ((r,) if L else ())
        prev = [q_root, *v_k[:-1]]
        r_k = tuple(v - p for v, p in zip(v_k, prev))
        n_copies = len(copies[c])
        i_k = tuple(t < L - 1 and node.n >= 2 and node.mixed and node.n > n_copies for t, node in enumerate(nodes))
        alone = [t + 1 for t, n in enumerate(n_k) if n == 1]
        d_k = min(alone[0], L) if alone else L
        counts.append(n_k)
        values.append(v_k)
        prs.append(r_k)
        infos.append(i_k)
        depths.append(d_k)
        if L:
            zero_fr.append(sum(1 for x in r_k if x == 0.0) / L)
            info_fr.append(sum(i_k) / L)
            depth_vals.append(d_k)

    common: list[int] = []
    for column in zip(*comps):
        if len(set(column)) != 1:
            break
        common.append(column[0])

    return InducedProcessReward(
        rewards=tuple(outs),
        lengths=tuple(len(c) for c in comps),
        q_root=q_root,
        prefix_counts=tuple(counts),
        values=tuple(values),
        process_rewards=tuple(prs),
        informative=tuple(infos),
        common_prefix=tuple(common),
        divergence_depth=tuple(depths),
        mean_divergence_depth=_mean(depth_vals),
        informative_fraction=_mean(info_fr),
        zero_reward_fraction=_mean(zero_fr),
        kill=not any(any(row) for row in infos),
        key=key,
        identical_mixed=tuple(tuple(ks) for ks in copies.values() if len({outs[k] for k in ks}) > 1),
    )


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else math.nan


GroupLike = Union[RolloutGroup, tuple, dict]


def _as_group(i: int, g: GroupLike) -> RolloutGroup:
    if isinstance(g, RolloutGroup):
        return g
    if isinstance(g, dict):
        return RolloutGroup(str(g.get("key", i)), g["completions"], g["rewards"])
    if isinstance(g, tuple) and len(g) == 2:
        return RolloutGroup(str(i), g[0], g[1])
    raise TypeError(
        f"each group must be a RolloutGroup, a (completions, rewards) pair or a dict with those keys, got {type(g).__name__}."
    )


@dataclass(frozen=True)
class ProcessAudit:
    """The instrument run over every group of a step, a record or a dump: the spec's aggregate table.

    Attributes:
        readings: one :class:`InducedProcessReward` per group.
        source: what was audited (a path, ``"step 12"``, …).
    """

    readings: tuple[InducedProcessReward, ...]
    source: str = ""

    @property
    def n_groups(self) -> int:
        return len(self.readings)

    @property
    def n_killed(self) -> int:
        return sum(1 for r in self.readings if r.kill)

    @property
    def kill_fraction(self) -> float:
        return self.n_killed / self.n_groups if self.n_groups else math.nan

    def _over(self, name: str) -> list[float]:
        return [getattr(r, name) for r in self.readings if not math.isnan(getattr(r, name))]

    @property
    def mean_divergence_depth_range(self) -> tuple[float, float]:
        xs = self._over("mean_divergence_depth")
        return (min(xs), max(xs)) if xs else (math.nan, math.nan)

    @property
    def mean_divergence_depth(self) -> float:
        return _mean(self._over("mean_divergence_depth"))

    @property
    def informative_fraction_max(self) -> float:
        xs = self._over("informative_fraction")
        return max(xs) if xs else math.nan

    @property
    def informative_fraction(self) -> float:
        return _mean(self._over("informative_fraction"))

    @property
    def zero_reward_fraction(self) -> float:
        """``zero_reward_fraction`` averaged over the groups."""
        return _mean(self._over("zero_reward_fraction"))

    @property
    def common_prefix_len_max(self) -> int:
        return max((r.common_prefix_len for r in self.readings), default=0)

    def numbers(self) -> dict[str, Any]:
        lo, hi = self.mean_divergence_depth_range
        return {
            "n_groups": self.n_groups,
            "n_killed": self.n_killed,
            "kill_fraction": self.kill_fraction,
            "mean_divergence_depth": self.mean_divergence_depth,
            "mean_divergence_depth_min": lo,
            "mean_divergence_depth_max": hi,
            "informative_fraction": self.informative_fraction,
            "informative_fraction_max": self.informative_fraction_max,
            "zero_reward_fraction": self.zero_reward_fraction,
            "common_prefix_len_max": self.common_prefix_len_max,
        }

    def verdict(self) -> Union[tuple[bool, str], Refusal]:
        """A :class:`Refusal` when the kill condition fires in every group; else ``(False, reason)``."""
        if self.n_groups and self.n_killed == self.n_groups:
            return Refusal(
                condition="kill",
                reason=(
                    f"the kill condition fires on {self.n_killed} of {self.n_groups} groups: no rollouts share a "
                    "prefix with different outcomes, so the induced process reward is constant past the root and "
                    "is not worth reading here."
                ),
                numbers=self.numbers(),
                remedy=REMEDY,
            )
        if not self.n_groups:
            return (False, "no groups to audit.")
        return (
            False,
            f"the kill condition fires on {self.n_killed} of {self.n_groups} groups; the induced process reward is "
            f"readable on the other {self.n_groups - self.n_killed}.",
        )

    def to_dict(self, prefix: str = "process/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.numbers().items()}

    def render(self) -> str:
        """The aggregate table: kill fires on N of M, depth range, informative maximum, mean zero share."""
        lo, hi = self.mean_divergence_depth_range
        m = self.n_groups
        depth = (
            f"{lo:.2f} in every group" if lo == hi else f"{lo:.2f} to {hi:.2f} (mean {self.mean_divergence_depth:.2f})"
        )
        fmax = self.informative_fraction_max
        info = (
            f"{fmax:.3f}, and that is the maximum over all of them"
            if fmax == 0.0
            else f"maximum {fmax:.3f} (mean {self.informative_fraction:.3f})"
        )
        rows = [
            ("Kill condition fires", f"on {self.n_killed} of {m}"),
            ("Mean divergence depth", depth),
            ("informative_fraction", info),
            (
                "Zero process reward",
                f"{100 * self.zero_reward_fraction:.2f}% of trained positions, averaged over the {m} groups",
            ),
            ("Longest common prefix", f"{self.common_prefix_len_max} tokens at most"),
        ]
        w = max(len(a) for a, _ in rows)
        title = f"G3 outcome -> process reward{' on ' + self.source if self.source else ''}"
        lines = [title, f"{'':<{w}}  Across the {m} groups"]
        lines += [f"{a:<{w}}  {b}" for a, b in rows]
        v = self.verdict()
        lines.append(v.render() if isinstance(v, Refusal) else f"verdict: {v[1]}")
        return "\n".join(lines)


def audit_groups(groups: Any, *, source: str = "", progress: bool = False) -> ProcessAudit:
    """Run :func:`induced_process_reward` on every group (never a sample of them).

    Args:
        groups: :class:`RolloutGroup` objects, ``(completions, rewards)`` pairs, or dicts with those keys;
            or, for every group at once: a step's ``CreditTerms`` (with ``tokens`` and ``rewards``), a
            :class:`~lens_callbacks.io.SkyRLDump`, or a path (run-record directory, dump file, directory of dumps).
        source: what the groups came from (shown in the table).
        progress: show a progress bar on stderr (needs ``tqdm``; silently off without it).

    Example:
        >>> a = audit_groups([([[1, 2], [3, 4]], [1.0, 0.0]), ([[1, 2], [1, 3]], [1.0, 0.0])])
        >>> a.n_killed, a.n_groups, a.mean_divergence_depth_range
        (1, 2, (1.0, 2.0))
    """
    if isinstance(groups, (str, os.PathLike)):
        groups, found = sources.load_groups(groups)
        source = source or found
    elif hasattr(groups, "trained") and hasattr(groups, "group"):
        groups = sources.groups_from_terms(groups)
    elif hasattr(groups, "advantages_per_row") and hasattr(groups, "groups"):
        source = source or f"SkyRL dump {getattr(groups, 'path', '')}"
        groups = sources.groups_from_dump(groups)
    items = list(groups)
    it: Iterable[Any] = enumerate(items)
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(it, total=len(items), desc="process audit", unit="group", file=sys.stderr)
        except ImportError:  # pragma: no cover - tqdm ships with lightning
            pass
    readings = []
    for i, g in it:
        grp = _as_group(i, g)
        readings.append(induced_process_reward(grp.completions, grp.rewards, key=grp.key))
    return ProcessAudit(tuple(readings), source=source)
