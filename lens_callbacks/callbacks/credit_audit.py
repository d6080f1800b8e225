"""``CreditAuditCallback``: disintegrate every (n-th) step the module actually trained on.

A thin adapter over :func:`lens_callbacks.credit.disintegrate`: at ``on_before_optimizer_step`` (the
step's unclipped ``.grad`` is in place) it re-evaluates ``pl_module.credit_terms(batch)`` on detached
copies of the parameters with the engine ``engine`` names (``"auto"``: one forward and one backward for
row partitions, see :mod:`lens_callbacks.credit.engines`), or reads the training step's own backward
(``capture="training_step"``), and logs the readings through
:class:`~lens_callbacks.metrics.credit.CreditMetric`. It is read-only: parameters, ``.grad``, optimizer
state and the random stream are left as they were.

DDP / FSDP2 (``scope="global"``, the default): each rank disintegrates its local batch and dots its
parts with the rank-averaged ``.grad`` the optimizer applies; the global reading
(:func:`lens_callbacks.credit.readings.distributed.global_report`) names the parts ``r{rank}/{name}``, its shares
sum to 1 over all ranks, and cancellation, conservation and ``grad_match`` are those of the global step.
Cost per audited step: a few scalar all-gathers and one all-reduce of ``2·|θ|`` elements.
``scope="rank"`` keeps the per-rank readings instead (no collective; ``grad_match`` is then not read,
since the local ``g_full`` is not the rank average). With gradient accumulation ``.grad`` sums several
micro-batches and the audit sees the last one, so ``grad_match`` is not read and the reading is per rank.
Under ``bf16-mixed``/``16-mixed`` ``credit_terms`` is re-evaluated under the trainer's autocast, so the
audit reads the function that was trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from lens_callbacks.credit.engine import disintegrate, resolve_dtype
from lens_callbacks.credit.engines import check_engine
from lens_callbacks.credit.engines.ghost import SPLITS_ROWS, RideAlong, SpansInteract, report_accumulated
from lens_callbacks.credit.guard import Suspects, guard, non_finite
from lens_callbacks.credit.inputs.partition import (
    PARTITION_REMEDY,
    POSITIONAL_PARTITIONS,
    MissingSegmentsError,
    PartitionError,
    resolve_partition,
)
from lens_callbacks.credit.inputs.terms import CreditTermsError, is_credit_source
from lens_callbacks.credit.primitives import compiled_parts
from lens_callbacks.credit.readings.mismatch import grad_match_threshold, terms_not_loss_words
from lens_callbacks.credit.readings.step_readings import RecordingPartition, StepReadings
from lens_callbacks.credit.readings.table import CreditTable, credit_table, module_decoder
from lens_callbacks.credit.readings.update_share import update_shares as _update_shares
from lens_callbacks.credit.replay import StepReplay
from lens_callbacks.credit.report import CreditReport
from lens_callbacks.metrics.credit import CreditMetric
from lens_callbacks.metrics.part_shares import PartShares
from lens_callbacks.refusal import Refusal

from ._capture import check_capture, compiled_blocks_ride
from ._logging import OncePerCause, log_dir, log_figure, log_scalars, log_text, tensorboard_dir
from ._mergers import grad_mergers, merger_at, pre_merge_reference

__all__ = ["CreditAuditCallback", "ExtraReadings"]

LAST_REPORT_FILE = "credit_last.txt"

#: The fields of :class:`ExtraReadings` by their deprecated names as ``CreditAuditCallback`` options.
_OLD_EXTRAS = {
    "extra_partitions": "partitions",
    "log_positional_parts": "log_positional_parts",
    "concentration_top_k": "concentration_top_k",
    "noise_ema": "noise_ema",
    "update_shares": "update_shares",
    "position_split": "position_split",
}


@dataclasses.dataclass(frozen=True)
class ExtraReadings:
    """The readings beyond the primary shares that ``CreditAuditCallback(extras=...)`` takes from the same audit.

    Args:
        partitions: more partitions read from the same audit (e.g. ``["by_advantage_sign", "by_source"]``; None: none): a
            partition whose parts are unions of the primary parts (rows) gets its shares by summing, with no
            backward pass; any other one costs one more disintegration.
        log_positional_parts: log ``projected_share/<part>`` and ``norm_share/<part>`` for positional
            partitions (``by_rollout``, ``by_group``), whose part names are batch positions that mean another
            rollout at every step. Off by default; the per-part table stays in the text view.
        concentration_top_k: ``credit/concentration/topk_share`` adds this many largest shares.
        noise_ema: smoothing factor of ``credit/noise/*_ema`` (exponential moving average), in [0, 1).
        update_shares: also split the update the optimizer applied on each audited step by part,
            ``<g_S, θ_before − θ_after> / <g, θ_before − θ_after>`` at ``θ_before`` (one copy of the trainable
            parameters per audited step, one backward and one forward-mode pass after the step); logged as
            ``update_share/<part>``, ``update_share_sum``, ``update_grad_cosine``, ``update_conservation_error``.
            See docs/readings.md.
        position_split: also split each step by the positions its gradient was computed at — every position by
            its segment (``CreditTerms.segment``), a turn's prompt, user and tool tokens included — beside the
            loss-mask split, in the same one-pass reading (riding along too): logged as
            ``position_split/projected_share/<segment>`` and tabled under the report. About one more product
            the size of each layer's forward. See docs/multi_turn.md.

    Example:
        >>> ExtraReadings(partitions=["by_advantage_sign"], position_split=True).partitions
        ('by_advantage_sign',)
        >>> ExtraReadings(noise_ema=1.0)
        Traceback (most recent call last):
        ...
        ValueError: `noise_ema` must be in [0, 1), got 1.0.
    """

    partitions: Optional[Sequence[str]] = ()
    log_positional_parts: bool = False
    concentration_top_k: int = 3
    noise_ema: float = 0.9
    update_shares: bool = False
    position_split: bool = False

    def __post_init__(self) -> None:
        if self.partitions is None:  # as YAML's `partitions: null` reads
            object.__setattr__(self, "partitions", ())
        if isinstance(self.partitions, str) or not isinstance(self.partitions, (list, tuple)):
            raise ValueError(f"`partitions` must be a list of partition names, got {self.partitions!r}.")
        object.__setattr__(self, "partitions", tuple(self.partitions))
        for name in ("log_positional_parts", "update_shares", "position_split"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        k = self.concentration_top_k
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"`concentration_top_k` must be an int >= 1, got {k!r}.")
        ema = self.noise_ema
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0.0 <= ema < 1.0:
            raise ValueError(f"`noise_ema` must be in [0, 1), got {ema!r}.")


def _extras_from(extras: Optional[Union[ExtraReadings, Mapping[str, Any]]], old: dict[str, Any]) -> ExtraReadings:
    """``extras``, with the fields given under their deprecated option names (a FutureWarning) filled in."""
    if isinstance(extras, Mapping):  # a config read as plain data (a dict from YAML, Hydra, JSON)
        unknown = sorted(set(extras) - {f.name for f in dataclasses.fields(ExtraReadings)})
        if unknown:
            raise ValueError(
                f"`extras` must name fields of ExtraReadings {[f.name for f in dataclasses.fields(ExtraReadings)]}, "
                f"got {unknown}."
            )
        extras = ExtraReadings(**extras)
    if extras is not None and not isinstance(extras, ExtraReadings):
        raise ValueError(
            f"`extras` must be an ExtraReadings (from lens_callbacks import ExtraReadings) or a dict of its fields, "
            f"got {type(extras).__name__}."
        )
    given = {k: v for k, v in old.items() if v is not None}
    if not given:
        return extras if extras is not None else ExtraReadings()
    if extras is not None:
        raise ValueError(
            f"{sorted(given)} are the old names of fields of `extras`; give them in `extras` only, got both."
        )
    names = sorted(given)
    warnings.warn(
        f"CreditAuditCallback: the options {', '.join(f'`{k}`' for k in names)} are deprecated and will be removed in the next "
        f"release; use extras=ExtraReadings({', '.join(f'{_OLD_EXTRAS[k]}=...' for k in names)}) (in YAML: "
        "`extras: {" + ", ".join(f"{_OLD_EXTRAS[k]}: ..." for k in names) + "}`).",
        FutureWarning,
        stacklevel=3,
    )
    fields = {_OLD_EXTRAS[k]: v for k, v in given.items()}
    if isinstance(fields.get("partitions"), list):
        fields["partitions"] = tuple(fields["partitions"])
    return ExtraReadings(**fields)


class CreditAuditCallback(Callback):
    """Exact credit per part of every ``every_n_steps``-th optimizer step, logged as it trains.

    Logged (``prefix`` = ``credit/``): ``cancellation``, ``cancelled_fraction``, ``conservation_error``,
    ``grad_match``, ``share_sum``, ``full_grad_norm``, ``undefined_fraction``, ``n_parts``, ``n_trained``
    and ``projected_share/<part>``, ``norm_share/<part>`` for the first ``max_logged_parts`` parts, every
    audited step; their means over the epoch as ``credit/epoch/...``. The credit table
    (:func:`lens_callbacks.credit.readings.table.credit_table`: parts by ``|projected share|``, each with its
    group, reward, advantage, trained length and, when the terms carry ``text`` or the module a
    ``tokenizer``, the start of its completion) goes to TensorBoard as text (``credit/table``) every
    ``log_table_every_n_steps`` steps and for the last audit; with matplotlib, a heatmap of projected
    share per part over steps (``credit/heatmap``).

    Args:
        partition: ``"by_rollout"``, ``"by_group"``, ``"by_segment"`` or an import path
            ``"package.module.function"`` (a ``CreditTerms -> Partition`` callable); or a list, whose first
            entry is the primary partition and the rest extra partitions (``extras.partitions``).
        every_n_steps: audit the steps with ``global_step % every_n_steps == 0``.
        dtype: audit precision: ``"float32"`` (default), ``"float64"``, ``"bfloat16"`` or ``"native"``.
        log_table_every_n_steps: at least this many steps between two text tables (0: only the last).
        max_logged_parts: per-part scalars for the first this-many parts.
        table_parts: parts shown in the text table, half of largest and half of smallest ``|projected
            share|``; the parts between are summarised in one line (their share summed).
        keep_grads: attach ``g_full`` and ``Σ g_S`` to ``last_report.grads`` (other callbacks may set it).
        log_figure: log the heatmap figure when matplotlib is importable.
        log_figure_every_n_steps: at least this many steps between two drawings of the figures (heatmap,
            interference, Lorenz curve, ledgers), which go with a text table; 0: only at fit end. Drawing
            them costs about 20 steps of the demo's policy, so a table every step no longer draws them every
            step (``benchmarks/figure_cost.py``).
        print_last_report: print the last table and the ``tensorboard --logdir`` line at the end of fit.
        prefix: metric namespace.
        extras: the readings beyond the primary shares (extra partitions, concentration, noise scale, the
            update's split, the position split), as an :class:`ExtraReadings` or a dict of its fields; None: its
            defaults. In YAML
            ``extras: {partitions: [by_advantage_sign], position_split: true}``.
        scope: ``"global"`` (default): under DDP/FSDP the reading is of the global step, every rank's parts
            against the averaged ``.grad``; ``"rank"``: each rank's own batch against its own gradient.
        precision_context: evaluate ``credit_terms`` under ``trainer.precision_plugin.forward_context()``
            (autocast for mixed precision), as ``training_step`` runs; False audits outside it.

        engine: ``"auto"`` (default: the fastest exact engine for the partition), ``"reference"``,
            ``"ghost"`` (one pass, row partitions) or ``"jvp"``; see :mod:`lens_callbacks.credit.engines`.
            Logged as ``credit/engine/<name>`` = 1 and in the table.
        readings: ``"all"`` (default: projected and norm shares, cancellation and, from the one-pass
            engine, the interference matrix), ``"shares"`` (the same without the interference matrix,
            whose ``m²·|θ|`` products are about half a step at m = 64 on a toy policy) or ``"projected"``
            (projected shares only; cheapest). See docs/performance.md for each one's cost.
        capture: ``"separate"`` (default: the audit re-runs ``credit_terms`` in its own pass) or
            ``"training_step"``: the one-pass engine's hooks ride on the training step's own forward
            and backward, ``g_full`` is the trainer's ``.grad``, and the audit adds only the per-layer
            reductions. With ``accumulate_grad_batches = k`` every micro-batch is captured on its own
            backward (of ``terms.sum() / k``, as Lightning scales it) and the step is read once, before the
            optimizer step, against the accumulated ``.grad``: the readings describe the whole step, in
            ``.grad``'s units (the covered layers' inputs and output gradients of the step's micro-batches
            are held until then). Where that cannot be checked (the loss is not ``terms.sum()``, several
            processes, manual optimization, a parameter outside the covered layers) the step is audited by
            the separate pass instead, and a warning says so once.
        full_grad: ``"own"`` (default: the separate pass takes ``g_full`` by its own backward and reads
            ``grad_match`` against ``.grad``) or ``"trainer"``: ``g_full`` is the trainer's ``.grad`` of this
            batch, so the one-pass engine's backward forms no weight gradient (a separate pass about a
            third of a backward cheaper); ``conservation_error`` then holds the parts against ``.grad``
            directly and ``grad_match`` is not read. Under several processes, accumulation, manual
            optimization, a merger, or a partition the one-pass engine cannot read, the audit takes its
            own ``g_full`` and a warning says so once.

        extra_partitions, log_positional_parts, concentration_top_k, noise_ema, update_shares, position_split:
            deprecated names of the fields of ``extras`` (``extra_partitions`` is ``extras.partitions``); each
            still works for one release, with a FutureWarning.

    Readings beyond the primary report (see docs/readings.md): ``credit/concentration/...`` of the
    primary partition, ``credit/noise/...`` (when its parts are whole rows), ``credit/<extra>/...``
    per extra partition, and ``credit/ledger/<book>/<partition>/<part>`` for every stable-name
    partition; figures ``credit/concentration/lorenz`` and ``credit/ledger/<book>/<partition>``.

    Attributes:
        last_report: the latest :class:`CreditReport` (``None`` before the first or after a refused audit).
        last_report_step: ``trainer.global_step`` when it was made (before the optimizer step increments it).
        last_table: the :class:`~lens_callbacks.credit.readings.table.CreditTable` of ``last_report``.
        last_refusal: the latest :class:`~lens_callbacks.refusal.Refusal`, if an audit was declined.
        last_values: the scalars logged for the latest audited step (name -> value).
        last_epoch_values: the epoch means logged at the latest epoch end.
        last_epoch_shares: every part's epoch projected share at the latest epoch end, by part name
            (a part absent at a step counts as 0 that step, so they sum to 1; the first
            ``max_logged_parts`` are logged as ``credit/epoch/projected_share/<part>``).

    Scalars go to ``trainer.loggers`` at the audited step itself (``trainer.global_step``), from rank 0;
    steps that ``every_n_steps`` skips get no value rather than a repeated one.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lens_callbacks import CreditAuditCallback
        >>> audit = CreditAuditCallback(partition="by_turn", capture="training_step", readings="projected")
        >>> trainer = Trainer(callbacks=[audit], max_steps=100, logger=False, enable_checkpointing=False)
        >>> CreditAuditCallback(capture="later")
        Traceback (most recent call last):
        ...
        ValueError: `capture` must be one of ['separate', 'training_step'], got 'later'.
    """

    #: Packed rollouts are read position by position, exact where attention stays inside each rollout; every
    #: this-many-th such reading (the first included) holds its largest rollout to its own masked backward
    #: (one backward; riding along, one separate pass). 0: never.
    verify_spans_every: int = 10

    def __init__(
        self,
        partition: Union[str, list[str]] = "by_rollout",
        every_n_steps: int = 1,
        dtype: str = "float32",
        log_table_every_n_steps: int = 10,
        max_logged_parts: int = 16,
        table_parts: int = 10,
        keep_grads: bool = False,
        log_figure: bool = True,
        print_last_report: bool = False,
        prefix: str = "credit/",
        extras: Optional[ExtraReadings] = None,
        scope: str = "global",
        precision_context: bool = True,
        engine: str = "auto",
        readings: str = "all",
        capture: str = "separate",
        full_grad: str = "own",
        log_figure_every_n_steps: int = 100,
        *,
        extra_partitions: Optional[Sequence[str]] = None,
        log_positional_parts: Optional[bool] = None,
        concentration_top_k: Optional[int] = None,
        noise_ema: Optional[float] = None,
        update_shares: Optional[bool] = None,
        position_split: Optional[bool] = None,
    ) -> None:
        super().__init__()
        check_engine(engine, readings)  # raises, naming the valid engines and readings
        check_capture(capture)
        if full_grad not in ("own", "trainer"):
            raise ValueError(
                f"`full_grad` must be 'own' (g_full by the audit's own backward) or 'trainer' (the trainer's .grad), got {full_grad!r}."
            )
        if scope not in ("global", "rank"):
            raise ValueError(f"`scope` must be 'global' or 'rank', got {scope!r}.")
        extras = _extras_from(
            extras,
            dict(
                extra_partitions=extra_partitions,
                log_positional_parts=log_positional_parts,
                concentration_top_k=concentration_top_k,
                noise_ema=noise_ema,
                update_shares=update_shares,
                position_split=position_split,
            ),
        )
        partition, more = _split_partitions(partition, extras.partitions)
        extras = dataclasses.replace(extras, partitions=tuple(more))
        self.extras = extras
        if not (isinstance(partition, str) and "." in partition):
            resolve_partition(partition)  # an unknown name raises here, naming the valid ones
        # An import path is resolved in setup: the error still comes before any step runs.
        for name, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("log_table_every_n_steps", log_table_every_n_steps, 0),
            ("max_logged_parts", max_logged_parts, 0),
            ("table_parts", table_parts, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
        if (
            not isinstance(log_figure_every_n_steps, int)
            or isinstance(log_figure_every_n_steps, bool)
            or log_figure_every_n_steps < 0
        ):
            raise ValueError(
                f"`log_figure_every_n_steps` must be an int >= 0, got {log_figure_every_n_steps!r}; e.g. 100."
            )
        self.log_figure_every_n_steps = log_figure_every_n_steps
        self._last_figure_step: Optional[int] = None
        resolve_dtype(dtype)  # raises, naming the valid options
        self.partition = partition
        self.every_n_steps = every_n_steps
        self.dtype = dtype
        self.log_table_every_n_steps = log_table_every_n_steps
        self.max_logged_parts = max_logged_parts
        self.table_parts = table_parts
        self.keep_grads = bool(keep_grads)
        self.log_figure = log_figure
        self.print_last_report = print_last_report
        self.prefix = prefix
        self._update_before: Optional[tuple[int, dict[str, torch.Tensor]]] = None  # (step, θ_before)
        self.scope = scope
        self.precision_context = bool(precision_context)
        self._global = False  # set in setup: a multi-rank run read as one global step
        self._sharded = False  # read at each audited step: FSDP2 DTensor parameters, gathered for the audit
        self.engine = engine
        self.readings = readings  # which readings the engine makes ("all" | "shares" | "projected")
        self.capture = capture
        self.full_grad = full_grad
        self._full_grad_blocked: Optional[str] = None  # why .grad cannot be this batch's g_full (set in setup)
        self._full_grad_warned = False
        self._ride: Optional[RideAlong] = None
        self._rides: list[RideAlong] = []  # the audited step's earlier micro-batches, captured (accumulation)
        self._rides_step: Optional[int] = None
        self._ride_blocked: Optional[str] = None  # why this run cannot ride along (set in setup)
        self._grad_blocked: Optional[str] = None  # why `.grad` is not this batch's gradient (set in setup)
        self._within = False  # the partition puts positions of one row in different parts (by name)
        self._tangent_on_grad = False  # riding along on parts inside rows: the forward-mode pass along `.grad`
        self._accumulation = 1  # the trainer's accumulate_grad_batches (set in setup)
        self._replay = StepReplay()  # the audited step's micro-batches, replayed by the separate pass
        self._replay_step: Optional[int] = None
        self._replay_fn: Any = None  # the replay the latest audit read (update_shares reads it again)
        self._compiled: Optional[list[str]] = None
        self.last_withheld: Optional[CreditReport] = None
        self.n_spans_readings = 0  # readings of packed rollouts (parts read as spans of rows)
        self.n_spans_checks = 0  # of which held to one part's own backward
        self._spans_failed = False  # the latest check of packed rollouts failed
        self._ride_warned = False
        self.n_ride_along = 0

        self.last_report: Optional[CreditReport] = None
        self.last_report_step: int = -1
        self.last_table: Optional[CreditTable] = None
        self.last_refusal: Optional[Refusal] = None
        self.n_audits = 0
        self.n_refusals = 0
        # One warning per cause (a refusal's condition, the terms not being the loss), not one per step,
        # and the refusals counted for the summary at the end of fit.
        self._once = OncePerCause("CreditAuditCallback")
        self.metric = CreditMetric(max_parts=max_logged_parts)
        self.part_shares = PartShares()  # epoch shares keyed by part name (docs/metrics.md)
        self._partition_fn: Any = None
        self._batch: Any = None
        self._reference: Optional[str] = "grad"
        self._last_text: Optional[tuple[int, str]] = None  # (step, rendered table)
        self._last_defined: Optional[tuple[int, str]] = None  # the latest reading whose shares are defined
        self._last_table_step: Optional[int] = None
        self._history: list[tuple[int, tuple[str, ...], tuple[float, ...]]] = []
        self._mergers: list[Any] = []  # callbacks that may change .grad before the optimizer step
        self._audited_step: Optional[int] = None
        self._merge_noted = False
        self._last_error: Optional[BaseException] = None
        self._epoch_of_state: Optional[int] = None  # the epoch the metric's readings belong to
        self._epoch_last_step = 0
        self.last_epoch_step: Optional[int] = None  # the step the latest epoch readings were logged at
        self.last_values: dict[str, float] = {}
        self.last_epoch_values: dict[str, float] = {}
        self._init_readings(extras)
        self.last_epoch_shares: dict[str, float] = {}  # every part's epoch projected share, logged or not

    @property
    def update_shares(self) -> bool:
        """``extras.update_shares``."""
        return self.extras.update_shares

    @property
    def position_split(self) -> bool:
        """``extras.position_split``."""
        return self.extras.position_split

    @property
    def log_positional_parts(self) -> bool:
        """``extras.log_positional_parts``."""
        return self.extras.log_positional_parts

    @property
    def extra_partitions(self) -> list:
        """``extras.partitions`` (a list's tail given as ``partition`` included)."""
        return list(self.extras.partitions)

    @property
    def state_key(self) -> str:
        # Everything that makes two audits' state (epoch means, ledgers, counts) different readings.
        return self._generate_state_key(
            partition=str(self.partition),
            every_n_steps=self.every_n_steps,
            dtype=self.dtype,
            prefix=self.prefix,
            scope=self.scope,
        )

    # ---- setup: misconfiguration is an error here, before any step runs --------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not is_credit_source(pl_module):
            raise TypeError(
                f"CreditAuditCallback needs the LightningModule to implement `credit_terms(batch) -> CreditTerms` "
                f"(see lens_callbacks.credit.CreditSource), got {type(pl_module).__name__} without it. "
                "Implement it, or remove the callback."
            )
        self._partition_fn = resolve_partition(self.partition)
        self._setup_readings()
        self.metric = self.metric.to(pl_module.device)
        self._reference = "grad"
        self._mergers = grad_mergers(trainer, keep_pre_merge=True)
        self._accumulation = int(trainer.accumulate_grad_batches)
        if trainer.world_size > 1:
            # .grad is the rank average: a local audit of one rank's batch cannot match it.
            self._reference = None
        blocked = None  # why .grad cannot be read as this batch's own gradient (riding along, full_grad="trainer")
        if trainer.world_size > 1:
            blocked = "several processes: `.grad` is the rank average, not this rank's terms' gradient"
        elif not getattr(pl_module, "automatic_optimization", True):
            blocked = "manual optimization: the callback does not see the loss's backward"
        elif self._mergers:
            blocked = f"{type(self._mergers[0]).__name__} may merge `.grad` before this callback reads it"
        self._grad_blocked = blocked
        self._ride_blocked = blocked if self.capture == "training_step" else None
        # Parts inside rows riding on the step: `.grad` is g_full, the forward-mode pass along it is the audit.
        self._within = _name_of(self.partition) in WITHIN_ROW_PARTITIONS
        self._tangent_on_grad = self.capture == "training_step" and self._within and blocked is None
        self._say_within_cost(trainer)
        # With accumulation the separate pass replays every micro-batch of the step (credit/replay.py), whose
        # gradient is then `.grad` itself: full_grad="trainer" holds.
        self._full_grad_blocked = blocked if self.full_grad == "trainer" else None
        self._compiled = None  # read at the first step: configure_model may compile after setup
        self._replay = StepReplay(scale_by=self._accumulation, skip=_lightning_internals())
        self._setup_distributed(trainer, pl_module)

    def _setup_distributed(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from ._distributed import check_strategy, is_sharded

        check_strategy(trainer, "CreditAuditCallback")
        self._sharded = is_sharded(pl_module)
        # With accumulation every micro-batch is replayed, so the local reading is of the rank's whole step.
        self._global = self.scope == "global" and trainer.world_size > 1

    # ---- the audit --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        self._close_stale_epoch(trainer)
        self._stop_ride()
        if self._compiled is None:
            self._note_compiled(pl_module)
        if self._rides_step != trainer.global_step:
            self._drop_rides()  # a step that ended without its optimizer step (or a new one)
        if self._replay_step != trainer.global_step:
            self._replay.clear()  # a step that ended without its optimizer step (or a new one)
            self._replay_step = trainer.global_step
        if (
            self.capture == "training_step"
            and self._ride_blocked is None
            and not self._tangent_on_grad
            and trainer.global_step % self.every_n_steps == 0
        ):
            self._ride = RideAlong(pl_module).start()
            self._rides_step = trainer.global_step

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._ride is None:
            return
        k = int(trainer.accumulate_grad_batches)
        if k == 1:
            # With the partition known now, each parameter is reduced inside the training backward.
            self._ride.on_loss(
                loss,
                self._ride_partition(),
                readings=self.readings,
                keep_grads=self.keep_grads,
                position_split=self.position_split,
            )
        else:  # only captured: the step is read after its last micro-batch (Lightning divides the loss by k)
            self._ride.on_loss(loss, scale=1.0 / k)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._ride is not None:
            self._ride.stop()  # captured; another callback's pass before the reading is not the training step's
        # Each micro-batch of an accumulated step, as it trained: its batch and what training_step cached.
        if self._accumulation > 1 and trainer.global_step % self.every_n_steps == 0 and self._batch is not None:
            self._replay.add(pl_module, self._batch)

    def _note_compiled(self, pl_module: LightningModule) -> None:
        """Read once, at the first step: a compiled module's riding along is blocked (its hooks would change
        the compiled step), the separate pass runs the module eagerly."""
        self._compiled = compiled_parts(pl_module)
        if (
            self._compiled
            and self.capture == "training_step"
            and self._ride_blocked is None
            and not self._tangent_on_grad
        ):
            self._ride_blocked = compiled_blocks_ride(self._compiled)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._update_before is not None:
            self._update_share_hook(trainer, pl_module, "after")
        self._batch = None
        if self._ride is not None and trainer.accumulate_grad_batches > 1:
            self._ride.stop()  # its hooks off before the next micro-batch; its captures kept for the step's reading
            self._rides.append(self._ride)
            self._ride = None
        self._stop_ride()
        step, self._audited_step = self._audited_step, None
        if step is None or not self._mergers:
            return
        # Every callback's on_before_optimizer_step has run by now, wherever this one is listed.
        merger = merger_at(self._mergers, step)
        self.last_values[f"{self.prefix}applied_grad_differs"] = 1.0 if merger is not None else 0.0
        log_scalars(
            trainer,
            {f"{self.prefix}applied_grad_differs": self.last_values[f"{self.prefix}applied_grad_differs"]},
            step,
        )
        if merger is not None and not self._merge_noted:
            self._merge_noted = True
            log_text(
                trainer,
                f"{self.prefix}note",
                f"From step {step} on, {type(merger).__name__} merged .grad before the optimizer step "
                f"(credit/applied_grad_differs = 1 on those steps). The credit readings describe the gradient the "
                "module produced, before any merger; grad_match is read against that gradient.",
                step,
            )

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_ride()
        self._drop_rides()

    def _ride_partition(self) -> Any:
        return self._partition_fn if self._partition_fn is not None else resolve_partition(self.partition)

    def _stop_ride(self) -> None:
        if self._ride is not None:
            self._ride.clear()
            self._ride = None

    def _drop_rides(self) -> None:
        rides, self._rides = self._rides, []
        for r in rides:
            r.clear()

    def _read(self, trainer: Trainer, pl_module: LightningModule) -> Union[CreditReport, Refusal]:
        """The ride-along reading when this step rode along and its contract held; else the separate pass."""
        why = self._ride_blocked if self.capture == "training_step" else None
        ride, self._ride = self._ride, None
        earlier, self._rides = self._rides, []
        if ride is not None:
            name = self.partition if isinstance(self.partition, str) else "custom"
            try:
                if trainer.accumulate_grad_batches > 1:
                    got = report_accumulated(
                        earlier + [ride],
                        self._ride_partition(),
                        partition_name=name,
                        readings=self.readings,
                        keep_grads=self.keep_grads,
                        position_split=self.position_split,
                    )
                else:
                    got = ride.report(
                        self._ride_partition(),
                        partition_name=name,
                        readings=self.readings,
                        keep_grads=self.keep_grads,
                    )
            except Exception as err:  # a user-data failure must not end the training run
                got = f"{type(err).__name__}: {err}"
            finally:
                for r in earlier + [ride]:
                    r.clear()
            if isinstance(got, CreditReport):
                self.n_ride_along += 1
                return got
            if got.startswith(SPLITS_ROWS) and self.readings == "projected":
                # parts inside rows: the contract held, so `.grad` is this step's g_full; the tangent pass reads it
                return self.audit(pl_module, self._batch, use_grad=True)
            why = got
        elif self._tangent_on_grad:
            return self.audit(pl_module, self._batch, use_grad=True)
        if why is not None and not self._ride_warned:
            self._ride_warned = True
            warnings.warn(
                f"credit audit: capture='training_step' falls back to a separate pass ({why}).",
                RuntimeWarning,
                stacklevel=2,
            )
        return self.audit(pl_module, self._batch)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps != 0:
            return
        self._last_error = None
        from ._distributed import is_sharded

        self._sharded = is_sharded(pl_module)  # FSDP2 shards in configure_model, after setup
        if self._global or self._sharded:
            self._stop_ride()
            reading = self._audit_distributed(trainer, pl_module, self._batch)
        else:
            reading = self._read(trainer, pl_module)
        if self.n_audits == 0 and isinstance(self._last_error, MissingSegmentsError):
            # A set-up error, not a property of this step: say it once, now, rather than refuse every step.
            err = str(self._last_error)
            fallback = "" if "partition='by_rollout'" in err else " Or use partition='by_rollout'."  # said once
            raise ValueError(
                f"`partition` must match what credit_terms returns, got partition={self.partition!r} on terms without "
                f"segment ids: {err}{fallback}"
            ) from self._last_error
        reading = self._guard(trainer, self._refuse_non_finite(self._checked_spans(pl_module, reading), step), step)
        self._audited_step = step
        self._epoch_of_state, self._epoch_last_step = int(trainer.current_epoch), step
        self.n_audits += 1
        if isinstance(reading, Refusal):
            self._drop_recorded()
            self.n_refusals += 1
            self.last_report, self.last_report_step, self.last_refusal = None, -1, reading
            self.last_table = None
            self._once.refused(trainer, reading, step, what="credit audit")
            # One update per reading: forward() below adds this step to the epoch state itself.
            # A withheld reading still shows its figure and floor; its shares are not logged.
            shown = {
                k: reading.numbers[k] for k in ("conservation_error", "conservation_floor") if k in reading.numbers
            }
            values = self._flatten(self.metric(defined=False), (), extra={"refused": 1.0, **shown})
            text = reading.render()
            log_text(trainer, f"{self.prefix}refusal", text, step)  # every refusal, whatever the cadence
        else:
            self.last_report, self.last_report_step = reading, step
            self._check_terms_are_loss(trainer, reading, step)
            values = self.metric_values(reading)
            if reading.ok:
                self.part_shares.update(reading.part_names, reading.projected_share, reading.norm_share)
            terms, partition = self._recorder.take() if self._recorder is not None else (None, None)
            values = self._with_readings(pl_module, reading, values, step, terms, partition)
            self._history.append((step, reading.part_names, reading.projected_share))
            del self._history[:-256]
            self.last_table = self._table(pl_module, reading, terms, partition)
            text = self.last_table.render()
            if reading.ok:
                self._last_defined = (step, text)
        self._last_text = (step, text)
        self.last_values = values
        log_scalars(trainer, values, step)
        if self.log_table_every_n_steps and (
            self._last_table_step is None or step - self._last_table_step >= self.log_table_every_n_steps
        ):
            self._log_table(trainer, step, text)
        if self.update_shares:
            self._update_share_hook(trainer, pl_module, "before")

    def _update_share_hook(self, trainer: Trainer, pl_module: LightningModule, when: str) -> None:
        """Copy θ_before of an audited step (``"before"``); split the applied update by part (``"after"``)."""
        if when == "before":
            params = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
            self._update_before = (trainer.global_step, params)
            return
        step, before = self._update_before
        self._update_before = None
        try:
            with torch.enable_grad():
                report = _update_shares(
                    pl_module,
                    self._batch,
                    self._partition_fn if self._partition_fn is not None else self.partition,
                    before,
                    dtype=self.dtype,
                    terms_fn=self._replay_fn,
                )
        except Exception as err:  # a reading that cannot be made must not end the training run
            refusal = Refusal(
                "update_share",
                f"{type(err).__name__}: {err}",
                numbers={"step": step},
                remedy=(
                    "give credit_terms forward-mode derivatives (attn_implementation 'sdpa' or 'eager'; a fused kernel "
                    "such as flash_attention_2 has none), or set extras.update_shares=False"
                ),
            )
            self._once.refused(trainer, refusal, step, what="update shares")
            log_text(trainer, f"{self.prefix}update_share_refusal", refusal.render(), step)
            return
        values = report.to_dict(self.prefix, max_parts=self.max_logged_parts)
        primary = self.step_readings.primary_name
        if report.ok and primary not in POSITIONAL_PARTITIONS:
            # Stable part names only: a positional part is another rollout at every step.
            self.record_ledger("update", primary, dict(zip(report.part_names, report.update_share)), step)
            values.update(
                {k: v for k, v in self.step_readings.ledger.to_dict(f"{self.prefix}ledger/").items() if "/update/" in k}
            )
        self.last_values.update(values)
        log_scalars(trainer, values, step)

    def audit(
        self, pl_module: LightningModule, batch: Any, use_grad: bool = False, verify: Optional[bool] = None
    ) -> Union[CreditReport, Refusal]:
        """One disintegration of the step; a reading that cannot be made is a :class:`Refusal`.

        ``use_grad``: ``.grad`` is this step's ``g_full`` (riding along on parts inside rows), as with
        ``full_grad="trainer"``. ``verify``: hold one part of packed rollouts to its own masked backward
        (default: every ``verify_spans_every``-th reading of packed rollouts)."""
        due = self._spans_due() if verify is None else verify
        try:
            with torch.enable_grad():  # the hook may run inside optimizer.step with grad mode off
                kw = dict(
                    dtype=self.dtype,
                    keep_grads=self.keep_grads,
                    forward_context=self._forward_context(pl_module),
                    engine=self.engine,
                    readings=self.readings,
                    terms_fn=self._step_terms(pl_module),
                    verify_part="spans" if due else False,
                    position_split=self.position_split,
                )
                part = self._partition_fn if self._partition_fn is not None else self.partition
                full = self._trainer_grad(pl_module, use_grad)
                if full is not None:
                    try:
                        return disintegrate(pl_module, batch, part, full_grad=full, **kw)
                    except ValueError as err:
                        if "`full_grad`" not in str(err):
                            raise
                        self._full_grad_blocked = str(err)  # the partition needs an engine that takes no .grad
                        self._warn_full_grad()
                return disintegrate(pl_module, batch, part, reference_grads=self._pre_merge_reference(pl_module), **kw)
        except Exception as err:  # a user-data failure must not end the training run
            self._last_error = err
            numbers: dict[str, Any] = {"step": self._step_of(pl_module)}
            condition, remedy = (
                "credit_audit",
                "check what credit_terms returns for this step's batch (see docs/credit_audit.md)",
            )
            if isinstance(err, SpansInteract):
                condition, remedy = "packed_attention", PACKED_REMEDY
                self._spans_failed = True  # every later reading of packed rollouts is checked, until one passes
            elif isinstance(err, PartitionError):
                condition, remedy = "partition", PARTITION_REMEDY
            elif isinstance(err, CreditTermsError):
                condition = f"credit_terms.{err.field}"
                numbers.update(err.numbers)
            return Refusal(condition, f"{type(err).__name__}: {err}", numbers=numbers, remedy=remedy)

    def _spans_due(self) -> bool:
        """Whether this reading, if it is of packed rollouts, holds one part to its own backward (every reading
        after a check that failed, until one passes)."""
        if self._spans_failed:
            return True
        return self.verify_spans_every > 0 and self.n_spans_readings % self.verify_spans_every == 0

    def _checked_spans(
        self, pl_module: LightningModule, reading: Union[CreditReport, Refusal]
    ) -> Union[CreditReport, Refusal]:
        """A reading of packed rollouts, held (when due) to one part's own backward; counted."""
        if not isinstance(reading, CreditReport) or not reading.spans:
            return reading
        passed = reading.spans_verified
        if not passed and self._spans_due():
            checked = self.audit(pl_module, self._batch, verify=True)  # riding along: a separate pass checks it
            if isinstance(checked, Refusal):
                self.n_spans_checks += 1
                reading = checked  # `audit` set `_spans_failed`
            else:
                passed = checked.spans_verified
        if passed:
            self.n_spans_checks += 1
            self._spans_failed = False
        self.n_spans_readings += 1
        return reading

    def _step_terms(self, pl_module: LightningModule) -> Any:
        """With accumulation, a ``terms_fn`` that replays every micro-batch of this optimizer step (None without)."""
        self._replay_fn = None
        if self._accumulation > 1 and len(self._replay):
            self._replay_fn = self._replay.terms_fn(pl_module)
        return self._replay_fn

    def _say_within_cost(self, trainer: Trainer) -> None:
        """Parts inside rows with every reading take one backward pass per part: said once, at setup."""
        if not self._within or self.readings == "projected" or self.engine not in ("auto", "reference"):
            return
        self._once.warn(
            trainer,
            "within_cost",
            f"partition={_name_of(self.partition)!r} with readings={self.readings!r}: the norm shares and the "
            "cancellation of parts inside rows take the reference engine, one backward pass per part (m + 1 in all). "
            "readings='projected' reads the projected shares by one forward-mode pass (with capture='training_step', "
            "that pass alone, along the step's .grad).",
        )

    def _guard(
        self, trainer: Trainer, reading: Union[CreditReport, Refusal], step: int
    ) -> Union[CreditReport, Refusal]:
        """A reading whose parts do not add up (over its conservation floor) is withheld, by name; with
        accumulation, so is a replay whose gradient is not the step's ``.grad``."""
        if isinstance(reading, Refusal):
            return reading
        limit = grad_match_threshold(_dtype_of(reading.dtype), _compute_dtype(trainer))
        gm = reading.grad_match
        over = gm is not None and math.isfinite(gm) and gm > limit
        refusal = guard(reading, Suspects(bool(self._compiled), self._accumulation, over), step)
        if refusal is None and over and self._accumulation > 1 and reading.engine != "ghost+training_step":
            refusal = Refusal(
                "accumulation",
                f"the {len(self._replay)} micro-batches replayed for this step do not add up to its .grad "
                f"(grad_match = {gm:.4g}, rounding explains {limit:.2g}): either credit_terms reads state that a later "
                "micro-batch changed in place, so a replay is not the micro-batch that trained, or the loss is not "
                "terms.sum(). The readings are withheld.",
                numbers={"step": step, "grad_match": gm, "micro_batches": len(self._replay)},
                remedy="cache each micro-batch's rollouts in a new object in training_step (`self.last_rollout_batch = rb`, "
                "not an in-place update), and build the loss as `self.credit_terms(batch).terms.sum()`",
            )
        if refusal is not None:
            self.last_withheld = reading
            return refusal
        return reading

    @staticmethod
    def _refuse_non_finite(reading: Union[CreditReport, Refusal], step: int) -> Union[CreditReport, Refusal]:
        """A step whose loss or full gradient is not finite has no credit to split: a refusal, not an undefined reading."""
        if isinstance(reading, Refusal):
            return reading
        refused = non_finite(reading, step)  # a Refusal is falsy (`if reading:` reads as "made"): test for None
        return reading if refused is None else refused

    def _trainer_grad(self, pl_module: LightningModule, use_grad: bool = False) -> Optional[list[torch.Tensor]]:
        """``.grad`` as this batch's ``g_full`` (``full_grad="trainer"``, or ``use_grad``), or None: the audit takes its own."""
        if use_grad and self._grad_blocked is None and self._full_grad_blocked is None:
            return [
                p.grad if p.grad is not None else torch.zeros_like(p) for p in pl_module.parameters() if p.requires_grad
            ]
        if self.full_grad != "trainer":
            return None
        if self._full_grad_blocked is not None:
            self._warn_full_grad()
            return None
        return [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in pl_module.parameters() if p.requires_grad
        ]

    def _warn_full_grad(self) -> None:
        if not self._full_grad_warned:
            self._full_grad_warned = True
            warnings.warn(
                f"credit audit: full_grad='trainer' takes g_full by the audit's own backward instead "
                f"({self._full_grad_blocked}).",
                RuntimeWarning,
                stacklevel=3,
            )

    def _pre_merge_reference(self, pl_module: LightningModule) -> Any:
        # A merger listed before this callback has already changed .grad: compare with its pre-merge copy.
        if self._reference != "grad" or not self._mergers:
            return self._reference
        ref = pre_merge_reference(self._mergers, pl_module.named_parameters(), self._step_of(pl_module))
        return self._reference if ref is None else ref

    def _forward_context(self, pl_module: LightningModule) -> Any:
        from ._distributed import precision_context

        if not self.precision_context:
            return None
        try:
            return precision_context(pl_module.trainer)
        except RuntimeError:  # not attached to a Trainer
            return None

    def _audit_distributed(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any
    ) -> Union[CreditReport, Refusal]:
        """The global reading (every rank calls it on the same steps: it runs collectives)."""
        from lens_callbacks.credit.readings.distributed import global_report

        from ._distributed import fsdp_hooks_off, full_grads, full_params, strategy_collectives

        # Collectives first and unconditionally, so that a failing rank cannot leave the others waiting.
        params = full_params(pl_module) if self._sharded else None
        applied = full_grads(pl_module)
        local: Optional[CreditReport] = None
        failure: Optional[str] = None
        try:
            with torch.enable_grad(), fsdp_hooks_off(pl_module) if self._sharded else contextlib.nullcontext():
                local = disintegrate(
                    pl_module,
                    batch,
                    self._partition_fn if self._partition_fn is not None else self.partition,
                    dtype=self.dtype,
                    keep_grads=True,
                    project_onto=applied if self._global else None,
                    params=params,
                    forward_context=self._forward_context(pl_module),
                    reference_grads=applied if self._reference is not None and not self._global else None,
                    engine=self.engine,
                    readings=self.readings,
                    terms_fn=self._step_terms(pl_module),
                )
        except Exception as err:  # a user-data failure must not end the training run
            failure = f"{type(err).__name__}: {err}"
        if not self._global:
            if local is None:
                return Refusal(
                    "credit_audit",
                    str(failure),
                    numbers={"step": self._step_of(pl_module)},
                    remedy="check what credit_terms returns for this step's batch (see docs/credit_audit.md)",
                )
            return local if self.keep_grads else dataclasses.replace(local, grads=None)
        try:
            return global_report(
                local, applied, strategy_collectives(trainer), failure=failure, keep_grads=self.keep_grads
            )
        except Exception as err:
            # Past the collectives' agreement step every rank fails alike (same gathered data).
            return Refusal(
                "credit_audit_global",
                f"{type(err).__name__}: {err}",
                numbers={"step": self._step_of(pl_module)},
                remedy="report this with the strategy and module used",
            )

    def metric_values(self, report: CreditReport) -> dict[str, float]:
        """The scalars of one report, through the metric (its ``forward`` returns this step's readings)."""
        out = self.metric(
            list(report.projected_share),
            list(report.norm_share),
            report.cancellation,
            report.conservation_error,
            report.grad_match,
            report.full_grad_norm,
            report.ok,
        )
        extra = {
            "n_parts": report.n_parts,
            "n_trained": report.n_trained,
            "refused": 0.0,
            "conservation_floor": report.conservation_floor,
        }
        if report.position_split is not None:
            extra.update(report.position_split.to_dict("", self.max_logged_parts))
        extra.update(engine_values(report))
        return self._flatten(out, report.part_names, extra=extra)

    def _flatten(
        self,
        out: dict[str, torch.Tensor],
        names: tuple[str, ...],
        extra: Optional[dict] = None,
        prefix: Optional[str] = None,
    ) -> dict[str, float]:
        p = self.prefix if prefix is None else prefix
        values: dict[str, float] = {}
        for key, v in out.items():
            if key in ("projected_share", "norm_share"):
                v = v.reshape(-1)  # torchmetrics squeezes a one-part vector to a scalar
                for i, name in enumerate(names[: self.max_logged_parts]):
                    values[f"{p}{key}/{name}"] = float(v[i])
            elif key == "grad_match" and self._reference is None and not self._global:
                continue
            else:
                values[f"{p}{key}"] = float(v)
        for key, v in (extra or {}).items():
            values[f"{p}{key}"] = float(v)
        return values

    @staticmethod
    def _step_of(pl_module: LightningModule) -> int:
        try:
            return int(pl_module.trainer.global_step)
        except RuntimeError:
            return -1

    # ---- epoch means, text, figure, last report ---------------------------------------------------

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_stale_epoch(trainer)

    def _close_stale_epoch(self, trainer: Trainer) -> None:
        # Resumed from a checkpoint taken after the last batch of an epoch but before its end: Lightning
        # skips that epoch's end (and the next one's start), so its readings are closed here, at the step
        # they belong to, before the first reading of the new epoch.
        if self._epoch_of_state is not None and self._epoch_of_state < trainer.current_epoch:
            self._end_epoch(trainer, self._epoch_last_step)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_epoch(trainer, max(trainer.global_step - 1, 0))

    def _end_epoch(self, trainer: Trainer, step: int) -> None:
        self._epoch_of_state = None
        if int(self.metric.n_readings) == 0:
            return
        names = (
            self.last_report.part_names
            if self.last_report is not None
            else tuple(f"part_{i}" for i in range(self.max_logged_parts))
        )
        # compute() is the metric's own cross-rank sync: every rank reaches this hook.
        values = self._flatten(self.metric.compute(), names, prefix=f"{self.prefix}epoch/")
        values = self._epoch_part_values(trainer, values)
        values = self._drop_positional(values)
        self.metric.reset()
        self.part_shares.reset()
        self.last_epoch_values = values
        self.last_epoch_step = step
        log_scalars(trainer, values, step)  # already synchronised

    def _epoch_part_values(self, trainer: Trainer, values: dict[str, float]) -> dict[str, float]:
        """Swap the metric's position-keyed epoch shares for the name-keyed ones of :class:`PartShares`.

        A part absent at a step counts as share 0 that step, so the epoch shares sum to 1 whatever parts
        come and go (see lens_callbacks/metrics/part_shares.py).
        """
        acc = self.part_shares
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            states: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, acc.state_dict())  # every rank reaches this hook
            acc = PartShares().merge(states)
        p = f"{self.prefix}epoch/"
        out = {k: v for k, v in values.items() if not k.startswith((f"{p}projected_share/", f"{p}norm_share/"))}
        shares = acc.compute()
        self.last_epoch_shares = dict(shares["projected_share"])
        for key in ("projected_share", "norm_share"):
            for name in list(shares[key])[: self.max_logged_parts]:
                out[f"{p}{key}/{name}"] = shares[key][name]
        return out

    def _check_terms_are_loss(self, trainer: Trainer, report: CreditReport, step: int) -> None:
        """Warn once, in words, when ``grad_match`` says the audited terms are not the loss that was trained."""
        gm = report.grad_match
        if gm is None or not math.isfinite(gm):
            return
        limit = grad_match_threshold(_dtype_of(report.dtype), _compute_dtype(trainer))
        if gm > limit and self._accumulation == 1:  # with accumulation the guard withholds it (`_guard`)
            self._once.warn(trainer, "terms_not_loss", terms_not_loss_words(gm, limit, step))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step_now = max(int(trainer.global_step) - 1, 0)
        self._once.say_summary(trainer, self.n_audits, f"{self.prefix}refusal_summary", step_now)
        if self._last_text is None:
            return
        step, text = self._last_text
        if self._last_table_step != step:
            self._log_table(trainer, step, text, final=True)
        elif self._last_figure_step != step:
            self._log_figures(trainer, step)  # the table went out at this step, its figures were not due
        self._write_last(trainer, step, text)

    @rank_zero_only
    def _write_last(self, trainer: Trainer, step: int, text: str) -> None:
        directory = log_dir(trainer)
        body = f"step {step}\n{text}\n"
        if self._last_defined is not None and self._last_defined[0] != step:
            # The last step's shares were undefined (e.g. every group had equal rewards): the latest reading that
            # was defined comes first, the last step after it.
            body = (
                f"step {self._last_defined[0]} (the last step whose shares are defined)\n{self._last_defined[1]}\n\n"
                f"step {step} (the last audited step)\n{text}\n"
            )
        if directory:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, LAST_REPORT_FILE), "w") as fh:
                fh.write(body)
        if self.print_last_report:
            print(f"credit audit, {body}", end="")
            tb = tensorboard_dir(trainer)
            if tb is not None:
                print(f"view it: tensorboard --logdir {tb}")

    def _log_table(self, trainer: Trainer, step: int, text: str, final: bool = False) -> None:
        self._last_table_step = step
        log_text(trainer, f"{self.prefix}table", text, step)
        self._log_reading_views(trainer, step, figures=False)
        every = self.log_figure_every_n_steps
        # Figures cost ~20 steps of a small policy: drawn on their own, sparser cadence and at fit end.
        if final or (every and (self._last_figure_step is None or step - self._last_figure_step >= every)):
            self._log_figures(trainer, step)

    def _log_figures(self, trainer: Trainer, step: int) -> None:
        self._last_figure_step = step
        if self.log_figure and self._history and trainer.global_rank == 0:
            log_figure(trainer, f"{self.prefix}heatmap", self._heatmap(), step)
        self._log_reading_views(trainer, step, text=False)
        report = self.last_report
        if self.log_figure and report is not None and report.gram is not None and trainer.global_rank == 0:
            log_figure(trainer, f"{self.prefix}interference", interference_figure(report, self.max_logged_parts), step)

    def _heatmap(self):
        """Projected share per part (rows) over audited steps (columns), first ``max_logged_parts`` parts."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        k = max(1, min(self.max_logged_parts, max(len(n) for _, n, _ in self._history)))
        steps = [s for s, _, _ in self._history]
        grid = torch.full((k, len(steps)), float("nan"))  # [parts, steps]
        for j, (_, _, share) in enumerate(self._history):
            vals = torch.tensor(share[:k], dtype=torch.float32)
            grid[: len(vals), j] = vals
        names = max((n for _, n, _ in self._history), key=len)[:k]
        lim = float(torch.nan_to_num(grid.abs(), nan=0.0).max()) or 1.0
        fig, ax = plt.subplots(figsize=(min(12, 2 + 0.25 * len(steps)), min(10, 1 + 0.3 * k)))
        im = ax.imshow(grid.numpy(), aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_yticks(range(k), labels=list(names), fontsize=6)
        ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
        ax.set_xticks(ticks, labels=[str(steps[i]) for i in ticks], fontsize=6)
        ax.set_xlabel("step")
        ax.set_title("projected share per part")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        return fig

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_audits": self.n_audits,
            "n_refusals": self.n_refusals,
            "last_report_step": self.last_report_step,
            "last_table_step": self._last_table_step,
            "metric": {name: getattr(self.metric, name).detach().cpu().clone() for name in self.metric._defaults},
            "readings": self.step_readings.state_dict(),
            "part_shares": self.part_shares.state_dict(),
            "epoch_of_state": self._epoch_of_state,
            "epoch_last_step": self._epoch_last_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_audits = int(state_dict.get("n_audits", 0))
        self.n_refusals = int(state_dict.get("n_refusals", 0))
        self.last_report_step = int(state_dict.get("last_report_step", -1))
        self._last_table_step = state_dict.get("last_table_step")
        self.step_readings.load_state_dict(state_dict.get("readings", {}))
        self.part_shares.load_state_dict(state_dict.get("part_shares"))
        self._epoch_of_state = state_dict.get("epoch_of_state")
        self._epoch_last_step = int(state_dict.get("epoch_last_step", 0))
        for name, value in state_dict.get("metric", {}).items():
            if name in self.metric._defaults:
                cur = getattr(self.metric, name)
                setattr(self.metric, name, value.to(cur.device, cur.dtype))

    # ---- readings a person acts on: extra partitions, concentration, noise scale, ledger -------------

    def _init_readings(self, extras: ExtraReadings) -> None:
        extra = extras.partitions
        for spec in extra:
            if not (isinstance(spec, str) and "." in spec):
                resolve_partition(spec)  # an unknown name raises here, naming the valid ones
        names = [spec if isinstance(spec, str) else getattr(spec, "__name__", "custom") for spec in extra]
        if len(set(names)) != len(names) or str(self.partition) in names:
            raise ValueError(
                f"`extras.partitions` must name each partition once, apart from `partition`, got {names!r}."
            )
        self._extra_names = names
        self.step_readings = StepReadings(
            _name_of(self.partition),
            [(n, s) for n, s in zip(names, extra)],
            extras.concentration_top_k,
            extras.noise_ema,
            self.prefix,
        )
        self._recorder: Optional[RecordingPartition] = None

    def _setup_readings(self) -> None:
        self.step_readings.extra = [(n, resolve_partition(s)) for n, s in zip(self._extra_names, self.extra_partitions)]
        # The engine hands the partition the terms it evaluated: keep them for the extra readings.
        self._recorder = RecordingPartition(self._partition_fn, _name_of(self.partition))
        self._partition_fn = self._recorder

    def _with_readings(
        self, pl_module: LightningModule, report: CreditReport, values: dict, step: int, terms: Any, partition: Any
    ) -> dict:
        trainer = pl_module.trainer

        def run_engine(name: str, fn: Any):
            try:
                with torch.enable_grad():
                    return disintegrate(pl_module, self._batch, fn, dtype=self.dtype)
            except Exception as err:  # a user-data failure must not end the training run
                return Refusal("credit_audit", f"{name}: {type(err).__name__}: {err}", numbers={"step": step})

        values = self._drop_positional(values)
        try:
            if self._global:
                # The report is the global step's and this rank's terms describe its own rows: each rank sums
                # its rows' global shares into the extra parts and the ranks meet by part name (a collective;
                # every rank reaches it with the same global report).
                from lens_callbacks.credit.readings.distributed import global_extra_shares

                from ._distributed import strategy_collectives

                whole, extra = global_extra_shares(
                    report, partition, terms, self.step_readings.extra, strategy_collectives(trainer)
                )
                values.update(self.step_readings.read(report, None, None, step, None, whole=whole, extra_shares=extra))
            else:
                values.update(self.step_readings.read(report, partition, terms, step, run_engine))
            for name, why in self.step_readings.last_errors.items():
                self._once.warn(
                    trainer,
                    f"extra:{name}",
                    f"extra partition {name!r} not read at step {step} (nor later, for the same reason): {why}",
                )
        except Exception as err:  # a reading beyond the primary one must not end the training run
            self._once.warn(
                trainer,
                f"readings:{type(err).__name__}",
                f"credit readings beyond the primary one not made at step {step} (later failures of this kind are not "
                f"repeated): {type(err).__name__}: {err}",
            )
        return values

    def _table(self, pl_module: LightningModule, report: CreditReport, terms: Any, partition: Any) -> CreditTable:
        """The credit table of this step: the terms and partition the engine evaluated give each part's context."""
        k = dict(top_k=(self.table_parts + 1) // 2, bottom_k=self.table_parts // 2)
        try:
            return credit_table(report, terms, partition, decode=module_decoder(pl_module), **k)
        except Exception as err:  # a column that cannot be read must not end the training run
            table = credit_table(report, **k)
            return dataclasses.replace(
                table, note=f"group, reward, advantage, trained: not shown ({type(err).__name__}: {err})"
            )

    def _drop_recorded(self) -> None:
        if self._recorder is not None:
            self._recorder.take()  # a refused step's terms are not read; do not hold them

    def _drop_positional(self, values: dict[str, float]) -> dict[str, float]:
        if self.log_positional_parts or _name_of(self.partition) not in POSITIONAL_PARTITIONS:
            return values
        p = self.prefix
        heads = tuple(f"{p}{e}{k}/" for e in ("", "epoch/") for k in ("projected_share", "norm_share"))
        return {k: v for k, v in values.items() if not k.startswith(heads)}

    def record_ledger(self, book: str, partition: str, values: dict[str, float], step: int) -> bool:
        """Add a per-part reading to the run ledger (e.g. ``book="update"`` for applied-update shares)."""
        return self.step_readings.add_to_ledger(book, partition, values, step)

    def _log_reading_views(self, trainer: Trainer, step: int, text: bool = True, figures: bool = True) -> None:
        rendered = self.step_readings.render() if text else ""
        if rendered:
            log_text(trainer, f"{self.prefix}readings", rendered, step)
        if not figures or not self.log_figure or trainer.global_rank != 0:
            return
        log_figure(trainer, f"{self.prefix}concentration/lorenz", self.step_readings.lorenz_figure(), step)
        for book, part in self.step_readings.ledger.books():
            log_figure(
                trainer, f"{self.prefix}ledger/{book}/{part}", self.step_readings.ledger.figure(book, part), step
            )


PACKED_REMEDY = (
    "keep attention inside each packed rollout: restart position_ids at every rollout and pass no attention_mask "
    "(transformers then builds a block-diagonal mask; pass use_cache=False), or audit with engine='reference' "
    "(exact whatever the attention)"
)

#: Partitions known by name to put positions of one row in different parts.
WITHIN_ROW_PARTITIONS = ("by_segment", "by_turn", "by_role")


def _lightning_internals() -> frozenset:
    """The attributes every LightningModule holds for Lightning itself: not part of what a micro-batch leaves behind."""
    return frozenset(vars(LightningModule()))


def _dtype_of(name: str) -> Optional[torch.dtype]:
    d = getattr(torch, str(name).replace("torch.", ""), None)
    return d if isinstance(d, torch.dtype) else None


def _compute_dtype(trainer: Trainer) -> Optional[torch.dtype]:
    """The reduced precision the trainer computes in (``bf16-*``, ``16-*``), None at full precision."""
    precision = str(getattr(trainer, "precision", ""))
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


def _name_of(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", "custom")


def _split_partitions(partition: Any, extra: Optional[Sequence[str]]) -> tuple[Any, list]:
    """``partition`` may be a list (primary first); ``extras.partitions`` adds to its tail."""
    extra_list = [] if extra is None else list(extra) if isinstance(extra, (list, tuple)) else None
    if extra_list is None:
        raise ValueError(f"`extras.partitions` must be a list of partition names, got {extra!r}.")
    if isinstance(partition, (list, tuple)):
        if not partition:
            raise ValueError("`partition` must name at least one partition, got an empty list.")
        return partition[0], list(partition[1:]) + extra_list
    return partition, extra_list


def engine_values(report: CreditReport) -> dict[str, float]:
    """Which engine made the reading and which readings it holds (``engine/<name>`` = 1), and the
    interference matrix's summary (``interference/min_cosine``, ``mean_cosine``, ``negative_pair_fraction``)."""
    out = {f"engine/{report.engine}": 1.0, f"readings/{report.readings}": 1.0}
    for key, v in report.interference_summary().items():
        out[f"interference/{key}"] = v
    return out


def interference_figure(report: CreditReport, max_parts: int = 64):
    """The interference matrix (cosine of part gradients) of one report as a matplotlib figure; None without matplotlib."""
    cos = report.interference()
    if cos is None:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    k = max(1, min(max_parts, cos.shape[0]))
    grid = cos[:k, :k].numpy()
    fig, ax = plt.subplots(figsize=(min(10, 2 + 0.25 * k), min(9, 1.5 + 0.25 * k)))
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    names = list(report.part_names[:k])
    ax.set_xticks(range(k), labels=names, fontsize=5, rotation=90)
    ax.set_yticks(range(k), labels=names, fontsize=5)
    ax.set_title(f"interference: cos(g_S, g_S') ({report.engine})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig
