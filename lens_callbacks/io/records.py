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

from ..credit.inputs.trajectories import ROLES, ToolCall, Trajectory, Turn
from .budget import MAX_NAME, HeldBudget, json_cost, same_file_as, shown_value
from .safe import BoundedReadError, ReadLimits, load_torch_checkpoint, open_regular_file, read_exactly

__all__ = [
    "TRAJECTORY_SCHEMA",
    "RECORD_SCHEMA",
    "trajectory_to_json",
    "trajectory_from_json",
    "write_trajectories",
    "read_trajectories",
    "iter_trajectories",
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
                "tool_call": None
                if t.tool_call is None
                else {"name": t.tool_call.name, "arguments": t.tool_call.arguments},
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
        raise ValueError(f"{where}: field `{key}` must be {names}, got {shown_value(v)}.")
    return v


def trajectory_from_json(d: Mapping[str, Any], where: str = "record line") -> Trajectory:
    """Parse and validate one record line (schema ``lens_callbacks.trajectory/1``)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: must be a JSON object, got {type(d).__name__}.")
    schema = d.get("schema")
    if schema != TRAJECTORY_SCHEMA:
        raise ValueError(f"{where}: `schema` must be {TRAJECTORY_SCHEMA!r}, got {shown_value(schema)}.")
    turns_raw = _need(d, "turns", (list,), where)
    turns = []
    for j, t in enumerate(turns_raw):
        w = f"{where}, turn {j}"
        if not isinstance(t, Mapping):
            raise ValueError(f"{w}: must be a JSON object, got {type(t).__name__}.")
        role = _need(t, "role", (str,), w)
        if role not in ROLES:
            raise ValueError(f"{w}: `role` must be one of {ROLES}, got {shown_value(role)}.")
        ids = t.get("token_ids")
        if ids is not None and (
            not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise ValueError(f"{w}: `token_ids` must be a list of ints or null, got {shown_value(ids)}.")
        if ids and min(ids) < 0:
            raise ValueError(f"{w}: `token_ids` must be token ids >= 0, got {shown_value(min(ids))}.")
        if ids and max(ids) > _INT64_MAX:  # torch holds ids as int64: a wider one is no token id
            raise ValueError(f"{w}: `token_ids` must be token ids below 2**63, got {shown_value(max(ids))}.")
        call = t.get("tool_call")
        if call is not None:
            if not isinstance(call, Mapping):
                raise ValueError(f"{w}: `tool_call` must be null or {{'name', 'arguments'}}, got {shown_value(call)}.")
            call = ToolCall(
                _need(call, "name", (str,), w + " tool_call"), _need(call, "arguments", (str,), w + " tool_call")
            )
        trained = t.get("trained")
        if trained is not None and not isinstance(trained, bool):
            raise ValueError(f"{w}: `trained` must be true/false, got {shown_value(trained)}.")
        turns.append(Turn(role, _need(t, "text", (str,), w), None if ids is None else tuple(ids), trained, call))
    raw = _need(d, "reward", (int, float), where)
    # JSON has no NaN; 1e400 parses as inf, and an integer of 400 digits overflows a float. An audit of a
    # non-finite reward is a table of NaN.
    reward = float(raw) if not isinstance(raw, int) or abs(raw) < 2**1000 else math.inf
    if not math.isfinite(reward):
        raise ValueError(f"{where}: field `reward` must be finite, got {shown_value(raw)}.")
    return Trajectory(
        turns=tuple(turns),
        reward=reward,
        group=_int64(d, "group", where),
        rollout=_int64(d, "rollout", where),
        prompt_id=str(_need(d, "prompt_id", (str,), where)),
        step=_int64(d, "step", where),
    )


_INT64_MAX = 2**63 - 1


def _int64(d: Mapping[str, Any], key: str, where: str) -> int:
    """An int field that tensors will hold: within int64, or one line naming the field."""
    v = _need(d, key, (int,), where)
    if not -_INT64_MAX - 1 <= v <= _INT64_MAX:
        raise ValueError(f"{where}: field `{key}` must be an int within 64 bits, got {shown_value(v)}.")
    return int(v)


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


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a record never holds NaN or Infinity)")


def _loads(text: str, where: str, what: str = "") -> Any:
    """``json.loads`` that refuses NaN/Infinity and turns every failure (depth, huge ints) into one ValueError."""
    what = f"the {what} is " if what else ""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(f"{where}: {what}not valid JSON (nested too deeply).") from None
    except ValueError as err:
        raise ValueError(f"{where}: {what}not valid JSON ({' '.join(str(err).split())[:200]}).") from None


def _read_json(path: Path, what: str, limits: Optional[ReadLimits] = None, root: Optional[PathLike] = None) -> Any:
    """A whole JSON file, its parsed size bounded before it is parsed.

    Held as bytes, then as text, then parsed, a JSON file costs at least five times its size in the worst case
    the bound allows for, so one whose size alone breaks the memory budget is refused before a byte is read.
    """
    limits = limits or ReadLimits.from_env()
    budget = HeldBudget(limits)
    shown = str(path)
    fd, size = open_regular_file(path, limits, what, root)
    try:
        budget.check(5 * size, shown, f"the {what} ({size:,} bytes of JSON, read, decoded and parsed)")
        data = read_exactly(fd, size, shown, what)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: the {what} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    del data
    budget.check(len(text) + json_cost(text), shown, f"the {what} ({len(text):,} characters of JSON)")
    return _loads(text, shown, what)


def iter_trajectories(
    path: PathLike,
    limits: Optional[ReadLimits] = None,
    root: Optional[PathLike] = None,
    budget: Optional[HeldBudget] = None,
) -> Iterator[Trajectory]:
    """The trajectories of a ``.jsonl`` file, one line at a time: memory stays one line's, whatever the file's size.

    Each line's parsed size is bounded before it is parsed (:func:`~lens_callbacks.io.budget.json_cost`) against
    what ``budget`` has left; the file is read up to the size it had when opened (one that grows meanwhile is
    refused). Errors name the file and line.
    """
    limits = limits or ReadLimits.from_env()
    budget = budget or HeldBudget(limits)
    path = Path(path)
    fd, size = open_regular_file(path, limits, "trajectory file", root)
    longest = max(1, limits.memory_bytes // 4)
    with os.fdopen(fd, "rb", buffering=1 << 20) as f:
        got, n = 0, 0
        while True:
            try:
                raw = f.readline(min(longest, size - got) + 1)
            except OSError as err:
                raise BoundedReadError(
                    f"{path}: the trajectory file cannot be read ({err.strerror or type(err).__name__})."
                ) from None
            if not raw:
                break
            got += len(raw)
            n += 1
            if got > size:
                raise BoundedReadError(
                    f"{path}: the trajectory file grew while being read (it held {size:,} bytes when opened); "
                    "refused: read it once nothing writes to it any more."
                )
            if len(raw) > longest and not raw.endswith(b"\n"):
                raise BoundedReadError(
                    f"{path}:{n}: the line is longer than {longest:,} bytes (a quarter of LENS_MEMORY_MB); refused."
                )
            where = f"{path.name}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: the line is not UTF-8 text ({err.reason} at byte {err.start}).") from None
            del raw
            # Lines end at "\n" only, as when a file is iterated: str.splitlines would also split inside strings (U+0085, U+2028).
            if not line.strip():
                continue
            budget.check(json_cost(line), str(path), f"line {n} ({len(line):,} characters of JSON)")
            yield trajectory_from_json(_loads(line, where), where)


def held_cost(traj: Trajectory) -> int:
    """An upper bound of the bytes a parsed trajectory keeps (objects, token ids at 40 bytes each, text at 4 per character)."""
    n = 400 + 4 * len(traj.prompt_id)
    for t in traj.turns:
        n += 300 + 4 * len(t.text) + 40 * len(t.token_ids or ())
        if t.tool_call is not None:
            n += 200 + 4 * (len(t.tool_call.name) + len(t.tool_call.arguments))
    return n


def read_trajectories(
    path: PathLike,
    limits: Optional[ReadLimits] = None,
    root: Optional[PathLike] = None,
    budget: Optional[HeldBudget] = None,
) -> list[Trajectory]:
    """Read a ``.jsonl`` file of trajectories; errors name the file and line.

    The read is bounded (a regular file under ``limits.max_file_bytes`` and ``limits.memory_bytes``; see
    :mod:`lens_callbacks.io.safe`), streamed one line at a time (:func:`iter_trajectories`), and what it keeps is
    charged to ``budget`` (a fresh :class:`~lens_callbacks.io.budget.HeldBudget` when None). ``root``: the run
    folder no symbolic link may leave.
    """
    limits = limits or ReadLimits.from_env()
    budget = budget or HeldBudget(limits)
    out = []
    for traj in iter_trajectories(path, limits, root, budget):
        budget.charge(held_cost(traj), str(path), f"the trajectories read so far ({len(out) + 1:,})")
        out.append(traj)
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
            raise ValueError(
                f"`run_dir` {str(self.run_dir)!r} already holds a record; pass overwrite=True or pick a new directory."
            )
        self.checkpoint_every = checkpoint_every
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._manifest: dict[str, Any] = {
            "schema": RECORD_SCHEMA,
            "trajectory_schema": TRAJECTORY_SCHEMA,
            "steps": [],
            "checkpoints": [],
        }
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

    def write_step(
        self, step: int, trajectories: Sequence[Trajectory], meta: Optional[Mapping[str, Any]] = None
    ) -> Path:
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_step_list(man: Mapping[str, Any], key: str, where: str) -> None:
    v = man[key]
    if not isinstance(v, list):
        raise ValueError(f"{where}: field `{key}` must be a list of step numbers, got {type(v).__name__}.")
    for i, s in enumerate(v):
        if not _is_int(s) or s < 0 or s > 10**12:
            raise ValueError(f"{where}: field `{key}[{i}]` must be a step number (an int >= 0), got {shown_value(s)}.")


#: trainer settings an exact replay depends on, and what each must be.
_TRAINER_FIELDS = {
    "gradient_clip_val": ("a finite number >= 0 or null", lambda v: v is None or (_is_number(v) and v >= 0)),
    "gradient_clip_algorithm": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "accumulate_grad_batches": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "precision": ("a string or int", lambda v: isinstance(v, str) or _is_int(v)),
    "world_size": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
}


def check_manifest(man: Any, where: str) -> dict[str, Any]:
    """Validate the types of a ``record.json`` (every field a reader uses); errors name the field."""
    if not isinstance(man, dict):
        raise ValueError(f"{where}: the manifest must be a JSON object, got {type(man).__name__}.")
    if man.get("schema") != RECORD_SCHEMA:
        raise ValueError(f"{where}: `schema` must be {RECORD_SCHEMA!r}, got {shown_value(man.get('schema'))}.")
    if "trajectory_schema" in man and man["trajectory_schema"] != TRAJECTORY_SCHEMA:
        raise ValueError(
            f"{where}: field `trajectory_schema` must be {TRAJECTORY_SCHEMA!r}, got {shown_value(man['trajectory_schema'])}."
        )
    for key in ("steps", "checkpoints"):
        if key not in man:
            raise ValueError(f"{where}: field `{key}` is missing.")
        _check_step_list(man, key, where)
    if "module" in man and not isinstance(man["module"], str):
        raise ValueError(f"{where}: field `module` must be a class path string, got {shown_value(man['module'])}.")
    for key in ("module", "batch_builder"):  # before any regex sees them
        if isinstance(man.get(key), str) and len(man[key]) > MAX_NAME:
            raise ValueError(
                f"{where}: field `{key}` must be an import path of at most {MAX_NAME} characters, got "
                f"{shown_value(man[key])}."
            )
    if "init_args" in man and not isinstance(man["init_args"], dict):
        raise ValueError(f"{where}: field `init_args` must be a JSON object, got {type(man['init_args']).__name__}.")
    if man.get("batch_builder") is not None and not isinstance(man["batch_builder"], str):
        raise ValueError(
            f"{where}: field `batch_builder` must be an import path string or null, got {shown_value(man['batch_builder'])}."
        )
    if "optimizer" in man:
        opts = man["optimizer"]
        if not isinstance(opts, list):
            raise ValueError(
                f"{where}: field `optimizer` must be a list (one entry per optimizer), got {type(opts).__name__}."
            )
        for i, o in enumerate(opts):
            if (
                not isinstance(o, dict)
                or not isinstance(o.get("class", ""), str)
                or not isinstance(o.get("param_groups", []), list)
                or not all(isinstance(g, dict) for g in o.get("param_groups", []))
            ):
                raise ValueError(
                    f"{where}: field `optimizer[{i}]` must be {{'class': str, 'param_groups': [object, ...]}}, got {shown_value(o)}."
                )
    if "trainer" in man:
        tr = man["trainer"]
        if not isinstance(tr, dict):
            raise ValueError(f"{where}: field `trainer` must be a JSON object, got {type(tr).__name__}.")
        for key, (what, ok) in _TRAINER_FIELDS.items():
            if key in tr and not ok(tr[key]):
                raise ValueError(f"{where}: field `trainer.{key}` must be {what}, got {shown_value(tr[key])}.")
    return man


def check_step_meta(meta: Any, where: str) -> dict[str, Any]:
    """Validate a step's meta (``steps/step_N.json``): ``lr`` a list of finite rates >= 0, ``dropout_seed`` an int."""
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: the step meta must be a JSON object, got {shown_value(meta)}.")
    lr = meta.get("lr")
    if lr is not None:
        if not isinstance(lr, list) or not lr:
            raise ValueError(
                f"{where}: field `lr` must be a list of learning rates (one per param group), got {shown_value(lr)}."
            )
        for i, x in enumerate(lr):
            if not _is_number(x) or x < 0:
                raise ValueError(f"{where}: field `lr[{i}]` must be a finite number >= 0, got {shown_value(x)}.")
    seed = meta.get("dropout_seed", 0)
    if not _is_int(seed) or not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise ValueError(
            f"{where}: field `dropout_seed` must be an int in [-2**63, 2**64) (a torch seed), got {shown_value(seed)}."
        )
    return meta


class RunRecord:
    """Reads a run record written by :class:`RunRecordWriter`.

    Every file is read bounded (regular files only, size caps; see :mod:`lens_callbacks.io.safe`) and
    validated on read: the manifest's and each step meta's types, each trajectory line's fields, the
    policy checkpoints through ``torch.load(weights_only=True)`` with their tensors checked. ``trust``
    decides what the record's ``module``/``batch_builder`` may name (:mod:`lens_callbacks.io.trust`).
    """

    def __init__(self, run_dir: PathLike, limits: Optional[ReadLimits] = None, trust: Any = None) -> None:
        from .trust import TrustPolicy

        self.run_dir = Path(run_dir)
        self.limits = limits
        self.trust = TrustPolicy() if trust is None else trust
        mpath = self.run_dir / _MANIFEST
        if not os.path.lexists(mpath):
            raise ValueError(
                f"`run_dir` must hold a run record ({_MANIFEST}), got {str(self.run_dir)!r} without one; "
                "write records with RunRecordCallback or RunRecordWriter."
            )
        self.manifest: dict[str, Any] = check_manifest(_read_json(mpath, "manifest", limits, self.run_dir), str(mpath))
        self._listing: Optional[dict[str, str]] = None

    # Sorted from the manifest on each access (which may be edited in place): callers read them once per check,
    # never once per step, so checks over a record of 100,000 steps stay linear.
    @property
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self.manifest.get("steps", []))

    @property
    def checkpoints(self) -> list[int]:
        return sorted(int(s) for s in self.manifest.get("checkpoints", []))

    def _trajectory_files(self) -> dict[str, str]:
        """``{file name: path}`` of ``trajectories/`` (listed once), refused where two names are one file."""
        if self._listing is None:
            folder = self.run_dir / "trajectories"
            names: list[str] = []
            if os.path.isdir(folder) and not os.path.islink(folder):
                try:
                    with os.scandir(folder) as it:
                        names = [e.name for e in it if e.name.endswith(".jsonl")]
                except OSError as err:
                    raise BoundedReadError(
                        f"{folder}: the folder cannot be listed ({err.strerror or type(err).__name__})."
                    ) from None
            self._listing = {n: str(folder / n) for n in names}
        return self._listing

    def check_step_files(self, steps: Iterable[int]) -> None:
        """Every step in ``steps`` has its trajectory file, each its own file; else one error naming the first missing.

        One listing of ``trajectories/`` and one pass over ``steps``: linear in the number of steps.
        """
        listing = self._trajectory_files()
        steps = list(steps)
        names = [f"step_{int(s):06d}.jsonl" for s in steps]  # as step_path names them, without a Path per step
        missing = [s for s, n in zip(steps, names) if n not in listing]
        if missing:
            more = f" (and {len(missing) - 1:,} more listed steps)" if len(missing) > 1 else ""
            raise ValueError(
                f"{step_path(self.run_dir, missing[0])}: the trajectory file of step {missing[0]}{more} is missing, "
                f"though {self.run_dir / _MANIFEST} lists the step in field `steps`; the replay needs every one."
            )
        wanted = [listing[n] for n in names]
        dup = same_file_as(wanted)
        if dup:
            a, b = next(iter(dup.items()))
            raise ValueError(
                f"{a}: the trajectory file is the same file as {b} (a link); every step needs its own; refused."
            )

    def trajectories(self, step: int) -> list[Trajectory]:
        path = step_path(self.run_dir, step)
        if not os.path.lexists(path):
            raise ValueError(
                f"`step` must be a recorded step ({_ranges(self.steps)}), got {step!r}: {path} is missing."
            )
        return read_trajectories(path, self.limits, self.run_dir)

    def step_meta(self, step: int) -> dict[str, Any]:
        """What the module needs besides the trajectories to rebuild its batch (``{}`` when nothing)."""
        path = meta_path(self.run_dir, step)
        if not os.path.lexists(path):
            return {}
        return check_step_meta(_read_json(path, "step meta", self.limits, self.run_dir), str(path))

    def iter_steps(self, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[int, list[Trajectory]]]:
        for s in self.steps:
            if s >= start and (stop is None or s < stop):
                yield s, self.trajectories(s)

    def load_policy(self, step: int) -> dict[str, torch.Tensor]:
        path = policy_path(self.run_dir, step)
        if not os.path.lexists(path):
            listed = step in self.checkpoints
            raise ValueError(
                f"{path}: no policy checkpoint at step {step}: the file is missing"
                + (
                    f", though {self.run_dir / _MANIFEST} lists the step in field `checkpoints`."
                    if listed
                    else f" (field `checkpoints` of {self.run_dir / _MANIFEST}: {_ranges(self.checkpoints)})."
                )
            )
        state = load_torch_checkpoint(path, self.limits, "policy checkpoint", self.run_dir)
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ValueError(
                f"{path}: the policy checkpoint must be a state dict (parameter name -> tensor), got "
                f"{type(state).__name__}."
            )
        return dict(state)

    def nearest_checkpoint(self, step: int) -> int:
        """The latest checkpoint at or before ``step``."""
        checkpoints = self.checkpoints
        before = [c for c in checkpoints if c <= step]
        if not before:
            raise ValueError(
                f"{self.run_dir / _MANIFEST}: field `checkpoints` holds no policy checkpoint at or before step {step} "
                f"(have {_ranges(checkpoints)})."
            )
        return before[-1]


def _ranges(steps: Sequence[int]) -> str:
    if not steps:
        return "none recorded"
    return f"{len(steps)} steps, {steps[0]}..{steps[-1]}"
