"""``lens-callbacks audit RUN_DIR --step N --probe PROBE.jsonl``: probe credit of one recorded step, offline.

The probe file holds trajectories in the record's own JSON Lines schema (``lens_callbacks.trajectory/1``),
read through the same bounded, validating reader as the record's steps (:func:`lens_callbacks.io.records.
read_trajectories`); its token ids are checked against the policy's vocabulary before anything runs.
The probe batch is ``module.make_probe_batch(trajectories)`` when the module has it, else the
trajectories themselves; the probe objective is ``module.probe_terms(batch)`` or ``module.probe_loss(batch)``.

The weights at step ``N`` are rebuilt as the plain audit does (:func:`~lens_callbacks.commands.audit.replay_to`),
and so is the optimizer's state: the replay's own optimizer is kept. The step is then taken again — the
module's ``credit_terms`` loss, one backward, the module's optimizer at the recorded learning rates — so
the reading holds the prediction, the real change of the probe, and the update applied.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..credit.readings.probe import (
    ProbeCreditReport,
    optimizer_update_map,
    probe_credit,
    probe_value_and_grad,
    update_dot,
    with_actual,
)
from ..io.records import RunRecord, read_trajectories, step_path
from ..io.trust import TrustPolicy
from ..refusal import Refusal
from ._errors import one_line

__all__ = ["probe_audit"]


def _probe_fn(module: Any, record: RunRecord) -> Any:
    for name in ("probe_terms", "probe_loss"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    raise ValueError(
        f"{record.run_dir}/record.json: field `module` names {type(module).__name__}, which has neither "
        "`probe_terms(probe_batch)` nor `probe_loss(probe_batch)`; give the module one of them to audit against a probe "
        "(see docs/probe_credit.md)."
    )


def _non_finite(report: ProbeCreditReport, step: int) -> Optional[Refusal]:
    values = {
        "loss_before": report.loss_before,
        "grad_norm": report.grad_norm,
        "probe_grad_norm": report.probe_grad_norm,
    }
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if not bad:
        return None
    return Refusal(
        "non_finite_gradient",
        f"the step's or the probe's {', '.join(bad)} is not finite ({', '.join(f'{k} = {values[k]!r}' for k in bad)}); "
        "probe credit is undefined.",
        numbers={"step": step, **values},
        remedy="find where the loss becomes non-finite (NaN weights in the checkpoint, an overflowing learning rate); "
        "torch.autograd.set_detect_anomaly(True) names the operation.",
    )


def probe_audit(
    run_dir: Union[str, os.PathLike, RunRecord],
    step: int,
    probe_file: Union[str, os.PathLike],
    partition: str = "by_rollout",
    dtype: str = "float32",
    *,
    progress: bool = True,
    trust: Optional[TrustPolicy] = None,
) -> Union[ProbeCreditReport, Refusal]:
    """Probe credit of recorded step ``step`` against the trajectories of ``probe_file``.

    Returns the :class:`ProbeCreditReport` (actual change included), or a :class:`Refusal` when the step
    cannot be rebuilt exactly or its optimizer is outside the known set.
    """
    from ..credit.inputs.partition import resolve_partition
    from .replay import (
        AUDIT_PARTITIONS,
        PartCountBound,
        check_built_positions,
        check_token_ids,
        load_module,
        make_optimizer,
        rebuild_batch,
        replay_blocker,
        replay_to,
        set_recorded_lrs,
        stateless_optimizer,
    )

    record = run_dir if isinstance(run_dir, RunRecord) else RunRecord(run_dir, trust=trust)
    if step not in set(record.steps):
        raise ValueError(
            f"`step` must be a recorded step (have {record.steps[:3]}..{record.steps[-3:]}), got {step!r}."
        )
    probe_file = Path(probe_file)
    trajectories = read_trajectories(probe_file, record.limits)
    if not trajectories:
        raise ValueError(f"{probe_file}: the probe file holds no trajectories; write one JSON line per trajectory.")
    part = AUDIT_PARTITIONS.get(partition) if isinstance(partition, str) else None
    part = part if part is not None else resolve_partition(partition)

    module = load_module(record, record.nearest_checkpoint(step))
    fn = _probe_fn(module, record)
    check_token_ids(module, trajectories, str(probe_file), record.limits, "the probe batch")
    made: list[torch.optim.Optimizer] = []
    own = module.configure_optimizers

    def keep(*args: Any, **kwargs: Any) -> Any:  # the replay's optimizer, with the state of the steps it took
        out = own(*args, **kwargs)
        made.append(out)
        return out

    module.configure_optimizers = keep  # an instance attribute: the class is left alone
    try:
        m = replay_to(record, step, module, progress)
    finally:
        del module.configure_optimizers
    if isinstance(m, Refusal):
        return m
    if made:
        opt = make_optimizer(_Returns(made[-1]))
    else:  # step is a checkpoint: its weights are recorded, its optimizer state is not
        opt = make_optimizer(m)
        if not stateless_optimizer(opt) and step != 0:
            return Refusal(
                "optimizer_state",
                f"step {step} is a policy checkpoint and the optimizer ({type(opt).__name__}) carries state the record "
                "does not hold, so this step's update cannot be read.",
                numbers={"step": step},
                remedy="audit a step that is not a checkpoint (its state is replayed from step 0)",
            )
    blocker = replay_blocker(record, opt)
    if blocker is not None:
        return blocker
    set_recorded_lrs(record, step, opt)
    tr = record.manifest.get("trainer", {})
    batch = rebuild_batch(m, record, step)
    part = PartCountBound(part, str(step_path(record.run_dir, step)), record.limits)
    make = getattr(m, "make_probe_batch", None)
    try:
        probe_batch = make(trajectories) if callable(make) else trajectories
    except (ValueError, TypeError, KeyError, IndexError) as err:
        raise ValueError(
            f"{probe_file}: the module's make_probe_batch cannot build a probe batch from these trajectories "
            f"({type(err).__name__}: {one_line(str(err), 300)}); write probe turns in the form the module's "
            "docs name."
        ) from None
    check_built_positions(m, probe_batch, str(probe_file))
    params = [p for p in m.parameters() if p.requires_grad]
    m.train()
    with torch.random.fork_rng():
        opt.zero_grad(set_to_none=True)
        m.credit_terms(batch).terms.sum().backward()
        update = optimizer_update_map(
            opt,
            params,
            gradient_clip_val=tr.get("gradient_clip_val"),
            accumulate_grad_batches=int(tr.get("accumulate_grad_batches", 1) or 1),
        )
        if isinstance(update, Refusal):
            return update
        m.eval()  # the probe is evaluated with dropout off, as the callback's default
        loss, gp = probe_value_and_grad(m, fn, probe_batch, dtype=dtype)
        m.train()
        report = probe_credit(
            m,
            batch,
            part,
            update,
            gp,
            probe=probe_file.stem,
            loss_before=loss,
            dtype=dtype,
            step=step,
            texts=[_text(t) for t in record.trajectories(step)],
        )
        refused = _non_finite(report, step)
        if refused is not None:
            opt.zero_grad(set_to_none=True)
            return refused
        before = [p.detach().clone() for p in params]
        opt.step()
        m.eval()
        after, _ = probe_value_and_grad(m, fn, probe_batch, dtype=dtype, grad=False)
    opt.zero_grad(set_to_none=True)
    return with_actual(report, after, applied=update_dot(before, params, gp))


class _Returns:
    """Hands a kept optimizer to :func:`make_optimizer`, which unpacks what ``configure_optimizers`` returns."""

    def __init__(self, out: Any) -> None:
        self._out = out

    def configure_optimizers(self) -> Any:
        return self._out


def _text(traj: Any) -> str:
    return " | ".join(t.text for t in traj.turns if t.role != "system")
