r"""Multi-turn trajectories → a padded token batch, with the turn of every position.

:func:`batch_from_trajectories` tokenises each turn's own text and concatenates the pieces, which is
what a trainer does. Tokenising the joined string instead lets the tokeniser merge across a turn
boundary, and a turn decomposition built on merged tokens attributes a token to whichever turn won
the merge (see ``docs/multi_turn.md``, "The merge trap").

:func:`turn_segments` turns the per-position turn index into the ``segment`` ids and names that
:class:`~lens_callbacks.credit.inputs.terms.CreditTerms` carries, and :func:`by_turn` / :func:`by_role` are the
partitions of a turn decomposition. Untrained turns (user, system, tool) are named as parts with no
positions, so they read as an exact zero share rather than being absent from the table.

What this cannot do:
The disintegration is a statement about this gradient at these parameters, so it says where the step
went and not what any turn contributed to the run as a whole. Every number is first-order: removing a
turn does not remove its share, because removing it changes every downstream position. And a record
whose trajectories have a single trained turn (one user turn, one assistant turn, no tool calls)
cannot support a turn-concentration claim: :func:`turn_claim_support` says so by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from ...refusal import Refusal
from .partition import MissingSegmentsError, Partition, trained_segments
from .terms import CreditTerms

__all__ = [
    "ROLES",
    "ToolCall",
    "Turn",
    "Trajectory",
    "TrajectoryBatch",
    "TurnSegments",
    "batch_from_trajectories",
    "encode_text",
    "turn_segments",
    "by_turn",
    "by_role",
    "turn_claim_support",
]

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
_PADDING = ("right", "left")
_TRUNCATION = ("error", "left", "right")
_SEGMENT_BY = ("turn", "role", "turn_index")


@dataclass(frozen=True)
class ToolCall:
    """A tool call made by an assistant turn: the tool's ``name`` and its ``arguments`` (a string)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Turn:
    """One turn of a trajectory.

    Attributes:
        role: one of ``"system"``, ``"user"``, ``"assistant"``, ``"tool"``.
        text: the turn's own text.
        token_ids: the token ids the policy saw or sampled for this turn; ``None`` → tokenise ``text``.
            Sampled ids are kept as they are (a re-tokenised decode need not reproduce them).
        trained: whether the turn's tokens are trained; ``None`` → trained iff ``role == "assistant"``.
        tool_call: the tool call this (assistant) turn made, if any.
    """

    role: str
    text: str
    token_ids: Optional[tuple[int, ...]] = None
    trained: Optional[bool] = None
    tool_call: Optional[ToolCall] = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"`role` must be one of {ROLES}, got {self.role!r}.")
        if not isinstance(self.text, str):
            raise ValueError(f"`text` must be a str, got {type(self.text).__name__}.")
        if self.token_ids is not None:
            ids = tuple(int(i) for i in self.token_ids)
            object.__setattr__(self, "token_ids", ids)


@dataclass(frozen=True)
class Trajectory:
    """One rollout: its turns, outcome reward and where it came from.

    Attributes:
        turns: the turns in order.
        reward: the outcome reward of the whole trajectory.
        group: the prompt group (GRPO: the rollouts of one prompt share it).
        rollout: the rollout id (unique within a step).
        prompt_id: a stable id of the prompt.
        step: the training step that sampled and trained on it.
    """

    turns: tuple[Turn, ...]
    reward: float = 0.0
    group: int = 0
    rollout: int = 0
    prompt_id: str = ""
    step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "turns", tuple(self.turns))
        for t in self.turns:
            if not isinstance(t, Turn):
                raise ValueError(f"`turns` must hold Turn objects, got {type(t).__name__}.")

    @property
    def n_tool_calls(self) -> int:
        return sum(t.tool_call is not None for t in self.turns)


@dataclass(frozen=True)
class TrajectoryBatch:
    """A padded batch of trajectories (what a policy's forward pass takes).

    Attributes:
        input_ids: ``[B, T]`` token ids (pad id at padding).
        attention_mask: ``[B, T]`` 1 on real tokens, 0 on padding.
        position_ids: ``[B, T]`` 0-based position within the row's real tokens (0 on padding), so
            left and right padding give the model the same positions.
        trained: ``[B, T]`` bool, the positions of trained turns.
        rollout: ``[B]`` rollout id per row. group: ``[B]`` prompt group per row.
        rewards: ``[B]`` float64 outcome reward per row.
        padding_side: ``"right"`` or ``"left"``. pad_token_id: the id used at padding.
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    trained: torch.Tensor  # [B, T]
    rollout: torch.Tensor  # [B]
    group: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    padding_side: str = "right"
    pad_token_id: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def to(self, device: Union[str, torch.device]) -> "TrajectoryBatch":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TrajectoryBatch(**kw)


@dataclass(frozen=True)
class TurnSegments:
    """The turn of every position of a :class:`TrajectoryBatch`.

    Attributes:
        ids: ``[B, T]`` turn index within its trajectory, ``-1`` at padding.
        roles: per row, the role of each turn (indexed by turn index).
        trained_turns: per row, whether each turn is trained.
        spans: per row, ``(start, end)`` column span of each turn in the padded batch (``end`` exclusive;
            ``(start, start)`` for a turn that truncation removed).
        truncated: per row, how many tokens truncation dropped (0 without truncation).
    """

    ids: torch.Tensor  # [B, T]
    roles: tuple[tuple[str, ...], ...]
    trained_turns: tuple[tuple[bool, ...], ...]
    spans: tuple[tuple[tuple[int, int], ...], ...]
    truncated: tuple[int, ...] = field(default=())

    @property
    def n_turns(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.roles)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, from any ``encode``-style tokenizer.

    Accepts a ``transformers`` tokenizer (``encode(text, add_special_tokens=False)``), a ``tokenizers``
    ``Tokenizer`` (``encode(...)`` returning an ``Encoding`` with ``.ids``) or any object whose
    ``encode(text)`` returns a sequence of ints.
    """
    enc = getattr(tokenizer, "encode", None)
    if enc is None or not callable(enc):
        raise TypeError(
            f"`tokenizer` must have an `encode(text)` method returning token ids, got {type(tokenizer).__name__}."
        )
    try:
        out = enc(text, add_special_tokens=False)
    except TypeError:
        out = enc(text)
    if hasattr(out, "ids"):
        out = out.ids
    if isinstance(out, torch.Tensor):
        out = out.reshape(-1).tolist()
    return [int(i) for i in out]


def _pad_id(tokenizer: Any, pad_token_id: Optional[int]) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    raise ValueError(
        f"`pad_token_id` must be given when the tokenizer has no pad or eos token id, got None "
        f"(tokenizer {type(tokenizer).__name__}); pass pad_token_id=<id> (any id: padding is masked)."
    )


