"""The run record: every step's trajectories as JSON Lines, plus the policy at step 0.

Layout of ``<run_dir>/`` (documented in ``docs/record_schema.md``)::

    record.json                       manifest (schema, module, init args, optimizer, steps, checkpoints)
    trajectories/step_000000.jsonl    one trajectory per line, schema "lens_callbacks.trajectory/1"
    steps/step_000000.json            optional: what else a replay of the step needs (lr, dropout seed)
    policy_step_000000.pt             the module's state_dict() before the first optimizer step
    policy_step_{N:06d}.pt            optional further checkpoints (every ``checkpoint_every`` steps)

One line::

    {"schema": "lens_callbacks.trajectory/1", "step": 3, "group": 0, "rollout": 2, "prompt_id": "7+5",
     "reward": 0.5, "turns": [{"role": "user", "text": "7 + 5 =", "token_ids": [...], "trained": false,
     "tool_call": null}, {"role": "assistant", ..., "trained": true, "tool_call": {"name": "calc",
     "arguments": "7 + 5"}}, ...]}

Floats are written with ``repr`` precision and token ids as ints, so write → read rebuilds the same batch
bit for bit. Pure python/torch: no lightning here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch

from ..credit.trajectories import ROLES, ToolCall, Trajectory, Turn

__all__ = [
    "TRAJECTORY_SCHEMA",
    "RECORD_SCHEMA",
    "trajectory_to_json",
    "trajectory_from_json",
    "write_trajectories",
    "read_trajectories",
    "RunRecordWriter",
    "RunRecord",
    "step_path",
    "policy_path",
    "meta_path",
]

TRAJECTORY_SCHEMA = "lens_callbacks.trajectory/1"
RECORD_SCHEMA = "lens_callbacks.record/1"
_MANIFEST = "record.json"

PathLike = Union[str, os.PathLike]


def step_path(run_dir: PathLike, step: int) -> Path:
    return Path(run_dir) / "trajectories" / f"step_{int(step):06d}.jsonl"


def meta_path(run_dir: PathLike, step: int) -> Path:
    # Kept out of trajectories/ so that a reader globbing it sees trajectory files only.
    return Path(run_dir) / "steps" / f"step_{int(step):06d}.json"


def policy_path(run_dir: PathLike, step: int) -> Path:
    return Path(run_dir) / f"policy_step_{int(step):06d}.pt"


def trajectory_to_json(traj: Trajectory, step: Optional[int] = None) -> dict[str, Any]:
    """One record line as a dict. ``trained`` is written resolved (assistant turns by default)."""
    reward = float(traj.reward)
    if not math.isfinite(reward):
        raise ValueError(f"`reward` must be finite to be recorded, got {reward!r} (rollout {traj.rollout}).")
    turns = []
    for t in traj.turns:
        turns.append(
            {
                "role": t.role,
                "text": t.text,
                "token_ids": None if t.token_ids is None else [int(i) for i in t.token_ids],
                "trained": bool(t.trained) if t.trained is not None else t.role == "assistant",
                "tool_call": None if t.tool_call is None else {"name": t.tool_call.name, "arguments": t.tool_call.arguments},
            }
        )
    return {
        "schema": TRAJECTORY_SCHEMA,
        "step": int(traj.step if step is None else step),
        "group": int(traj.group),
        "rollout": int(traj.rollout),
        "prompt_id": str(traj.prompt_id),
        "reward": reward,
        "turns": turns,
    }


def _need(d: Mapping[str, Any], key: str, types: tuple, where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}: field `{key}` is missing.")
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise ValueError(f"{where}: field `{key}` must be {names}, got {v!r}.")
    return v


def trajectory_from_json(d: Mapping[str, Any], where: str = "record line") -> Trajectory:
    """Parse and validate one record line (schema ``lens_callbacks.trajectory/1``)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: must be a JSON object, got {type(d).__name__}.")
    schema = d.get("schema")
    if schema != TRAJECTORY_SCHEMA:
        raise ValueError(f"{where}: `schema` must be {TRAJECTORY_SCHEMA!r}, got {schema!r}.")
    turns_raw = _need(d, "turns", (list,), where)
    turns = []
    for j, t in enumerate(turns_raw):
        w = f"{where}, turn {j}"
        if not isinstance(t, Mapping):
            raise ValueError(f"{w}: must be a JSON object, got {type(t).__name__}.")
        role = _need(t, "role", (str,), w)
        if role not in ROLES:
            raise ValueError(f"{w}: `role` must be one of {ROLES}, got {role!r}.")
        ids = t.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"{w}: `token_ids` must be a list of ints or null, got {ids!r}.")
        call = t.get("tool_call")
        if call is not None:
            if not isinstance(call, Mapping):
                raise ValueError(f"{w}: `tool_call` must be null or {{'name', 'arguments'}}, got {call!r}.")
            call = ToolCall(_need(call, "name", (str,), w + " tool_call"), _need(call, "arguments", (str,), w + " tool_call"))
        trained = t.get("trained")
        if trained is not None and not isinstance(trained, bool):
            raise ValueError(f"{w}: `trained` must be true/false, got {trained!r}.")
        turns.append(Turn(role, _need(t, "text", (str,), w), None if ids is None else tuple(ids), trained, call))
    return Trajectory(
        turns=tuple(turns),
        reward=float(_need(d, "reward", (int, float), where)),
        group=int(_need(d, "group", (int,), where)),
        rollout=int(_need(d, "rollout", (int,), where)),
        prompt_id=str(_need(d, "prompt_id", (str,), where)),
        step=int(_need(d, "step", (int,), where)),
    )


