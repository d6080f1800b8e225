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

import os
import warnings
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from lens_callbacks.credit.engine import disintegrate, resolve_dtype
from lens_callbacks.credit.engines import check_engine
from lens_callbacks.credit.engines.ghost import RideAlong
from lens_callbacks.credit.partition import resolve_partition
from lens_callbacks.credit.report import CreditReport
from lens_callbacks.credit.terms import is_credit_source
from ._logging import log_dir, log_figure, log_scalars, log_text, tensorboard_dir
from lens_callbacks.metrics.credit import CreditMetric
from lens_callbacks.refusal import Refusal

__all__ = ["CreditAuditCallback"]

CAPTURES = ("separate", "training_step")

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
        engine: ``"auto"`` (default: the fastest exact engine for the partition), ``"reference"``,
            ``"ghost"`` (one pass, row partitions) or ``"jvp"``; see :mod:`lens_callbacks.credit.engines`.
            Logged as ``credit/engine/<name>`` = 1 and in the table.
        readings: ``"all"`` (default) or ``"projected"`` (projected shares only; cheaper on some engines).
        capture: ``"separate"`` (default: the audit re-runs ``credit_terms`` in its own pass) or
            ``"training_step"``: the one-pass engine's hooks ride on the training step's own forward
            and backward, ``g_full`` is the trainer's ``.grad``, and the audit adds only the per-layer
            reductions. Where that cannot be checked (the loss is not ``terms.sum()``, gradient
            accumulation, several processes, manual optimization, a parameter outside the covered
            layers) the step is audited by the separate pass instead, and a warning says so once.

    Attributes:
        last_report: the latest :class:`CreditReport` (``None`` before the first or after a refused audit).
        last_report_step: ``trainer.global_step`` when it was made (before the optimizer step increments it).
        last_refusal: the latest :class:`~lens_callbacks.refusal.Refusal`, if an audit was declined.
        last_values: the scalars logged for the latest audited step (name -> value).
        last_epoch_values: the epoch means logged at the latest epoch end.

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
        engine: str = "auto",
        readings: str = "all",
        capture: str = "separate",
    ) -> None:
        super().__init__()
        check_engine(engine, readings)  # raises, naming the valid engines and readings
        if capture not in CAPTURES:
            raise ValueError(f"`capture` must be one of {list(CAPTURES)}, got {capture!r}.")
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
        self.engine = engine
        self.readings = readings
        self.capture = capture
        self._ride: Optional[RideAlong] = None
        self._ride_blocked: Optional[str] = None  # why this run cannot ride along (set in setup)
        self._ride_warned = False
        self.n_ride_along = 0

        self.last_report: Optional[CreditReport] = None
        self.last_report_step: int = -1
        self.last_refusal: Optional[Refusal] = None
        self.n_audits = 0
        self.n_refusals = 0
        self.metric = CreditMetric(max_parts=max_logged_parts)
        self._partition_fn: Any = None
        self._batch: Any = None
        self._reference: Optional[str] = "grad"
        self._last_text: Optional[tuple[int, str]] = None  # (step, rendered table)
        self._last_defined: Optional[tuple[int, str]] = None  # the latest reading whose shares are defined
        self._last_table_step: Optional[int] = None
        self._history: list[tuple[int, tuple[str, ...], tuple[float, ...]]] = []
        self.last_values: dict[str, float] = {}
        self.last_epoch_values: dict[str, float] = {}

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
        if trainer.world_size > 1 or trainer.accumulate_grad_batches > 1:
            # .grad is the rank average / the sum of micro-batches: a local audit of one batch cannot match it.
            self._reference = None
        self._ride_blocked = None
        if self.capture == "training_step":
            if trainer.world_size > 1:
                self._ride_blocked = "several processes: `.grad` is the rank average, not this rank's terms' gradient"
            elif trainer.accumulate_grad_batches > 1:
                self._ride_blocked = "gradient accumulation: `.grad` sums several micro-batches"
            elif not pl_module.automatic_optimization:
                self._ride_blocked = "manual optimization: the callback does not see the loss's backward"

    # ---- the audit --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        self._stop_ride()
        if self.capture == "training_step" and self._ride_blocked is None and trainer.global_step % self.every_n_steps == 0:
            self._ride = RideAlong(pl_module).start()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._ride is not None:
            self._ride.on_loss(loss)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch = None
        self._stop_ride()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_ride()

    def _stop_ride(self) -> None:
        if self._ride is not None:
            self._ride.clear()
            self._ride = None

    def _read(self, trainer: Trainer, pl_module: LightningModule) -> Union[CreditReport, Refusal]:
        """The ride-along reading when this step rode along and its contract held; else the separate pass."""
        why = self._ride_blocked if self.capture == "training_step" else None
        ride, self._ride = self._ride, None
        if ride is not None:
            try:
                got = ride.report(
                    self._partition_fn if self._partition_fn is not None else resolve_partition(self.partition),
                    partition_name=self.partition if isinstance(self.partition, str) else "custom",
                    readings=self.readings, keep_grads=self.keep_grads,
                )
            except Exception as err:  # a user-data failure must not end the training run
                got = f"{type(err).__name__}: {err}"
            finally:
                ride.clear()
            if isinstance(got, CreditReport):
                self.n_ride_along += 1
                return got
            why = got
        if why is not None and not self._ride_warned:
            self._ride_warned = True
            warnings.warn(
                f"credit audit: capture='training_step' falls back to a separate pass ({why}).", RuntimeWarning, stacklevel=2
            )
        return self.audit(pl_module, self._batch)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        if step % self.every_n_steps != 0:
            return
        reading = self._read(trainer, pl_module)
        self.n_audits += 1
        if isinstance(reading, Refusal):
            self.n_refusals += 1
            self.last_report, self.last_report_step, self.last_refusal = None, -1, reading
            warnings.warn(f"credit audit at step {step} declined: {reading.reason}", RuntimeWarning, stacklevel=2)
            self.metric.update_report(None)
            values = self._flatten(self.metric(defined=False), (), extra={"refused": 1.0})
            text = reading.render()
            log_text(trainer, f"{self.prefix}refusal", text, step)  # every refusal, whatever the cadence
        else:
            self.last_report, self.last_report_step = reading, step
            values = self.metric_values(reading)
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
                    reference_grads=self._reference,
                    keep_grads=self.keep_grads,
                    engine=self.engine,
                    readings=self.readings,
                )
        except Exception as err:  # a user-data failure must not end the training run
            return Refusal(
                "credit_audit",
                f"{type(err).__name__}: {err}",
                numbers={"step": self._step_of(pl_module)},
                remedy="check what credit_terms returns for this step's batch (see docs/credit_audit.md)",
            )

    def metric_values(self, report: CreditReport) -> dict[str, float]:
        """The scalars of one report, through the metric (its ``forward`` returns this step's readings)."""
        out = self.metric(
            list(report.projected_share), list(report.norm_share), report.cancellation,
            report.conservation_error, report.grad_match, report.full_grad_norm, report.ok,
        )
        extra = {"n_parts": report.n_parts, "n_trained": report.n_trained, "refused": 0.0}
        extra.update(engine_values(report))
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

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if int(self.metric.n_readings) == 0:
            return
        names = self.last_report.part_names if self.last_report is not None else tuple(
            f"part_{i}" for i in range(self.max_logged_parts)
        )
        # compute() is the metric's own cross-rank sync: every rank reaches this hook.
        values = self._flatten(self.metric.compute(), names, prefix=f"{self.prefix}epoch/")
        self.metric.reset()
        self.last_epoch_values = values
        log_scalars(trainer, values, max(trainer.global_step - 1, 0))  # already synchronised

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
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_audits = int(state_dict.get("n_audits", 0))
        self.n_refusals = int(state_dict.get("n_refusals", 0))
        self.last_report_step = int(state_dict.get("last_report_step", -1))
        self._last_table_step = state_dict.get("last_table_step")
        for name, value in state_dict.get("metric", {}).items():
            if name in self.metric._defaults:
                cur = getattr(self.metric, name)
                setattr(self.metric, name, value.to(cur.device, cur.dtype))


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
