"""``CreditAuditCallback``: disintegrate every (n-th) step the module actually trained on.

A thin adapter over :func:`lens_callbacks.credit.disintegrate`: at ``on_before_optimizer_step`` (the
step's unclipped ``.grad`` is in place) it re-evaluates ``pl_module.credit_terms(batch)`` on detached
copies of the parameters, takes one backward pass per part plus an independent full one, and logs the
readings through :class:`~lens_callbacks.metrics.credit.CreditMetric`. It is read-only: parameters,
``.grad``, optimizer state and the random stream are left as they were.

DDP: each rank audits its local batch, so ``g_full`` and the shares are local to the rank. At the
hook ``.grad`` holds the rank average, which a local ``g_full`` does not equal; ``grad_match`` is
therefore only read in single-process runs (and without gradient accumulation, where ``.grad`` sums
several micro-batches and the audit sees the last one). Nothing here is a collective except the
epoch mean of the metric, which every rank reaches.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from lens_callbacks.credit.engine import disintegrate, resolve_dtype
from lens_callbacks.credit.partition import PARTITION_REMEDY, MissingSegmentsError, PartitionError, resolve_partition
from lens_callbacks.credit.report import CreditReport
from lens_callbacks.credit.terms import CreditTermsError, is_credit_source
from ._mergers import grad_mergers, merger_at, pre_merge_reference
from ._logging import log_dir, log_figure, log_scalars, log_text, tensorboard_dir
from lens_callbacks.metrics.credit import CreditMetric
from lens_callbacks.metrics.part_shares import PartShares
from lens_callbacks.refusal import Refusal

__all__ = ["CreditAuditCallback"]

LAST_REPORT_FILE = "credit_last.txt"


class CreditAuditCallback(Callback):
    """Exact credit per part of every ``every_n_steps``-th optimizer step, logged as it trains.

    Logged (``prefix`` = ``credit/``): ``cancellation``, ``cancelled_fraction``, ``conservation_error``,
    ``grad_match``, ``share_sum``, ``full_grad_norm``, ``undefined_fraction``, ``n_parts``, ``n_trained``
    and ``projected_share/<part>``, ``norm_share/<part>`` for the first ``max_logged_parts`` parts, every
    audited step; their means over the epoch as ``credit/epoch/...``. The rendered table goes to
    TensorBoard as text (``credit/table``) every ``log_table_every_n_steps`` steps and for the last
    audit; with matplotlib, a heatmap of projected share per part over steps (``credit/heatmap``).

    Args:
        partition: ``"by_rollout"``, ``"by_group"``, ``"by_segment"`` or an import path
            ``"package.module.function"`` (a ``CreditTerms -> Partition`` callable).
        every_n_steps: audit the steps with ``global_step % every_n_steps == 0``.
        dtype: audit precision: ``"float32"`` (default), ``"float64"``, ``"bfloat16"`` or ``"native"``.
        log_table_every_n_steps: at least this many steps between two text tables (0: only the last).
        max_logged_parts: per-part scalars for the first this-many parts.
        keep_grads: attach ``g_full`` and ``Σ g_S`` to ``last_report.grads`` (other callbacks may set it).
        log_figure: log the heatmap figure when matplotlib is importable.
        print_last_report: print the last table and the ``tensorboard --logdir`` line at the end of fit.
        prefix: metric namespace.

    Attributes:
        last_report: the latest :class:`CreditReport` (``None`` before the first or after a refused audit).
        last_report_step: ``trainer.global_step`` when it was made (before the optimizer step increments it).
        last_refusal: the latest :class:`~lens_callbacks.refusal.Refusal`, if an audit was declined.
        last_values: the scalars logged for the latest audited step (name -> value).
        last_epoch_values: the epoch means logged at the latest epoch end.
        last_epoch_shares: every part's epoch projected share at the latest epoch end, by part name
            (a part absent at a step counts as 0 that step, so they sum to 1; the first
            ``max_logged_parts`` are logged as ``credit/epoch/projected_share/<part>``).

    Scalars go to ``trainer.loggers`` at the audited step itself (``trainer.global_step``), from rank 0;
    steps that ``every_n_steps`` skips get no value rather than a repeated one.
    """

    def __init__(
        self,
        partition: str = "by_rollout",
        every_n_steps: int = 1,
        dtype: str = "float32",
        log_table_every_n_steps: int = 10,
        max_logged_parts: int = 16,
        keep_grads: bool = False,
        log_figure: bool = True,
        print_last_report: bool = False,
        prefix: str = "credit/",
    ) -> None:
        super().__init__()
        if not (isinstance(partition, str) and "." in partition):
            resolve_partition(partition)  # an unknown name raises here, naming the valid ones
        # An import path is resolved in setup: the error still comes before any step runs.
        for name, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("log_table_every_n_steps", log_table_every_n_steps, 0),
            ("max_logged_parts", max_logged_parts, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
        resolve_dtype(dtype)  # raises, naming the valid options
        self.partition = partition
        self.every_n_steps = every_n_steps
        self.dtype = dtype
        self.log_table_every_n_steps = log_table_every_n_steps
        self.max_logged_parts = max_logged_parts
        self.keep_grads = bool(keep_grads)
        self.log_figure = log_figure
        self.print_last_report = print_last_report
        self.prefix = prefix

        self.last_report: Optional[CreditReport] = None
        self.last_report_step: int = -1
        self.last_refusal: Optional[Refusal] = None
        self.n_audits = 0
        self.n_refusals = 0
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
        self.last_epoch_shares: dict[str, float] = {}  # every part's epoch projected share, logged or not

    @property
    def state_key(self) -> str:
        return self._generate_state_key(partition=str(self.partition), every_n_steps=self.every_n_steps)

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
        self.metric = self.metric.to(pl_module.device)
        self._reference = "grad"
        self._mergers = grad_mergers(trainer, keep_pre_merge=True)
        if trainer.world_size > 1 or trainer.accumulate_grad_batches > 1:
            # .grad is the rank average / the sum of micro-batches: a local audit of one batch cannot match it.
            self._reference = None

    # ---- the audit --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        self._close_stale_epoch(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch = None
        step, self._audited_step = self._audited_step, None
        if step is None or not self._mergers:
            return
        # Every callback's on_before_optimizer_step has run by now, wherever this one is listed.
        merger = merger_at(self._mergers, step)
        self.last_values[f"{self.prefix}applied_grad_differs"] = 1.0 if merger is not None else 0.0
        log_scalars(trainer, {f"{self.prefix}applied_grad_differs": self.last_values[f"{self.prefix}applied_grad_differs"]}, step)
        if merger is not None and not self._merge_noted:
            self._merge_noted = True
            log_text(
                trainer, f"{self.prefix}note",
                f"From step {step} on, {type(merger).__name__} merged .grad before the optimizer step "
                f"(credit/applied_grad_differs = 1 on those steps). The credit readings describe the gradient the "
                "module produced, before any merger; grad_match is read against that gradient.",
                step,
            )

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        if step % self.every_n_steps != 0:
            return
        self._last_error = None
        reading = self.audit(pl_module, self._batch)
        if self.n_audits == 0 and isinstance(self._last_error, MissingSegmentsError):
            # A set-up error, not a property of this step: say it once, now, rather than refuse every step.
            raise ValueError(
                f"`partition` must match what credit_terms returns, got partition={self.partition!r} on terms without "
                f"segment ids: {self._last_error} Or use partition='by_rollout'."
            ) from self._last_error
        reading = self._refuse_non_finite(reading, step)
        self._audited_step = step
        self._epoch_of_state, self._epoch_last_step = int(trainer.current_epoch), step
        self.n_audits += 1
        if isinstance(reading, Refusal):
            self.n_refusals += 1
            self.last_report, self.last_report_step, self.last_refusal = None, -1, reading
            warnings.warn(f"credit audit at step {step} declined: {reading.reason}", RuntimeWarning, stacklevel=2)
            # One update per reading: forward() below adds this step to the epoch state itself.
            values = self._flatten(self.metric(defined=False), (), extra={"refused": 1.0})
            text = reading.render()
            log_text(trainer, f"{self.prefix}refusal", text, step)  # every refusal, whatever the cadence
        else:
            self.last_report, self.last_report_step = reading, step
            values = self.metric_values(reading)
            if reading.ok:
                self.part_shares.update(reading.part_names, reading.projected_share, reading.norm_share)
            self._history.append((step, reading.part_names, reading.projected_share))
            del self._history[:-256]
            text = reading.render()
            if reading.ok:
                self._last_defined = (step, text)
        self._last_text = (step, text)
        self.last_values = values
        log_scalars(trainer, values, step)
        if self.log_table_every_n_steps and (
            self._last_table_step is None or step - self._last_table_step >= self.log_table_every_n_steps
        ):
            self._log_table(trainer, step, text)

    def audit(self, pl_module: LightningModule, batch: Any) -> Union[CreditReport, Refusal]:
        """One disintegration of the step; a reading that cannot be made is a :class:`Refusal`."""
        try:
            with torch.enable_grad():  # the hook may run inside optimizer.step with grad mode off
                return disintegrate(
                    pl_module,
                    batch,
                    self._partition_fn if self._partition_fn is not None else self.partition,
                    dtype=self.dtype,
                    reference_grads=self._pre_merge_reference(pl_module),
                    keep_grads=self.keep_grads,
                )
        except Exception as err:  # a user-data failure must not end the training run
            self._last_error = err
            numbers: dict[str, Any] = {"step": self._step_of(pl_module)}
            condition, remedy = "credit_audit", "check what credit_terms returns for this step's batch (see docs/credit_audit.md)"
            if isinstance(err, PartitionError):
                condition, remedy = "partition", PARTITION_REMEDY
            elif isinstance(err, CreditTermsError):
                condition = f"credit_terms.{err.field}"
                numbers.update(err.numbers)
            return Refusal(condition, f"{type(err).__name__}: {err}", numbers=numbers, remedy=remedy)

    @staticmethod
    def _refuse_non_finite(reading: Union[CreditReport, Refusal], step: int) -> Union[CreditReport, Refusal]:
        """A step whose loss or full gradient is not finite has no credit to split: a refusal, not an undefined reading."""
        if isinstance(reading, Refusal) or (math.isfinite(reading.loss) and math.isfinite(reading.full_grad_norm)):
            return reading
        what = "loss" if not math.isfinite(reading.loss) else "full gradient"
        return Refusal(
            "non_finite_loss" if what == "loss" else "non_finite_gradient",
            f"the {what} of this step is not finite (loss = {reading.loss!r}, ||g_full|| = {reading.full_grad_norm!r}); "
            "credit is undefined and the optimizer step is likely corrupt.",
            numbers={"step": step, "loss": reading.loss, "full_grad_norm": reading.full_grad_norm},
            remedy="find where the loss becomes non-finite (log of 0, an overflow, a division by a zero count); "
                   "torch.autograd.set_detect_anomaly(True) names the operation.",
        )

    def _pre_merge_reference(self, pl_module: LightningModule) -> Any:
        # A merger listed before this callback has already changed .grad: compare with its pre-merge copy.
        if self._reference != "grad" or not self._mergers:
            return self._reference
        ref = pre_merge_reference(self._mergers, pl_module.named_parameters(), self._step_of(pl_module))
        return self._reference if ref is None else ref

    def metric_values(self, report: CreditReport) -> dict[str, float]:
        """The scalars of one report, through the metric (its ``forward`` returns this step's readings)."""
        out = self.metric(
            list(report.projected_share), list(report.norm_share), report.cancellation,
            report.conservation_error, report.grad_match, report.full_grad_norm, report.ok,
        )
        extra = {"n_parts": report.n_parts, "n_trained": report.n_trained, "refused": 0.0}
        return self._flatten(out, report.part_names, extra=extra)

    def _flatten(self, out: dict[str, torch.Tensor], names: tuple[str, ...], extra: Optional[dict] = None, prefix: Optional[str] = None) -> dict[str, float]:
        p = self.prefix if prefix is None else prefix
        values: dict[str, float] = {}
        for key, v in out.items():
            if key in ("projected_share", "norm_share"):
                v = v.reshape(-1)  # torchmetrics squeezes a one-part vector to a scalar
                for i, name in enumerate(names[: self.max_logged_parts]):
                    values[f"{p}{key}/{name}"] = float(v[i])
            elif key == "grad_match" and self._reference is None:
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
        names = self.last_report.part_names if self.last_report is not None else tuple(
            f"part_{i}" for i in range(self.max_logged_parts)
        )
        # compute() is the metric's own cross-rank sync: every rank reaches this hook.
        values = self._flatten(self.metric.compute(), names, prefix=f"{self.prefix}epoch/")
        values = self._epoch_part_values(trainer, values)
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

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_text is None:
            return
        step, text = self._last_text
        if self._last_table_step != step:
            self._log_table(trainer, step, text)
        self._write_last(trainer, step, text)

    @rank_zero_only
    def _write_last(self, trainer: Trainer, step: int, text: str) -> None:
        directory = log_dir(trainer)
        body = f"step {step}\n{text}\n"
        if self._last_defined is not None and self._last_defined[0] != step:
            # The last step's shares were undefined (e.g. every group had equal rewards): show the latest that was.
            body += f"\nlast defined reading, step {self._last_defined[0]}\n{self._last_defined[1]}\n"
        if directory:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, LAST_REPORT_FILE), "w") as fh:
                fh.write(body)
        if self.print_last_report:
            print(f"credit audit, {body}", end="")
            tb = tensorboard_dir(trainer)
            if tb is not None:
                print(f"view it: tensorboard --logdir {tb}")

    def _log_table(self, trainer: Trainer, step: int, text: str) -> None:
        self._last_table_step = step
        log_text(trainer, f"{self.prefix}table", text, step)
        if self.log_figure and self._history and trainer.global_rank == 0:
            log_figure(trainer, f"{self.prefix}heatmap", self._heatmap(), step)

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
            "part_shares": self.part_shares.state_dict(),
            "epoch_of_state": self._epoch_of_state,
            "epoch_last_step": self._epoch_last_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_audits = int(state_dict.get("n_audits", 0))
        self.n_refusals = int(state_dict.get("n_refusals", 0))
        self.last_report_step = int(state_dict.get("last_report_step", -1))
        self._last_table_step = state_dict.get("last_table_step")
        self.part_shares.load_state_dict(state_dict.get("part_shares"))
        self._epoch_of_state = state_dict.get("epoch_of_state")
        self._epoch_last_step = int(state_dict.get("epoch_last_step", 0))
        for name, value in state_dict.get("metric", {}).items():
            if name in self.metric._defaults:
                cur = getattr(self.metric, name)
                setattr(self.metric, name, value.to(cur.device, cur.dtype))