def batch_from_trajectories(
    tokenizer: Any,
    trajectories: Sequence[Trajectory],
    *,
    train_roles: Optional[Sequence[str]] = None,
    padding_side: str = "right",
    max_length: Optional[int] = None,
    truncation: str = "error",
    pad_token_id: Optional[int] = None,
    use_token_ids: bool = True,
) -> tuple[TrajectoryBatch, TurnSegments]:
    r"""Tokenise each turn's own text, concatenate, pad, and record the turn of every position.

    Row ``k`` is ``ids(turn_0) ⧺ ids(turn_1) ⧺ …`` where ``ids(turn)`` is ``turn.token_ids`` when
    recorded (the ids the policy actually saw or sampled) and ``encode(turn.text)`` otherwise — never
    ``encode(turn_0.text + turn_1.text + …)``, which can merge a token across a turn boundary.

    Args:
        tokenizer: a ``transformers`` tokenizer or any object with an ``encode``-style call
            (see :func:`encode_text`).
        trajectories: the trajectories of one step.
        train_roles: roles whose turns are trained. ``None`` (default): each turn's own ``trained``
            flag, else ``role == "assistant"``. Given: exactly the turns whose role is listed.
        padding_side: ``"right"`` (default) or ``"left"``.
        max_length: longest row allowed (``None``: no limit).
        truncation: what to do with a row longer than ``max_length``: ``"error"`` (default) raises;
            ``"left"`` keeps the last ``max_length`` tokens, ``"right"`` the first. Tokens, trained mask
            and turn ids are cut together, never shifted against each other; the number dropped is in
            ``segments.truncated``. A left cut that would leave a trained token first raises.
        pad_token_id: the padding id (default: the tokenizer's pad, else eos id).
        use_token_ids: use recorded ``token_ids`` where present (default); ``False`` re-tokenises text.

    Returns:
        ``(batch, segments)``: a :class:`TrajectoryBatch` and its :class:`TurnSegments`.

    Raises:
        ValueError: no trajectories, a trajectory without turns, a turn that tokenises to nothing, a
            trained token at the first position of a row (it has no context), an over-long row under
            ``truncation="error"``, or a bad option.

    Example:
        >>> class Chars:                       # any object with an encode-style call
        ...     pad_token_id = 0
        ...     def encode(self, text):
        ...         return [ord(c) for c in text]
        >>> t = Trajectory((Turn("user", "ab"), Turn("assistant", "c"), Turn("tool", "d"), Turn("assistant", "ef")))
        >>> batch, seg = batch_from_trajectories(Chars(), [t])
        >>> seg.ids.tolist(), batch.trained.int().tolist()
        ([[0, 0, 1, 2, 3, 3]], [[0, 0, 1, 0, 1, 1]])
    """
    if padding_side not in _PADDING:
        raise ValueError(f"`padding_side` must be one of {_PADDING}, got {padding_side!r}.")
    if truncation not in _TRUNCATION:
        raise ValueError(f"`truncation` must be one of {_TRUNCATION}, got {truncation!r}.")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"`max_length` must be an int >= 2 or None, got {max_length!r}.")
    if train_roles is not None:
        bad = [r for r in train_roles if r not in ROLES]
        if bad:
            raise ValueError(f"`train_roles` must be roles from {ROLES}, got {list(train_roles)!r}.")
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("`trajectories` must hold at least one trajectory, got an empty list.")
    pad = _pad_id(tokenizer, pad_token_id)

    rows: list[tuple[list[int], list[bool], list[int], list[tuple[int, int]]]] = []  # ids, trained, turn, spans
    roles: list[tuple[str, ...]] = []
    trained_turns: list[tuple[bool, ...]] = []
    truncated: list[int] = []
    for k, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ValueError(f"`trajectories[{k}]` must be a Trajectory, got {type(traj).__name__}.")
        if not traj.turns:
            raise ValueError(
                f"`trajectories[{k}]` (rollout {traj.rollout}) has no turns; every trajectory needs at least one."
            )
        ids: list[int] = []
        tmask: list[bool] = []
        tid: list[int] = []
        r_roles: list[str] = []
        r_trained: list[bool] = []
        r_spans: list[tuple[int, int]] = []
        for j, turn in enumerate(traj.turns):
            piece = (
                list(turn.token_ids)
                if (use_token_ids and turn.token_ids is not None)
                else encode_text(tokenizer, turn.text)
            )
            if not piece:
                raise ValueError(
                    f"turn {j} ({turn.role}) of `trajectories[{k}]` tokenises to nothing (text {turn.text!r}); "
                    "drop the turn or give it text: a turn without tokens has no position to carry its credit."
                )
            if train_roles is not None:
                tr = turn.role in train_roles
            else:
                tr = turn.trained if turn.trained is not None else turn.role == "assistant"
            r_spans.append((len(ids), len(ids) + len(piece)))
            ids.extend(piece)
            tmask.extend([tr] * len(piece))
            tid.extend([j] * len(piece))
            r_roles.append(turn.role)
            r_trained.append(bool(tr))
        drop = 0
        if max_length is not None and len(ids) > max_length:
            if truncation == "error":
                raise ValueError(
                    f"`trajectories[{k}]` (rollout {traj.rollout}) is {len(ids)} tokens long, over max_length={max_length}; "
                    "raise `max_length` or pass truncation='left' (keep the last tokens) or 'right' (keep the first)."
                )
            drop = len(ids) - max_length
            sl = slice(drop, None) if truncation == "left" else slice(0, max_length)
            ids, tmask, tid = ids[sl], tmask[sl], tid[sl]
            if truncation == "left":
                r_spans = [(max(a - drop, 0), max(b - drop, 0)) for a, b in r_spans]
            else:
                r_spans = [(min(a, max_length), min(b, max_length)) for a, b in r_spans]
        if tmask[0]:
            raise ValueError(
                f"`trajectories[{k}]` (rollout {traj.rollout}) starts with a trained token: the first position has no "
                "context to be predicted from. Open the trajectory with a system or user turn."
            )
        rows.append((ids, tmask, tid, r_spans))
        roles.append(tuple(r_roles))
        trained_turns.append(tuple(r_trained))
        truncated.append(drop)

    B = len(rows)
    T = max(len(r[0]) for r in rows)
    input_ids = torch.full((B, T), pad, dtype=torch.long)  # [B, T]
    attention = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    positions = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    trained = torch.zeros((B, T), dtype=torch.bool)  # [B, T]
    seg = torch.full((B, T), -1, dtype=torch.long)  # [B, T]
    spans: list[tuple[tuple[int, int], ...]] = []
    for k, (ids, tmask, tid, r_spans) in enumerate(rows):
        n = len(ids)
        off = 0 if padding_side == "right" else T - n
        cols = slice(off, off + n)
        input_ids[k, cols] = torch.tensor(ids, dtype=torch.long)
        attention[k, cols] = 1
        positions[k, cols] = torch.arange(n)
        trained[k, cols] = torch.tensor(tmask, dtype=torch.bool)
        seg[k, cols] = torch.tensor(tid, dtype=torch.long)
        spans.append(tuple((off + a, off + b) for a, b in r_spans))

    batch = TrajectoryBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        trained=trained,
        rollout=torch.tensor([t.rollout for t in trajectories], dtype=torch.long),
        group=torch.tensor([t.group for t in trajectories], dtype=torch.long),
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64),
        padding_side=padding_side,
        pad_token_id=pad,
    )
    segments = TurnSegments(seg, tuple(roles), tuple(trained_turns), tuple(spans), tuple(truncated))
    return batch, segments