def write_trajectories(path: PathLike, trajectories: Iterable[Trajectory], step: Optional[int] = None) -> Path:
    """Write one JSON line per trajectory (atomically: a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(trajectory_to_json(t, step), ensure_ascii=False, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def read_trajectories(path: PathLike) -> list[Trajectory]:
    """Read a ``.jsonl`` file of trajectories; errors name the file and line."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.name}:{n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err}).") from err
            out.append(trajectory_from_json(d, where))
    return out


def _plain(v: Any) -> Any:
    """JSON-safe copy of init args / optimizer settings (tuples → lists, tensors → lists)."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


class RunRecordWriter:
    """Writes a run record. Trainer-free: examples and :class:`RunRecordCallback` both use it.

    Args:
        run_dir: the record's directory (created).
        checkpoint_every: also save the policy every this many steps (0: only step 0). Offline audits
            replay from the nearest checkpoint at or before the step.
        overwrite: allow writing into a directory that already holds a record.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> w = RunRecordWriter(d)
        >>> w.write_manifest(module="m.M", init_args={"lr": 0.1})
        >>> _ = w.write_step(0, [Trajectory((Turn("user", "hi", (1,)), Turn("assistant", "yo", (2,))), reward=1.0)])
        >>> RunRecord(d).steps, RunRecord(d).trajectories(0)[0].turns[1].trained
        ([0], True)
    """

    def __init__(self, run_dir: PathLike, checkpoint_every: int = 0, overwrite: bool = True) -> None:
        if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ValueError(f"`checkpoint_every` must be an int >= 0, got {checkpoint_every!r}.")
        self.run_dir = Path(run_dir)
        if (self.run_dir / _MANIFEST).exists() and not overwrite:
            raise ValueError(f"`run_dir` {str(self.run_dir)!r} already holds a record; pass overwrite=True or pick a new directory.")
        self.checkpoint_every = checkpoint_every
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._manifest: dict[str, Any] = {"schema": RECORD_SCHEMA, "trajectory_schema": TRAJECTORY_SCHEMA, "steps": [], "checkpoints": []}
        if (self.run_dir / _MANIFEST).exists():
            old = json.loads((self.run_dir / _MANIFEST).read_text())
            if old.get("schema") == RECORD_SCHEMA:
                self._manifest.update(old)

    @property
    def manifest(self) -> dict[str, Any]:
        return dict(self._manifest)

    def write_manifest(self, **fields: Any) -> None:
        """Merge fields into ``record.json`` (module class path, init args, optimizer, trainer settings)."""
        self._manifest.update(_plain(fields))
        self._flush()

    def wants_checkpoint(self, step: int) -> bool:
        return step == 0 or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0)

    def write_policy(self, step: int, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """Save a policy state (tensors cloned to CPU) as ``policy_step_{step:06d}.pt``."""
        path = policy_path(self.run_dir, step)
        state = {k: v.detach().to("cpu").clone() for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        if int(step) not in self._manifest["checkpoints"]:
            self._manifest["checkpoints"] = sorted(self._manifest["checkpoints"] + [int(step)])
            self._flush()
        return path

    def write_step(self, step: int, trajectories: Sequence[Trajectory], meta: Optional[Mapping[str, Any]] = None) -> Path:
        """Write the trajectories the policy trained on at ``step`` (and ``meta``, e.g. a dropout seed)."""
        if meta:
            mpath = meta_path(self.run_dir, step)
            mpath.parent.mkdir(parents=True, exist_ok=True)
            mpath.write_text(json.dumps(_plain(dict(meta)), sort_keys=True, allow_nan=False))
        path = write_trajectories(step_path(self.run_dir, step), trajectories, step)
        if int(step) not in self._manifest["steps"]:
            self._manifest["steps"] = sorted(self._manifest["steps"] + [int(step)])
            self._flush()
        return path

    def _flush(self) -> None:
        tmp = self.run_dir / (_MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self._manifest, indent=2, sort_keys=True, allow_nan=False))
        os.replace(tmp, self.run_dir / _MANIFEST)


class RunRecord:
    """Reads a run record written by :class:`RunRecordWriter`."""

    def __init__(self, run_dir: PathLike) -> None:
        self.run_dir = Path(run_dir)
        mpath = self.run_dir / _MANIFEST
        if not mpath.is_file():
            raise ValueError(
                f"`run_dir` must hold a run record ({_MANIFEST}), got {str(self.run_dir)!r} without one; "
                "write records with RunRecordCallback or RunRecordWriter."
            )
        self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        if self.manifest.get("schema") != RECORD_SCHEMA:
            raise ValueError(f"{mpath}: `schema` must be {RECORD_SCHEMA!r}, got {self.manifest.get('schema')!r}.")

    @property
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self.manifest.get("steps", []))

    @property
    def checkpoints(self) -> list[int]:
        return sorted(int(s) for s in self.manifest.get("checkpoints", []))

    def trajectories(self, step: int) -> list[Trajectory]:
        path = step_path(self.run_dir, step)
        if not path.is_file():
            raise ValueError(f"`step` must be a recorded step ({_ranges(self.steps)}), got {step!r}: {path} is missing.")
        return read_trajectories(path)

    def step_meta(self, step: int) -> dict[str, Any]:
        """What the module needs besides the trajectories to rebuild its batch (``{}`` when nothing)."""
        path = meta_path(self.run_dir, step)
        return json.loads(path.read_text()) if path.is_file() else {}

    def iter_steps(self, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[int, list[Trajectory]]]:
        for s in self.steps:
            if s >= start and (stop is None or s < stop):
                yield s, self.trajectories(s)

    def load_policy(self, step: int) -> dict[str, torch.Tensor]:
        path = policy_path(self.run_dir, step)
        if not path.is_file():
            raise ValueError(f"no policy checkpoint at step {step} (have {self.checkpoints}): {path} is missing.")
        return torch.load(path, map_location="cpu", weights_only=True)

    def nearest_checkpoint(self, step: int) -> int:
        """The latest checkpoint at or before ``step``."""
        before = [c for c in self.checkpoints if c <= step]
        if not before:
            raise ValueError(f"the record has no policy checkpoint at or before step {step} (have {self.checkpoints}).")
        return before[-1]


def _ranges(steps: Sequence[int]) -> str:
    if not steps:
        return "none recorded"
    return f"{len(steps)} steps, {steps[0]}..{steps[-1]}"
