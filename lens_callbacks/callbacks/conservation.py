"""ConservationCheckCallback: hold each optimizer step against the gradient it should have applied."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..credit.readings.conservation import (
    UNIT_ROUNDOFF,
    ConservationReading,
    exact_optimizer_precondition,
    step_conservation,
)
from ..metrics.conservation import ConservationMetric
from ..refusal import Refusal
from ._logging import OncePerCause, log_figure, log_scalars, log_text
from ._mergers import grad_mergers, merger_at

__all__ = ["ConservationCheckCallback"]


@dataclass
class _Pending:
    """What one optimizer step needs read back after the update."""

    step: int
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]  # live parameters held by the optimizer
    names: list[Optional[str]]
    group_index: list[int]
    lrs: list[float]  # η per group, read at step time
    theta_before: list[torch.Tensor]  # one parameter-sized buffer
    grads: Optional[list[Optional[torch.Tensor]]]  # .grad copies, when the audit's parts are not at hand
    audit_grads: Optional[list[Optional[torch.Tensor]]]  # Σ g_S from the audit, when already made
    scale: Optional[float]  # GradScaler scale before the step


class ConservationCheckCallback(Callback):
    r"""Checks ``θ_before − θ_after = η·g`` for every optimizer step the exact set allows.

    In ``on_before_optimizer_step`` it reads η per param group and copies ``θ_before`` (one
    parameter-sized buffer), and takes the gradient to hold against: the summed credit parts of a
    :class:`~lens_callbacks.callbacks.credit_audit.CreditAuditCallback` in the same Trainer when there is
    one (the audit's claim), else the trainer's ``.grad`` (a second buffer). After the update (in
    ``on_train_batch_end``, or at the next optimizer step under manual optimization) it reads
    ``θ_after`` and logs ``conservation/error``, ``conservation/floor``, ``conservation/limited``,
    ``conservation/holds``, ``conservation/violated`` and ``conservation/refused``; the reading's status
    (``holds``, ``holds within precision``, ``violated``, ``refused``) is in its text. Held against the
    audit's parts, the floor includes their own rounding (the audit's ``conservation_error``, up to a few
    unit roundoffs of the dtype they were computed in: bfloat16 under ``bf16-mixed``), so an honest
    reduced-precision step holds within precision while a wrong normaliser still reads violated. The first
    violation is also a warning in words (what was compared, the figure, the likely cause, the fix).

    Optimizers and trainer settings outside the exact set (see
    :func:`~lens_callbacks.credit.readings.conservation.exact_optimizer_precondition`) are refused: the refusal is
    logged once per reason as text (a warning and TensorBoard text) and ``conservation/refused = 1`` every
    step; no buffer is copied for a refused step; the refusals are counted and summarised at the end of fit.
    The callback is read-only: weights, gradients, optimizer state and the random stream are left as they were.

    Place it after the ``CreditAuditCallback`` in ``trainer.callbacks`` to save the ``.grad`` copy.

    Args:
        every_n_steps: check every n-th optimizer step (``trainer.global_step % n == 0``).
        tolerance: relative error under which a resolvable reading holds.
        use_credit_audit: hold the step against the audit's summed parts when an audit is attached (sets
            the audit's ``keep_grads``); False holds it against ``.grad``.
        log_figure: at the end of fit, log ``conservation/error_vs_floor`` to TensorBoard (error and floor
            per step on a log scale, refused steps marked) when matplotlib is importable.
        prefix: metric name prefix.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lens_callbacks import ConservationCheckCallback, CreditAuditCallback
        >>> check = ConservationCheckCallback(tolerance=1e-4)  # reads the audit's parts when it runs beside one
        >>> trainer = Trainer(callbacks=[CreditAuditCallback(), check], max_steps=10, logger=False)
        >>> ConservationCheckCallback(tolerance=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: `tolerance` must be a non-negative float, got -1.0; e.g. 1e-4.
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        tolerance: float = 1e-4,
        use_credit_audit: bool = True,
        log_figure: bool = True,
        prefix: str = "conservation/",
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be a positive int, got {every_n_steps!r}.")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
            raise ValueError(f"`tolerance` must be a non-negative float, got {tolerance!r}; e.g. 1e-4.")
        if not isinstance(prefix, str):
            raise ValueError(f"`prefix` must be a str, got {prefix!r}; e.g. 'conservation/'.")
        self.every_n_steps = every_n_steps
        self.tolerance = float(tolerance)
        self.use_credit_audit = bool(use_credit_audit)
        self.log_figure = bool(log_figure)
        self.prefix = prefix
        self.metric = ConservationMetric(sync_on_compute=False)
        self.last_reading: Optional[Union[ConservationReading, Refusal]] = None
        self.readings_made = 0
        self._audit: Optional[Callback] = None
        self._audit_first = False
        self._mergers: list[Any] = []
        self._pending: Optional[_Pending] = None
        self._pending_refusal: Optional[tuple[int, Refusal]] = None
        self._once = OncePerCause("ConservationCheckCallback")
        self._sharded = False
        self._history: deque[tuple[int, float, float]] = deque(maxlen=2048)  # (step, error, floor); NaN: refused
        self.last_epoch_values: dict[str, float] = {}
        self.last_epoch_step: Optional[int] = None  # the step the latest epoch readings were logged at
        self._epoch_of_state: Optional[int] = None  # the epoch the metric's readings belong to
        self._epoch_last_step = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, prefix=self.prefix)

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from ._distributed import check_strategy, is_sharded

        check_strategy(trainer, "ConservationCheckCallback")
        self._sharded = is_sharded(pl_module)
        self._mergers = grad_mergers(trainer)
        self._audit = None
        if self.use_credit_audit:
            cbs = list(trainer.callbacks)
            for i, cb in enumerate(cbs):
                if _is_credit_audit(cb):
                    self._audit = cb
                    # The audit keeps Σ g_S only when asked; that sum is the claim checked here.
                    cb.keep_grads = True
                    self._audit_first = i < cbs.index(self) if self in cbs else False
                    break

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        step = int(trainer.global_step)
        # Manual optimization: an earlier opt.step() of this batch is complete. (A closure the optimizer
        # calls again within one step, as LBFGS does, keeps the step number and is not a new step.)
        self._finish(trainer, pl_module, before_step=step)
        if step % self.every_n_steps:
            return
        opt = _unwrap(optimizer)
        verdict = self._precondition(trainer, pl_module, opt)
        if isinstance(verdict, Refusal):
            self._pending_refusal = (step, verdict)
            return
        from ._distributed import is_sharded

        self._sharded = is_sharded(pl_module)  # FSDP2 shards in configure_model, after setup
        with torch.no_grad():
            self._pending = self._record(step, pl_module, opt)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._close_stale_epoch(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._finish(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_stale_epoch(trainer)

    def _close_stale_epoch(self, trainer: Trainer) -> None:
        # Resumed from a checkpoint taken after the last batch of an epoch but before its end: Lightning
        # skips that epoch's end (and the next one's start), so its readings are closed here, at the step
        # they belong to, before the first reading of the new epoch.
        if self._epoch_of_state is not None and self._epoch_of_state < trainer.current_epoch:
            self._end_epoch(trainer, self._epoch_last_step)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_epoch(trainer, max(int(trainer.global_step) - 1, 0))

    def _end_epoch(self, trainer: Trainer, step: int) -> None:
        self._epoch_of_state = None
        if int(self.metric.readings) == 0:
            return
        out = {f"{self.prefix}epoch/{k}": float(v) for k, v in self.metric.compute().items()}
        out = {k: v for k, v in out.items() if v == v}
        # Every rank reads the same replicated step, so the values agree across ranks already; through
        # the loggers directly (rank 0), not pl_module.log, which would ask for a sync_dist it does not need.
        self.last_epoch_values = out
        self.last_epoch_step = step
        log_scalars(trainer, out, step)
        self.metric.reset()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        last = self._history[-1][0] if self._history else max(int(trainer.global_step) - 1, 0)
        self._once.say_summary(trainer, self.readings_made, f"{self.prefix}refusal_summary", last, noun="checked steps")
        if not self.log_figure or not self._history or trainer.global_rank != 0:
            return
        log_figure(trainer, f"{self.prefix}error_vs_floor", self.figure(), self._history[-1][0])

    def figure(self):
        """Error and precision floor per checked step (log scale); refused steps as marks on the axis.

        Returns a matplotlib figure, or None without matplotlib or readings.
        """
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        made = [(s, e, f) for s, e, f in self._history if e == e]  # NaN marks a refusal
        refused = [s for s, e, _ in self._history if e != e]
        fig, ax = plt.subplots(figsize=(7, 3.2))
        if made:
            steps = [s for s, _, _ in made]
            err = [max(e, 1e-300) for _, e, _ in made]
            ax.plot(steps, [f for _, _, f in made], color="0.5", lw=1, label="update_precision_floor")
            ax.plot(steps, err, "o-", ms=3, lw=1, label="relative_error")
            ax.axhline(self.tolerance, color="C3", ls=":", lw=1, label=f"tolerance {self.tolerance:g}")
            ax.set_yscale("log")
        if refused:
            ax.plot(
                refused, [0.02] * len(refused), "x", color="C3", transform=ax.get_xaxis_transform(), label="refused"
            )
        ax.set_xlabel("step")
        ax.set_title("step conservation: error under the floor is no evidence; above both, a violation", fontsize=8)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        return fig

    def state_dict(self) -> dict[str, Any]:
        return {
            "once": self._once.state_dict(),
            "readings_made": self.readings_made,
            # The epoch's counts so far: a run resumed mid-epoch reports the uninterrupted run's epoch readings.
            "metric": {k: getattr(self.metric, k).detach().cpu().clone() for k in self.metric._defaults},
            "epoch_of_state": self._epoch_of_state,
            "epoch_last_step": self._epoch_last_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._once.load_state_dict(state_dict.get("once"))
        self.readings_made = int(state_dict.get("readings_made", 0))
        self._epoch_of_state = state_dict.get("epoch_of_state")
        self._epoch_last_step = int(state_dict.get("epoch_last_step", 0))
        for k, v in state_dict.get("metric", {}).items():
            if k in self.metric._defaults:
                cur = getattr(self.metric, k)
                setattr(self.metric, k, v.to(cur.device, cur.dtype))

    # ------------------------------------------------------------------ internals

    def _precondition(self, trainer: Trainer, pl_module: LightningModule, opt: Any) -> Union[tuple[bool, str], Refusal]:
        verdict = exact_optimizer_precondition(
            opt,
            gradient_clip_val=trainer.gradient_clip_val,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
        )
        if isinstance(verdict, Refusal):
            return verdict
        if pl_module.automatic_optimization and is_overridden(
            "configure_gradient_clipping", pl_module, LightningModule
        ):
            return Refusal(
                "configure_gradient_clipping",
                f"`configure_gradient_clipping` must not be overridden for the step to conserve, got an override in "
                f"{type(pl_module).__name__}: it may rescale the gradient after it is read.",
                numbers={"module": type(pl_module).__name__},
                remedy="remove the override on the steps you want checked.",
            )
        return verdict

    def _record(self, step: int, pl_module: LightningModule, opt: torch.optim.Optimizer) -> _Pending:
        name_of = {id(p): n for n, p in pl_module.named_parameters()}
        params, names, gidx, lrs = [], [], [], []
        for i, group in enumerate(opt.param_groups):
            lr = group["lr"]
            lrs.append(float(lr.item() if isinstance(lr, torch.Tensor) else lr))
            for p in group["params"]:
                params.append(p)
                names.append(name_of.get(id(p)))
                gidx.append(i)
        # FSDP2: whole tensors (one all-gather each), so the reading is of the global step on every rank.
        theta_before = [_whole(p, self._sharded).clone() for p in params]
        audit_grads = None
        if self._audit is not None and self._audit_first:
            audit_grads = self._audit_grads(step, params, names)
        grads = None
        if audit_grads is None or pl_module.trainer.world_size > 1:
            # Under DDP another rank may lack the audit's parts this step; then every rank reads .grad.
            grads = [None if p.grad is None else _whole(p.grad, self._sharded).clone() for p in params]
        return _Pending(step, opt, params, names, gidx, lrs, theta_before, grads, audit_grads, _scale(pl_module))

    def _audit_grads(
        self, step: int, params: list[torch.Tensor], names: list[Optional[str]]
    ) -> Optional[list[Optional[torch.Tensor]]]:
        """Σ g_S from the audit's report of this step, aligned with ``params``; None if it does not cover them."""
        report = getattr(self._audit, "last_report", None)
        if report is None or getattr(self._audit, "last_report_step", None) != step:
            return None
        grads = getattr(report, "grads", None)
        if grads is None or getattr(grads, "parts_sum", None) is None:
            return None
        by_name = dict(zip(grads.names, grads.parts_sum))
        out: list[Optional[torch.Tensor]] = []
        for p, n in zip(params, names):
            if n is not None and n in by_name:
                out.append(by_name[n])
            elif p.grad is None:
                out.append(None)  # not trainable in the audit and untouched by the optimizer
            else:
                return None  # the optimizer updates a tensor the audit has no part for
        return out

    def _finish(self, trainer: Trainer, pl_module: LightningModule, before_step: Optional[int] = None) -> None:
        if self._pending_refusal is not None and (before_step is None or self._pending_refusal[0] < before_step):
            step, refusal = self._pending_refusal
            self._pending_refusal = None
            self._emit(trainer, pl_module, refusal, step)
        if self._pending is None or (before_step is not None and self._pending.step >= before_step):
            return
        pend, self._pending = self._pending, None
        merger = merger_at(self._mergers, pend.step)
        if merger is not None:
            # The optimizer applied the merger's gradient, not the module's: no claim to hold, and no violation.
            name = type(merger).__name__
            reading = Refusal(
                "merged_by",
                f"merged_by={name}: the gradient the optimizer applied was changed by {name} after the module "
                "produced it, so the update is not θ − η·(the module's gradient).",
                numbers={"step": pend.step, "merged_by": name},
                remedy=f"read the steps {name} leaves alone (mode='off', or before its first fire).",
            )
        elif pend.scale is not None and _scale(pl_module) is not None and _scale(pl_module) < pend.scale:
            reading: Union[ConservationReading, Refusal] = exact_optimizer_precondition(
                pend.optimizer, step_skipped=True
            )
        else:
            grads, source = pend.audit_grads, "credit_parts"
            if grads is None and self._audit is not None:
                grads = self._audit_grads(pend.step, pend.params, pend.names)
            if self._audit is not None and trainer.world_size > 1 and not _on_every_rank(trainer, grads is not None):
                grads = None  # the collective below must run on every rank or on none
            if grads is None:
                grads, source = pend.grads, "grad"
            elif trainer.world_size > 1 and not getattr(self._audit, "_global", False):
                grads = _mean_over_ranks(trainer, grads)
            # else: a global audit's Σ parts is already the rank average of every rank's parts.
            try:
                reading = self._read(
                    pend,
                    grads,
                    source,
                    *(self._parts_precision(trainer, pend.step) if source == "credit_parts" else (None, None)),
                )
            except Exception as err:  # a reading that cannot be made must not end the training run
                reading = Refusal(
                    "conservation",
                    f"{type(err).__name__}: {err}",
                    numbers={"step": pend.step},
                    remedy="check that the gradient held against matches the optimizer's parameters",
                )
        self._emit(trainer, pl_module, reading, pend.step)

    def _parts_precision(self, trainer: Trainer, step: int) -> tuple[Optional[float], Optional[torch.dtype]]:
        """The audit's ``conservation_error`` of this step and the coarsest dtype its parts were computed in."""
        report = getattr(self._audit, "last_report", None)
        if report is None or getattr(self._audit, "last_report_step", None) != step:
            return None, None
        dtypes = [getattr(torch, str(getattr(report, "dtype", "")), None), _autocast_dtype(trainer)]
        dtypes = [d for d in dtypes if isinstance(d, torch.dtype) and d in UNIT_ROUNDOFF]
        coarsest = max(dtypes, key=lambda d: UNIT_ROUNDOFF[d], default=None)
        return float(getattr(report, "conservation_error", float("nan"))), coarsest

    def _read(
        self,
        pend: _Pending,
        grads: Any,
        source: str,
        parts_error: Optional[float] = None,
        parts_dtype: Optional[torch.dtype] = None,
    ) -> Union[ConservationReading, Refusal]:
        with torch.no_grad():
            return step_conservation(
                pend.theta_before,
                [_whole(p, self._sharded) for p in pend.params],
                pend.lrs,
                grads,
                group_index=pend.group_index,
                tolerance=self.tolerance,
                source=source,
                step=pend.step,
                parts_error=parts_error,
                parts_dtype=parts_dtype,
            )

    def _emit(
        self, trainer: Trainer, pl_module: LightningModule, reading: Union[ConservationReading, Refusal], step: int
    ) -> None:
        self.last_reading = reading
        self.readings_made += 1
        self._epoch_of_state, self._epoch_last_step = int(trainer.current_epoch), int(step)
        self.metric.update(reading)
        if isinstance(reading, Refusal):
            self._history.append((step, float("nan"), float("nan")))
        else:
            self._history.append((step, reading.relative_error, reading.update_precision_floor))
        if isinstance(reading, Refusal):
            values = {f"{self.prefix}refused": 1.0}
            if reading.condition not in self._once.refusals:
                log_text(trainer, f"{self.prefix}refusal", reading.render(), step)
            self._once.refused(trainer, reading, step, what="conservation check")
        else:
            values = reading.to_dict(self.prefix)
            if reading.violated and self._once.warn(trainer, f"violated:{reading.source}", reading.explain()):
                log_text(trainer, f"{self.prefix}violation", reading.explain(), step)
        log_scalars(trainer, values, step)


def _autocast_dtype(trainer: Trainer) -> Optional[torch.dtype]:
    """The dtype autocast computes in under ``bf16-mixed``/``16-mixed``; None otherwise."""
    precision = str(getattr(trainer, "precision", ""))
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def _whole(t: torch.Tensor, sharded: bool) -> torch.Tensor:
    if sharded:
        from ._distributed import _full

        return _full(t.detach())
    return t.detach()


def _is_credit_audit(cb: Any) -> bool:
    # By name along the MRO: subclasses count, and the audit's module is not imported unless in use.
    return any(k.__name__ == "CreditAuditCallback" for k in type(cb).__mro__) and hasattr(cb, "keep_grads")


def _unwrap(optimizer: Any) -> Any:
    # LightningOptimizer wraps the torch optimizer; the precondition reads the real one.
    inner = getattr(optimizer, "_optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _scale(pl_module: LightningModule) -> Optional[float]:
    trainer = pl_module.trainer
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not callable(getattr(scaler, "get_scale", None)):
        return None
    if callable(getattr(scaler, "is_enabled", None)) and not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def _on_every_rank(trainer: Trainer, flag: bool) -> bool:
    dev = trainer.strategy.root_device
    n = trainer.strategy.reduce(torch.tensor(1.0 if flag else 0.0, device=dev), reduce_op="sum")
    return bool(float(n) == trainer.world_size)


def _mean_over_ranks(trainer: Trainer, grads: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    # At the optimizer step DDP has averaged .grad over ranks; the audit's backward did not go through DDP,
    # so its local sum is averaged the same way before it is held against the update.
    # One collective for the whole vector, not one per tensor.
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    flat = torch.cat([g.detach().reshape(-1).to(present[0]) for g in present])  # [Σ n]
    flat = trainer.strategy.reduce(flat, reduce_op="mean")
    out: list[Optional[torch.Tensor]] = []
    i = 0
    for g in grads:
        if g is None:
            out.append(None)
            continue
        out.append(flat[i : i + g.numel()].view(g.shape))
        i += g.numel()
    return out
