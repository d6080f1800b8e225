"""RunRecordCallback: write each step's trajectories and the step-0 policy, so any step can be re-audited.

A thin adapter over :class:`lens_callbacks.io.records.RunRecordWriter`. It reads what the module
trained on from ``pl_module.last_trajectories`` (a list of
:class:`~lens_callbacks.credit.inputs.trajectories.Trajectory`) or, for single-turn modules, from
``pl_module.last_rollouts`` (one entry per rollout: prompt and completion text and token ids, reward,
group, rollout), which becomes a two-turn ``user``/``assistant`` trajectory.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from ..credit.inputs.trajectories import Trajectory, Turn
from ..io.records import RunRecordWriter

__all__ = ["RunRecordCallback", "trajectories_of"]


def _get(entry: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if isinstance(entry, Mapping) and k in entry:
            return entry[k]
        if hasattr(entry, k):
            return getattr(entry, k)
    return default


def _ids(v: Any) -> Optional[tuple[int, ...]]:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        v = v.reshape(-1).tolist()
    return tuple(int(i) for i in v)


def _from_rollout(entry: Any, step: int, index: int) -> Trajectory:
    prompt = _get(entry, "prompt_text", "prompt", default="")
    completion = _get(entry, "completion_text", "completion", default="")
    p_ids = _ids(_get(entry, "prompt_token_ids", "prompt_ids"))
    c_ids = _ids(_get(entry, "completion_token_ids", "completion_ids"))
    return Trajectory(
        (Turn("user", str(prompt), p_ids, False), Turn("assistant", str(completion), c_ids, True)),
        reward=float(_get(entry, "reward", default=0.0)),
        group=int(_get(entry, "group", "group_id", default=0)),
        rollout=int(_get(entry, "rollout", "rollout_id", default=index)),
        prompt_id=str(_get(entry, "prompt_id", default=_get(entry, "group", "group_id", default=0))),
        step=step,
    )


def trajectories_of(pl_module: Any, step: int) -> Optional[list[Trajectory]]:
    """The trajectories a module trained on this step (``last_trajectories`` or ``last_rollouts``)."""
    trajs = getattr(pl_module, "last_trajectories", None)
    if trajs:
        return [
            t if t.step == step else Trajectory(t.turns, t.reward, t.group, t.rollout, t.prompt_id, step) for t in trajs
        ]
    rollouts = getattr(pl_module, "last_rollouts", None)
    if rollouts:
        return [_from_rollout(e, step, i) for i, e in enumerate(rollouts)]
    return None


def _merge_ranks(parts: list[list[Trajectory]]) -> list[Trajectory]:
    """Concatenate per-rank trajectories in rank order, renumbering rollouts and groups to stay unique."""
    out: list[Trajectory] = []
    g_off = 0
    for part in parts:
        for t in part:
            out.append(Trajectory(t.turns, t.reward, t.group + g_off, len(out), t.prompt_id, t.step))
        g_off += max((t.group for t in part), default=-1) + 1
    return out


def _clip_algorithm(trainer: Trainer) -> Optional[str]:
    algo = trainer.gradient_clip_algorithm
    if algo is None:
        return None
    return str(getattr(algo, "value", algo))


def _optimizer_config(opt: torch.optim.Optimizer) -> dict[str, Any]:
    groups = []
    for g in opt.param_groups:
        groups.append(
            {
                k: v
                for k, v in g.items()
                if k != "params" and isinstance(v, (int, float, bool, str, tuple, list, type(None)))
            }
        )
    return {"class": f"{type(opt).__module__}.{type(opt).__qualname__}", "param_groups": groups}


class RunRecordCallback(Callback):
    """Write a run record: ``trajectories/step_{N:06d}.jsonl`` per step, ``policy_step_000000.pt``,
    and ``record.json`` (module class, init args, optimizer, trainer settings).

    Args:
        run_dir: where to write (default: ``<trainer.log_dir or default_root_dir>/record``).
        checkpoint_every: also save the policy every this many steps (0: step 0 only). The offline
            audit replays from the nearest checkpoint; with a stateful optimizer (momentum, Adam) it
            replays from step 0, where the optimizer state is known to be empty.
        batch_builder: import path of ``fn(module, trajectories, meta) -> batch`` that rebuilds the
            module's rollout batch offline, for modules without ``make_rollout_batch(trajectories)``
            (e.g. ``lens_callbacks.examples.grpo_tools.single_turn.grpo_rollout_batch`` for ``lens_callbacks.examples.grpo``).

    Per step it also records the learning rates the optimizer step used (so a run with an LR scheduler
    replays exactly) and the module's ``last_rollout_batch.dropout_seed`` when it has one (so a run with
    dropout does). Under DDP every rank's trajectories are gathered (a collective every
    rank reaches) and rank 0 writes them, rollouts and groups renumbered in rank order.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lens_callbacks import RunRecordCallback
        >>> record = RunRecordCallback("runs/mine/record", checkpoint_every=50)  # then: lens-callbacks audit runs/mine/record
        >>> trainer = Trainer(callbacks=[record], max_steps=100, logger=False, enable_checkpointing=False)
    """

    def __init__(
        self, run_dir: Optional[str] = None, checkpoint_every: int = 0, batch_builder: Optional[str] = None
    ) -> None:
        if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ValueError(f"`checkpoint_every` must be an int >= 0, got {checkpoint_every!r}; 0 saves step 0 only.")
        if batch_builder is not None and (not isinstance(batch_builder, str) or "." not in batch_builder):
            raise ValueError(
                f"`batch_builder` must be an import path 'module.function' or None, got {batch_builder!r}."
            )
        self.run_dir = run_dir
        self.checkpoint_every = checkpoint_every
        self.batch_builder = batch_builder
        self.writer: Optional[RunRecordWriter] = None
        self.steps_written = 0
        self._lrs: Optional[list[float]] = None
        self._warned_empty = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"`accumulate_grad_batches` must be 1 for RunRecordCallback (one batch per recorded step), got "
                f"{trainer.accumulate_grad_batches!r}."
            )
        if self.run_dir is None:
            base = trainer.log_dir or trainer.default_root_dir
            self.run_dir = os.path.join(base, "record")
        if trainer.is_global_zero:
            self.writer = RunRecordWriter(self.run_dir, checkpoint_every=self.checkpoint_every)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.writer is None:
            return
        cls = type(pl_module)
        self.writer.write_manifest(
            module=f"{cls.__module__}.{cls.__qualname__}",
            init_args=dict(pl_module.hparams),
            batch_builder=self.batch_builder,
            optimizer=[_optimizer_config(o) for o in trainer.optimizers],
            trainer={
                "gradient_clip_val": trainer.gradient_clip_val,
                "gradient_clip_algorithm": _clip_algorithm(trainer),
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "precision": str(trainer.precision),
                "world_size": trainer.world_size,
            },
        )
        if trainer.global_step == 0:
            self.writer.write_policy(0, pl_module.state_dict())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # The learning rates this step is taken with (a scheduler may change them between steps).
        self._lrs = [float(g["lr"]) for g in optimizer.param_groups]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The optimizer step has run: global_step counts it, so the step just trained is global_step - 1.
        step = trainer.global_step - 1
        trajs = trajectories_of(pl_module, step)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, trajs or [])
            trajs = _merge_ranks(gathered)
        if not trajs and not self._warned_empty:
            self._warned_empty = True
            rank_zero_warn(
                f"RunRecordCallback: step {step} of {type(pl_module).__name__} left neither `last_trajectories` nor "
                "`last_rollouts`, so it is not recorded; set one of them in `training_step` to the rollouts it "
                "trained on (see docs/record_schema.md)."
            )
        if self.writer is None or not trajs:
            return
        meta: dict[str, Any] = {}
        seed = getattr(getattr(pl_module, "last_rollout_batch", None), "dropout_seed", None)
        if seed is not None:
            meta["dropout_seed"] = int(seed)
        if self._lrs is not None:
            meta["lr"] = self._lrs
        self._lrs = None
        self.writer.write_step(step, trajs, meta or None)
        self.steps_written += 1
        if self.writer.wants_checkpoint(trainer.global_step):
            self.writer.write_policy(trainer.global_step, pl_module.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "steps_written": self.steps_written}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_dir = state_dict.get("run_dir", self.run_dir)
        self.steps_written = int(state_dict.get("steps_written", 0))
