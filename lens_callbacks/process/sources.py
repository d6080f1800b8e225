"""Where the instrument's groups come from: a step's CreditTerms, a run record, a SkyRL dump."""

from __future__ import annotations

import fnmatch
import glob
import os
from typing import Any, Optional, Sequence, Union

import torch

from ..credit.inputs.terms import validate_terms
from .groups import RolloutGroup

__all__ = [
    "groups_from_terms",
    "groups_from_record",
    "groups_from_dump",
    "load_groups",
]


def groups_from_terms(terms: Any, *, prefix: str = "") -> list[RolloutGroup]:
    """One group per distinct ``terms.group`` id: trained tokens and outcome rewards of its rows.

    Needs ``terms.tokens`` (``[B, T]`` token ids) and ``terms.rewards`` (``[B]`` outcomes); raises
    ``ValueError`` naming the missing field otherwise, and checks the rest of the contract as every audit
    does (:func:`~lens_callbacks.credit.inputs.terms.validate_terms`).
    """
    for name in ("tokens", "rewards"):
        if getattr(terms, name, None) is None:
            raise ValueError(
                f"`CreditTerms.{name}` must be set for the process instrument, got None. Return "
                "`tokens` ([B, T] token ids) and `rewards` ([B] outcome rewards) from `credit_terms`."
            )
    validate_terms(terms)
    tokens = terms.tokens.detach().cpu()  # [B, T]
    trained = terms.trained.detach().cpu()  # [B, T]
    rewards = terms.rewards.detach().cpu().double()  # [B]
    group = terms.group.detach().cpu()  # [B]
    out = []
    for g in torch.unique(group, sorted=True).tolist():
        rows = (group == g).nonzero().flatten().tolist()
        comps = [tokens[r][trained[r]].tolist() for r in rows]
        out.append(RolloutGroup(f"{prefix}{g}", comps, [float(rewards[r]) for r in rows]))
    return out


def _record_files(run_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(glob.escape(run_dir), "trajectories", "step_*.jsonl")))
    if not files:
        raise FileNotFoundError(
            f"`run_dir` must hold trajectories/step_*.jsonl (a run record), got none under {run_dir!r}."
        )
    from ..io.budget import same_file_as

    dup = same_file_as(files)
    if dup:  # one file under two step names would count its groups twice
        a, b = next(iter(dup.items()))
        raise ValueError(
            f"{a}: the trajectory file is the same file as {b} (a link); every step needs its own; refused."
        )
    return files


def groups_from_record(
    run_dir: Union[str, "os.PathLike[str]"], steps: Optional[Sequence[int]] = None
) -> list[RolloutGroup]:
    """Every group of every step of a run record (``trajectories/step_{N:06d}.jsonl``).

    A trajectory's completion is the token ids of its trained turns, in order (``trained`` unset means
    assistant turns, as in :class:`~lens_callbacks.credit.inputs.trajectories.Turn`); groups are keyed by
    ``(step, group)`` in file order. Lines are parsed and validated by the record reader, so its errors
    name the file and line.
    """
    from ..io.budget import HeldBudget
    from ..io.records import iter_trajectories

    wanted = None if steps is None else {int(s) for s in steps}
    # Keyed by the group's name, a str: str hashes are randomized per process, while the hash of an int tuple
    # (step, group) is not, and a file can choose 40,000 pairs that all hash alike (a quadratic dict).
    groups: dict[str, tuple[list[list[int]], list[float]]] = {}
    run_dir = os.fspath(run_dir)
    budget = HeldBudget()  # what the groups keep, over every step's file
    for path in _record_files(run_dir):
        for traj in iter_trajectories(path, budget.limits, run_dir, budget):
            if wanted is not None and traj.step not in wanted:
                continue
            comp: list[int] = []
            for j, turn in enumerate(traj.turns):
                trained = turn.trained if turn.trained is not None else turn.role == "assistant"
                if not trained:
                    continue
                if turn.token_ids is None:
                    raise ValueError(
                        f"{path}: rollout {traj.rollout}, turn {j} is trained but has no `token_ids`; the process "
                        "instrument reads the sampled tokens, so record them."
                    )
                comp.extend(turn.token_ids)
            budget.charge(_held(len(comp)), path, f"the groups read so far ({len(groups):,})")
            comps, rewards = groups.setdefault(f"step{traj.step}/group{traj.group}", ([], []))
            comps.append(comp)
            rewards.append(traj.reward)
    return [RolloutGroup(name, c, r) for name, (c, r) in groups.items()]


def _held(n_tokens: int) -> int:
    """What one kept completion costs at most: its list, 40 bytes a token id, its reward, its group's share."""
    return 400 + 40 * n_tokens


def groups_from_dump(dump: Any) -> list[RolloutGroup]:
    """Every prompt group of a :class:`~lens_callbacks.io.SkyRLDump`.

    SkyRL pops ``rewards`` before the dump, so the per-row GRPO advantage stands in for the outcome. Within
    a group it is a positive affine map of the reward, ``(R − mean)/(std + ε)``, under which ``n(s)``, the
    divergence depth, the informative and zero shares and the kill condition are unchanged; the process
    rewards come out in advantage units.
    """
    adv = dump.advantages_per_row()  # [N]
    out = []
    for g, rows in enumerate(dump.groups):
        out.append(RolloutGroup(str(g), [dump.trained_tokens(r) for r in rows], [float(adv[r]) for r in rows]))
    return out


def load_groups(path: Union[str, "os.PathLike[str]"]) -> tuple[list[RolloutGroup], str]:
    """Groups from a run-record directory, a SkyRL dump file, or a directory of dumps.

    Returns ``(groups, description)``.
    """
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isdir(os.path.join(path, "trajectories")):
        groups = groups_from_record(path)
        return groups, f"run record {path}"
    from ..io.skyrl import read_skyrl_dump

    if os.path.isdir(path):
        from ..io.budget import HeldBudget, same_file_as, walk_files

        # Walked without following links to folders (a link loop ends); a link to a file outside is refused by name.
        dumps = walk_files(path, lambda n: fnmatch.fnmatchcase(n, "global_step_*_training_input.pkl"), "SkyRL dump")
        dup = same_file_as(dumps)
        dumps = [p for p in dumps if p not in dup]  # a dump reached through two names is read once
        if not dumps:
            raise FileNotFoundError(
                f"`path` must be a run record (with trajectories/) or a SkyRL dump, got a directory with neither: {path!r}."
            )
        groups: list[RolloutGroup] = []
        budget = HeldBudget()  # what the groups keep, over every dump
        for p in dumps:
            d = read_skyrl_dump(p)
            new = [RolloutGroup(f"step{d.step}/group{g.key}", g.completions, g.rewards) for g in groups_from_dump(d)]
            del d
            budget.charge(
                sum(_held(len(c)) for g in new for c in g.completions),
                p,
                f"the groups of {len(groups) + len(new):,} so far",
            )
            groups += new
        return groups, f"{len(dumps)} SkyRL dumps under {path} (advantage as outcome)"
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"`path` must be a run record directory or a SkyRL dump file, got {path!r} (no such path)."
        )
    d = read_skyrl_dump(path)
    return groups_from_dump(d), f"SkyRL dump {path} (step {d.step}, advantage as outcome)"
