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

Records are shared, and importing a module runs its code: by default only ``lens_callbacks.*`` and the
``examples`` package shipped beside it are imported; ``--allow-module PKG`` or ``--trust-record`` allow
more (see :mod:`lens_callbacks.io.trust` and docs/security.md). Everything is checked before anything the
record names is called. Every bad input is one line on stderr naming the file and field, exit status 2;
a reading the replay cannot make exactly is a refusal, exit status 3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Optional, Sequence, Union

import torch

from ..credit.engine import disintegrate
from ..credit.guard import non_finite
from ..credit.inputs.partition import resolve_partition
from ..credit.readings.step_readings import RecordingPartition
from ..credit.readings.table import CreditTable, credit_table, module_decoder
from ..credit.report import CreditReport
from ..io.records import RunRecord, step_path
from ..io.trust import TrustPolicy
from ..refusal import Refusal
from ._errors import (
    EXIT_REFUSED,
    OneLineArgumentParser,
    add_debug_flag,
    one_line,
    print_safely,
    report_error,
    shown_path,
)
from .replay import (  # noqa: F401  (load_module, replay_to, rebuild_batch: public here too)
    AUDIT_PARTITIONS,
    PartCountBound,
    check_built_positions,
    check_part_count,
    check_sizes_against_checkpoint,
    check_token_ids,
    load_module,
    make_optimizer,
    manifest_where,
    rebuild_batch,
    replay_blocker,
    replay_to,
    set_recorded_lrs,
    stateless_optimizer,
)

__all__ = [
    "audit_record",
    "audit_record_table",
    "load_module",
    "replay_to",
    "rebuild_batch",
    "main",
    "AUDIT_PARTITIONS",
]