def turn_segments(
    segments: TurnSegments, by: str = "turn", rollout: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The ``segment`` ids and ``segment_names`` a turn decomposition needs (for :class:`CreditTerms`).

    Args:
        segments: what :func:`batch_from_trajectories` returned.
        by: ``"turn"`` (default): one segment per turn of each trajectory, named
            ``"rollout_{k}/turn_{j}:{role}"`` — the decomposition of the step into its turns;
            ``"role"``: one segment per role present (``"system"``, ``"user"``, ``"assistant"``,
            ``"tool"``), pooled over rows and turns; ``"turn_index"``: turn ``j`` of every row pooled,
            named ``"turn_{j}"``.
        rollout: ``[B]`` rollout ids used in the names (default: the row index).

    Returns:
        ``(segment [B, T] long, names)``: every position of a turn carries its segment id, padding -1.
        Every turn is named, trained or not; :func:`by_turn` keeps untrained ones as zero-share parts.

    Example:
        >>> ids = torch.tensor([[0, 0, 1, 2, 2, -1]])
        >>> seg = TurnSegments(ids, (("user", "assistant", "tool"),), ((False, True, False),), (((0, 2), (2, 3), (3, 5)),))
        >>> turn_segments(seg, "role")
        (tensor([[ 0,  0,  1,  2,  2, -1]]), ('user', 'assistant', 'tool'))
    """
    if by not in _SEGMENT_BY:
        raise ValueError(f"`by` must be one of {_SEGMENT_BY}, got {by!r}.")
    ids = segments.ids
    out = torch.full_like(ids, -1)  # [B, T]
    B = ids.shape[0]
    rid = list(range(B)) if rollout is None else [int(r) for r in rollout.tolist()]
    names: list[str] = []
    if by == "turn":
        counts = torch.tensor([0] + [len(r) for r in segments.roles[:-1]], dtype=torch.long)
        first = torch.cumsum(counts, 0).to(ids.device)  # [B] id of each row's turn 0
        out = torch.where(ids >= 0, ids + first[:, None], out)  # [B, T]
        for k in range(B):
            names.extend(f"rollout_{rid[k]}/turn_{j}:{role}" for j, role in enumerate(segments.roles[k]))
    elif by == "role":
        present = [r for r in ROLES if any(r in row for row in segments.roles)]
        index = {r: i for i, r in enumerate(present)}
        for k in range(B):
            for j, role in enumerate(segments.roles[k]):
                out[k][ids[k] == j] = index[role]
        names = present
    else:
        n = max(segments.n_turns)
        out = ids.clone()
        names = [f"turn_{j}" for j in range(n)]
    return out, tuple(names)


def by_turn(terms: CreditTerms) -> Partition:
    """One part per named segment, trained or not: the turn decomposition.

    Needs ``terms.segment`` and ``terms.segment_names`` (from :func:`turn_segments`). A segment with no
    trained position (a user, system or tool turn) is still a part, with no positions, so its share is
    exactly zero in the report rather than missing from it.
    """
    if terms.segment is None or terms.segment_names is None:
        raise MissingSegmentsError(
            "`by_turn` needs `CreditTerms.segment` and `segment_names`, got None; return them from `credit_terms` "
            "with `segment, names = turn_segments(segments)`."
        )
    seg, trained = trained_segments(terms)
    n = len(terms.segment_names)
    if int(seg.max()) >= n:
        raise ValueError(f"`segment` ids must be < len(segment_names) = {n}, got {int(seg.max())}.")
    ids = torch.where(trained, seg, torch.full_like(seg, -1))  # [B, T]
    return Partition(ids.to(terms.trained.device), tuple(terms.segment_names))


def by_role(terms: CreditTerms) -> Partition:
    """One part per role (pooled over rows and turns), untrained roles as zero-share parts.

    Reads the role from the segment names (``"…:{role}"`` from ``turn_segments(by="turn")``, or the
    bare role from ``by="role"``).
    """
    p = by_turn(terms)
    role_of = [n.rsplit(":", 1)[-1] for n in p.names]
    unknown = sorted({r for r in role_of if r not in ROLES})
    if unknown:
        raise ValueError(
            f"`by_role` needs segment names that end in a role {ROLES}, got {unknown[:3]!r}; "
            "build them with turn_segments(by='turn') or by='role'."
        )
    present = [r for r in ROLES if r in role_of]
    lut = torch.tensor([present.index(r) for r in role_of] + [-1], dtype=torch.long)  # [n + 1]
    ids = lut[p.ids.cpu()]  # -1 indexes the trailing -1
    return Partition(ids.to(p.ids.device), tuple(present))


def turn_claim_support(trajectories: Iterable[Trajectory]) -> Union[tuple[bool, str], Refusal]:
    """Whether a set of trajectories can support a claim about which turn got the credit.

    A turn-concentration claim compares trained turns with each other, so it needs trajectories with
    at least two trained turns. A record of two-turn trajectories (one user, one assistant, no tool
    calls) cannot carry it: the decomposition is exact there, and it can only say that the one trained
    turn got all the credit.

    Returns:
        ``(True, reason)`` when some trajectory has two or more trained turns, else a
        :class:`~lens_callbacks.refusal.Refusal` with the counts.
    """
    trajs = list(trajectories)
    if not trajs:
        return Refusal("no_trajectories", "there are no trajectories to read.", remedy="record some steps first")
    trained_per = [
        sum(bool(t.trained) if t.trained is not None else t.role == "assistant" for t in tr.turns) for tr in trajs
    ]
    turns = [len(tr.turns) for tr in trajs]
    calls = sum(tr.n_tool_calls for tr in trajs)
    multi = sum(n >= 2 for n in trained_per)
    numbers = {
        "n_trajectories": len(trajs),
        "mean_turns": sum(turns) / len(trajs),
        "max_trained_turns": max(trained_per),
        "n_tool_calls": calls,
        "n_multi_trained": multi,
    }
    if multi == 0:
        return Refusal(
            "single_trained_turn",
            f"every one of the {len(trajs)} trajectories has at most one trained turn (mean {numbers['mean_turns']:.2f} "
            f"turns, {calls} tool calls): the turn decomposition can only put the whole credit on that turn, so the "
            "record cannot support a turn-concentration claim.",
            numbers,
            remedy="record multi-turn trajectories (tool calls, several assistant turns), e.g. lens_callbacks/examples/grpo_tools",
        )
    return True, f"{multi} of {len(trajs)} trajectories have two or more trained turns ({calls} tool calls)."
