"""``lens-callbacks audit RUN_DIR --step N --partition by_turn``: re-audit one step of a run record offline.

Step ``N`` needs the weights the policy had at step ``N``. The record holds the policy at step 0 (and
every ``checkpoint_every`` steps); :func:`replay_to` rebuilds step ``N`` by re-applying the recorded
steps — the module's own ``credit_terms`` loss, one backward, Lightning's default gradient clipping
when the run clipped, the module's own optimizer at the recorded learning rates — from the nearest
usable checkpoint. The replay is exact (bit for bit on CPU) when training was: one process, no
accumulation, no mixed precision, and no dropout unless the batch's dropout seed was recorded. With a stateful optimizer
(momentum, Adam) it starts at step 0, where the optimizer state is known to be empty.

The module is rebuilt from ``record.json`` (its class path and init args), so its class must be
importable (the working directory is put on ``sys.path``, as for ``lens-callbacks fit``). It must
implement ``credit_terms(batch)``, and its rollout batch is rebuilt from the recorded trajectories by
``module.make_rollout_batch(trajectories)`` or by the record's ``batch_builder``
(``fn(module, trajectories, meta) -> batch``, named when the record was written).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
from typing import Any, Optional, Sequence, Union

import torch

from ..credit.engine import disintegrate
from ..credit.partition import PARTITIONS, resolve_partition
from ..credit.report import CreditReport
from ..credit.trajectories import by_role, by_turn
from ..io.records import RunRecord
from ..refusal import Refusal

__all__ = ["audit_record", "load_module", "replay_to", "rebuild_batch", "main", "AUDIT_PARTITIONS"]

AUDIT_PARTITIONS = {**PARTITIONS, "by_turn": by_turn, "by_role": by_role}


def _import(path: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"the record's module {path!r} could not be imported ({err}); run from the directory it was trained in."
        ) from err


def load_module(record: RunRecord, step: int = 0, **overrides: Any) -> torch.nn.Module:
    """Rebuild the recorded module from its class path and init args, with the policy of checkpoint ``step``."""
    path = record.manifest.get("module")
    if not path:
        raise ValueError(f"{record.run_dir}/record.json names no `module`; it was not written by RunRecordCallback.")
    cls = _import(path)
    args = dict(record.manifest.get("init_args", {}))
    args.update(overrides)
    # LightningCLI adds bookkeeping keys such as `_class_path` to hparams; pass only what __init__ takes.
    sig = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
        args = {k: v for k, v in args.items() if k in sig}
    module = cls(**args)
    module.load_state_dict(record.load_policy(step))
    return module


def _make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    out = module.configure_optimizers()
    if isinstance(out, dict):
        out = out["optimizer"]
    if isinstance(out, (list, tuple)):
        out = out[0]
        if isinstance(out, (list, tuple)):
            out = out[0]
        if isinstance(out, dict):
            out = out["optimizer"]
    if not isinstance(out, torch.optim.Optimizer):
        raise ValueError(f"`configure_optimizers` must give a torch.optim.Optimizer to replay, got {type(out).__name__}.")
    return out


def _stateless(opt: torch.optim.Optimizer) -> bool:
    """Plain SGD (no momentum) carries no state between steps, so a replay may start at any checkpoint."""
    return type(opt) is torch.optim.SGD and all(g.get("momentum", 0) == 0 for g in opt.param_groups)


def _replay_blocker(record: RunRecord, opt: torch.optim.Optimizer) -> Optional[Refusal]:
    man = record.manifest
    tr = man.get("trainer", {})
    if tr.get("gradient_clip_val") not in (None, 0, 0.0) and (tr.get("gradient_clip_algorithm") or "norm") not in ("norm", "value"):
        return Refusal("gradient_clip_algorithm", f"training clipped gradients with {tr['gradient_clip_algorithm']!r}, which the replay "
                       "does not know.", remedy="record with checkpoint_every=1 and audit at a checkpoint")
    if int(tr.get("world_size", 1)) != 1:
        return Refusal("world_size", f"training ran on {tr['world_size']} processes; the replay of an averaged DDP step is not exact.",
                       remedy="record with checkpoint_every=1 and audit at a checkpoint")
    if str(tr.get("precision", "32-true")) not in ("32-true", "32", "64-true", "64"):
        return Refusal("precision", f"training ran at precision {tr['precision']!r}; the replay runs at full precision.",
                       remedy="record with checkpoint_every=1 and audit at a checkpoint")
    recorded = man.get("optimizer") or []
    if recorded:
        cls = recorded[0].get("class", "")
        mine = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if cls != mine:
            return Refusal("optimizer", f"the record's optimizer is {cls!r}, the rebuilt module's is {mine!r}.",
                           remedy="audit with the module code the run was trained with, or at a checkpoint")
        for i, (rg, g) in enumerate(zip(recorded[0].get("param_groups", []), opt.param_groups)):
            for k in ("lr", "momentum", "weight_decay", "dampening", "nesterov", "betas", "eps"):
                if k in rg and k in g and _plain_value(g[k]) != rg[k]:
                    return Refusal("optimizer", f"param group {i}: `{k}` is {rg[k]!r} in the record, {g[k]!r} in the rebuilt optimizer.",
                                   remedy="audit with the module code the run was trained with, or at a checkpoint")
    return None


def _clip_like_lightning(opt: torch.optim.Optimizer, clip_val: Optional[float], algorithm: str) -> None:
    """Lightning's default ``configure_gradient_clipping``: the optimizer's parameters, in group order."""
    if not clip_val or clip_val <= 0:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)


def _plain_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, tuple):
        v = list(v)
    return v


def rebuild_batch(module: torch.nn.Module, record: RunRecord, step: int) -> Any:
    """The module's rollout batch of a recorded step (``make_rollout_batch`` or the record's builder)."""
    trajs = record.trajectories(step)
    builder = record.manifest.get("batch_builder")
    if builder:
        return _import(builder)(module, trajs, record.step_meta(step))
    make = getattr(module, "make_rollout_batch", None)
    if make is None:
        raise ValueError(
            f"{type(module).__name__} has no `make_rollout_batch(trajectories)` and the record names no `batch_builder`; "
            "record with RunRecordCallback(batch_builder='pkg.mod.fn')."
        )
    return make(trajs)


def _dropout_blocker(record: RunRecord, steps: Sequence[int]) -> Optional[Refusal]:
    if float(record.manifest.get("init_args", {}).get("dropout", 0.0) or 0.0) <= 0.0:
        return None
    unseeded = [s for s in steps if "dropout_seed" not in record.step_meta(s)]
    if unseeded:
        return Refusal("dropout", f"training used dropout and steps {unseeded[:5]} carry no recorded dropout seed, so "
                       "their masks cannot be drawn again.", {"n_unseeded": len(unseeded)},
                       remedy="train with dropout=0, have the module keep `last_rollout_batch.dropout_seed`, or record with checkpoint_every=1")
    return None


def _with_policy(record: RunRecord, step: int, module: Optional[torch.nn.Module]) -> torch.nn.Module:
    """``module`` (rebuilt from the record when None) holding the policy of checkpoint ``step``."""
    if module is None:
        return load_module(record, step)
    module.load_state_dict(record.load_policy(step))
    return module


def replay_to(
    record: RunRecord, step: int, module: Optional[torch.nn.Module] = None, progress: bool = True
) -> Union[torch.nn.Module, Refusal]:
    """The recorded module with the weights it had at ``step`` (loaded, or replayed from a checkpoint)."""
    if step in record.checkpoints:
        return _with_policy(record, step, module)
    start = record.nearest_checkpoint(step)
    m = _with_policy(record, start, module)
    opt = _make_optimizer(m)
    blocker = _replay_blocker(record, opt)
    if blocker is not None:
        return blocker
    if not _stateless(opt) and start != 0:
        start = 0
        m.load_state_dict(record.load_policy(0))
    missing = [s for s in range(start, step) if s not in set(record.steps)]
    if missing:
        return Refusal("missing_steps", f"steps {missing[:5]} between checkpoint {start} and step {step} are not recorded.",
                       {"start": start, "step": step, "n_missing": len(missing)},
                       remedy="record every step (RunRecordCallback on the whole run), or audit at a checkpoint")
    blocker = _dropout_blocker(record, range(start, step))
    if blocker is not None:
        return blocker
    if not record.manifest.get("batch_builder") and not hasattr(m, "make_rollout_batch"):
        return Refusal("make_rollout_batch", f"{type(m).__name__} has no `make_rollout_batch(trajectories)` and the record names no `batch_builder`.",
                       remedy="give the module make_rollout_batch, or record with RunRecordCallback(batch_builder='pkg.mod.fn')")
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    steps = range(start, step)
    it = tqdm(steps, desc=f"replay {start}->{step}", disable=not progress, leave=False) if tqdm else steps
    tr = record.manifest.get("trainer", {})
    clip_val, clip_algo = tr.get("gradient_clip_val"), tr.get("gradient_clip_algorithm") or "norm"
    m.train()
    with torch.random.fork_rng():
        for s in it:
            batch = rebuild_batch(m, record, s)
            lrs = record.step_meta(s).get("lr")
            if lrs is not None:  # the rates the recorded step used (an LR scheduler may have moved them)
                for g, lr in zip(opt.param_groups, lrs):
                    g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss = m.credit_terms(batch).terms.sum()
            loss.backward()
            _clip_like_lightning(opt, clip_val, clip_algo)
            opt.step()
    opt.zero_grad(set_to_none=True)
    return m


def audit_record(
    run_dir: Union[str, os.PathLike],
    step: int,
    partition: str = "by_rollout",
    dtype: str = "float32",
    *,
    progress: bool = True,
    keep_grads: bool = False,
    module: Optional[torch.nn.Module] = None,
) -> Union[CreditReport, Refusal]:
    """Re-audit one recorded step: rebuild the weights at ``step``, rebuild its batch, disintegrate.

    Args:
        run_dir: a run record (``record.json``, ``trajectories/``, ``policy_step_000000.pt``).
        step: the step to audit.
        partition: ``"by_rollout"``, ``"by_group"``, ``"by_segment"``, ``"by_turn"``, ``"by_role"`` or an
            import path.
        dtype: ``"float32"``, ``"float64"``, ``"bfloat16"`` or ``"native"``.
        progress: show a progress bar over the replayed steps.
        keep_grads: attach ``g_full`` and ``Σ g_S`` to the report.
        module: reuse an already built module (its weights are replaced).

    Returns:
        The :class:`CreditReport` of that step, or a :class:`Refusal` when the weights at ``step`` cannot
        be rebuilt exactly.
    """
    record = RunRecord(run_dir)
    if step not in record.steps:
        raise ValueError(f"`step` must be a recorded step (have {record.steps[:3]}..{record.steps[-3:]}), got {step!r}.")
    part = AUDIT_PARTITIONS.get(partition) if isinstance(partition, str) else None
    part = part if part is not None else resolve_partition(partition)
    m = replay_to(record, step, module, progress)
    if isinstance(m, Refusal):
        return m
    batch = rebuild_batch(m, record, step)
    report = disintegrate(m, batch, part, dtype=dtype, keep_grads=keep_grads)
    if isinstance(partition, str) and report.partition != partition:
        report = _renamed(report, partition)
    return report


def _renamed(report: CreditReport, name: str) -> CreditReport:
    from dataclasses import replace

    return replace(report, partition=name)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="lens-callbacks audit", description="Re-audit one step of a run record and print the report.")
    p.add_argument("run_dir", help="a run record directory (record.json, trajectories/, policy_step_000000.pt)")
    p.add_argument("--step", type=int, default=None, help="the step to audit (default: the last recorded)")
    p.add_argument("--partition", default="by_rollout", help=f"one of {sorted(AUDIT_PARTITIONS)} or an import path")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16 or native")
    p.add_argument("--no-progress", action="store_true", help="hide the replay progress bar")
    p.add_argument("--json", action="store_true", help="print the report's to_dict() as JSON instead of the table")
    a = p.parse_args(list(argv))
    try:  # a bad directory, step, partition or dtype is a message and exit status 2, not a traceback
        record = RunRecord(a.run_dir)
        if not record.steps:
            raise ValueError(f"{a.run_dir}: the record holds no steps; record at least one training step.")
        step = record.steps[-1] if a.step is None else a.step
        report = audit_record(a.run_dir, step, a.partition, a.dtype, progress=not a.no_progress)
    except (OSError, ValueError) as err:
        print(f"lens-callbacks audit: {err}", file=sys.stderr)
        return 2
    if isinstance(report, Refusal):
        print(report.render())
        return 3
    if a.json:
        d = report.to_dict("credit/")
        print(json.dumps({k: (v if math.isfinite(v) else None) for k, v in d.items()}, indent=2))
    else:
        print(f"step {step} of {a.run_dir}")
        print(report.render())
    return 0