def audit_record(
    run_dir: Union[str, os.PathLike],
    step: int,
    partition: str = "by_rollout",
    dtype: str = "float32",
    *,
    progress: bool = True,
    keep_grads: bool = False,
    module: Optional[torch.nn.Module] = None,
    trust: Optional[TrustPolicy] = None,
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
        trust: what the record's ``module``/``batch_builder`` may name (default: this package and its
            ``examples`` only; see :class:`~lens_callbacks.io.trust.TrustPolicy`).

    Returns:
        The :class:`CreditReport` of that step, or a :class:`Refusal` when the weights at ``step`` cannot
        be rebuilt exactly.
    """
    return audit_record_table(
        run_dir,
        step,
        partition,
        dtype,
        progress=progress,
        keep_grads=keep_grads,
        module=module,
        trust=trust,
        table=False,
    )


def audit_record_table(
    run_dir: Union[str, os.PathLike],
    step: int,
    partition: str = "by_rollout",
    dtype: str = "float32",
    *,
    progress: bool = True,
    keep_grads: bool = False,
    module: Optional[torch.nn.Module] = None,
    trust: Optional[TrustPolicy] = None,
    table: bool = True,
    table_parts: int = 10,
) -> Union[CreditTable, CreditReport, Refusal]:
    """:func:`audit_record`, and the credit table of its report (``table=True``): each part with its group,
    reward, advantage, trained length and, when the module has a ``tokenizer`` (or ``decode_completion``),
    the start of its completion; ``table_parts`` parts shown, the rest summarised."""
    record = run_dir if isinstance(run_dir, RunRecord) else RunRecord(run_dir, trust=trust)  # the manifest read once
    if step not in set(record.steps):
        raise ValueError(
            f"`step` must be a recorded step (have {record.steps[:3]}..{record.steps[-3:]}), got {step!r}."
        )
    start = record.nearest_checkpoint(
        step
    )  # every listed step from there on needs its file: checked before anything is built
    record.check_step_files([s for s in record.steps if start <= s <= step])
    part = AUDIT_PARTITIONS.get(partition) if isinstance(partition, str) else None
    part = part if part is not None else resolve_partition(partition)
    m = replay_to(record, step, module, progress)
    if isinstance(m, Refusal):
        return m
    set_recorded_lrs(record, step, make_optimizer(m))  # the audited step's own metadata is checked too
    batch = rebuild_batch(m, record, step)
    part = PartCountBound(part, str(step_path(record.run_dir, step)), record.limits)
    recorder = RecordingPartition(part, partition if isinstance(partition, str) else "custom")
    try:
        report = disintegrate(m, batch, recorder if table else part, dtype=dtype, keep_grads=keep_grads)
    except (TypeError, IndexError, KeyError, AttributeError, RuntimeError, OverflowError) as err:
        # The module's own code on the batch rebuilt from the record: name the step file (and the builder, if any).
        via = (
            f" (batch from field `batch_builder` of {manifest_where(record)})"
            if record.manifest.get("batch_builder")
            else ""
        )
        raise ValueError(
            f"{step_path(record.run_dir, step)}: auditing the step failed in {type(m).__name__}.credit_terms{via} "
            f"({type(err).__name__}: {one_line(str(err), 300)})."
        ) from None
    if isinstance(partition, str) and report.partition != partition:
        report = _renamed(report, partition)
    refused = non_finite(report, step)  # NaN weights, an overflowing learning rate: no reading (exit status 3)
    if refused is not None:
        return refused
    if not table:
        return report
    terms, parts = recorder.take()
    return credit_table(
        report, terms, parts, decode=module_decoder(m), top_k=(table_parts + 1) // 2, bottom_k=table_parts // 2
    )


def _renamed(report: CreditReport, name: str) -> CreditReport:
    from dataclasses import replace

    return replace(report, partition=name)


def _check_replay_fields(record: RunRecord) -> None:
    """What an exact replay reads from the manifest must be there: a missing field is an error, not a default."""
    where = manifest_where(record)
    man = record.manifest
    for field in ("module", "init_args", "optimizer", "trainer"):
        if field not in man:
            raise ValueError(f"{where}: field `{field}` is missing; records written by RunRecordCallback hold it.")
    missing = [
        k
        for k in ("gradient_clip_val", "gradient_clip_algorithm", "accumulate_grad_batches", "precision", "world_size")
        if k not in man["trainer"]
    ]
    if missing:
        raise ValueError(f"{where}: field `trainer` is missing {missing}; the replay needs every one of them.")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="lens-callbacks audit",
        description="Re-audit one step of a run record and print the report. A record names code (its `module` and "
        "`batch_builder`); by default only modules of lens_callbacks and of the examples package shipped with it are "
        "imported. Importing a module runs its code, so allow anything else (--allow-module, --trust-record) only for "
        "records you trust. A bad input is one line on stderr and exit status 2; a refused reading exit status 3.",
    )
    p.add_argument("run_dir", help="a run record directory (record.json, trajectories/, policy_step_000000.pt)")
    p.add_argument("--step", type=int, default=None, help="the step to audit (default: the last recorded)")
    p.add_argument("--partition", default="by_rollout", help=f"one of {sorted(AUDIT_PARTITIONS)} or an import path")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16 or native")
    p.add_argument("--no-progress", action="store_true", help="hide the replay progress bar")
    p.add_argument(
        "--probe",
        default=None,
        metavar="PROBE_FILE",
        help="probe credit instead: which parts of the step moved the module's probe objective on these "
        "trajectories (JSON Lines in the record's schema), checked against the real change (docs/probe_credit.md)",
    )
    p.add_argument(
        "--table-parts",
        type=_positive_int,
        default=10,
        metavar="N",
        help="parts shown in the table, largest and smallest |projected share| (default 10); the rest summarised",
    )
    p.add_argument("--json", action="store_true", help="print the report's to_dict() as JSON instead of the table")
    p.add_argument(
        "--allow-module",
        action="append",
        default=[],
        metavar="PKG",
        help="also import record `module`/`batch_builder` paths under this package (repeatable); "
        "default: lens_callbacks and its examples only",
    )
    p.add_argument(
        "--trust-record",
        action="store_true",
        help="import whatever the record names (runs that code: only for records you trust)",
    )
    add_debug_flag(p)
    return p


def main(argv: Sequence[str]) -> int:
    p = build_parser()
    a = p.parse_args(list(argv))
    prog = "lens-callbacks audit"
    try:  # every bad input is one line naming the file and field, exit status 2, never a traceback
        trust = TrustPolicy(tuple(a.allow_module), a.trust_record)
        record = RunRecord(a.run_dir, trust=trust)
        if not record.steps:
            raise ValueError(f"{a.run_dir}: the record holds no steps; record at least one training step.")
        _check_replay_fields(record)
        step = record.steps[-1] if a.step is None else a.step
        if a.probe is not None:
            from .probe_audit import probe_audit

            got = probe_audit(record, step, a.probe, a.partition, a.dtype, progress=not a.no_progress, trust=trust)
        else:
            got = audit_record_table(
                record, step, a.partition, a.dtype, progress=not a.no_progress, trust=trust, table_parts=a.table_parts
            )
        if isinstance(got, Refusal):
            print_safely(got.render())
            return EXIT_REFUSED
        if a.json:
            d = got.to_dict() if a.probe is not None else got.report.to_dict("credit/")
            text = json.dumps({k: (v if math.isfinite(v) else None) for k, v in d.items()}, indent=2)
        else:
            text = f"step {step} of {shown_path(a.run_dir)}\n" + got.render()
        print_safely(text)
    except Exception as err:
        return report_error(prog, err, a.debug)
    return 0
