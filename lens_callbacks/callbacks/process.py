"""ProcessRewardCallback: the outcome→process reward instrument on every training step's groups."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from .._compat import renamed
from ..metrics.process import ProcessRewardMetric, readings_to_tensors
from ..process.instrument import ProcessAudit, audit_groups
from ..process.sources import groups_from_terms
from ..refusal import Refusal
from ._logging import log_figure, log_text

__all__ = ["ProcessRewardCallback", "process_reward_figure"]


def process_reward_figure(audit: ProcessAudit, group: Optional[int] = None) -> Any:
    """A heatmap of one group's process rewards, rollouts x trained positions (needs matplotlib).

    ``group`` picks the reading; by default the first group where the kill does not fire, else the first.
    Cells past a rollout's end are blank; the title carries the group's kill verdict numbers.
    """
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: the user's backend and figure registry stay as they are

    if group is None:
        group = next((i for i, r in enumerate(audit.readings) if not r.kill), 0)
    r = audit.readings[group]
    width = max(max(r.lengths, default=0), 1)
    grid = np.full((r.n_rollouts, width), np.nan)  # [K, L_max]
    for k, row in enumerate(r.process_rewards):
        grid[k, : len(row)] = row
    lim = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
    fig = Figure(figsize=(min(max(5.0, 2 + 0.35 * width), 14), 1.6 + 0.4 * r.n_rollouts))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="coolwarm", vmin=-lim or -1.0, vmax=lim or 1.0, aspect="auto", interpolation="nearest")
    ticks = list(range(0, width, max(1, width // 20)))
    ax.set_xticks(ticks, [str(t + 1) for t in ticks])  # positions are 1-based, as in the definitions
    ax.set_xlabel("trained position t")
    ax.set_ylabel("rollout k")
    ax.set_title(
        f"group {r.key}: kill {'fires' if r.kill else 'does not fire'}\n"
        f"mean divergence depth {r.mean_divergence_depth:.2f}, informative {r.informative_fraction:.3f}, "
        f"zero {r.zero_reward_fraction:.2f}",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, label="q(s≤t) − q(s<t)")
    fig.tight_layout()
    return fig


class ProcessRewardCallback(Callback):
    """Runs :func:`~lens_callbacks.process.audit_groups` on the groups each training batch sampled.

    The groups come from the module's ``credit_terms(batch)`` (``group`` ids, ``trained`` positions,
    ``tokens`` and the outcome ``rewards``), evaluated without gradients and on a forked RNG stream, so
    nothing the run has changes. Logs ``process/kill_fraction``, ``process/informative_fraction``,
    ``process/mean_divergence_depth``, ``process/zero_reward_fraction`` and ``process/n_groups``
    (summed over DDP ranks through torchmetrics), and the step's verdict as TensorBoard text
    ``process/verdict`` (rank 0's groups).

    Args:
        every_n_steps: audit every n-th training batch.
        log_text_every_n_steps: write the verdict text every n-th audit (0: never).
        log_figure_every_n_steps: every n-th audit, draw one group's process rewards (rollouts x
            positions) as a TensorBoard figure ``process/process_rewards`` (0: never; needs matplotlib).
        prefix: metric name prefix.
        log_prefix: the old name of ``prefix`` (deprecated; warns).

    YAML::

        trainer:
          callbacks:
            - class_path: lens_callbacks.ProcessRewardCallback
              init_args: {every_n_steps: 1}

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lens_callbacks import ProcessRewardCallback
        >>> process = ProcessRewardCallback(every_n_steps=10)
        >>> trainer = Trainer(callbacks=[process], max_steps=100, logger=False, enable_checkpointing=False)
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        log_text_every_n_steps: int = 1,
        log_figure_every_n_steps: int = 0,
        prefix: str = "process/",
        log_prefix: Optional[str] = None,
    ) -> None:
        super().__init__()
        prefix = renamed("ProcessRewardCallback", "log_prefix", "prefix", log_prefix, prefix, "process/")
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be an int >= 1, got {every_n_steps!r}.")
        if (
            not isinstance(log_text_every_n_steps, int)
            or isinstance(log_text_every_n_steps, bool)
            or log_text_every_n_steps < 0
        ):
            raise ValueError(
                f"`log_text_every_n_steps` must be an int >= 0 (0 turns the text off), got {log_text_every_n_steps!r}."
            )
        if (
            not isinstance(log_figure_every_n_steps, int)
            or isinstance(log_figure_every_n_steps, bool)
            or log_figure_every_n_steps < 0
        ):
            raise ValueError(
                f"`log_figure_every_n_steps` must be an int >= 0 (0 turns the figure off), got {log_figure_every_n_steps!r}."
            )
        self.every_n_steps = every_n_steps
        self.log_figure_every_n_steps = log_figure_every_n_steps
        self.log_text_every_n_steps = log_text_every_n_steps
        self.prefix = prefix
        self.metric = ProcessRewardMetric()
        self.last_audit: Optional[ProcessAudit] = None
        self.last_audit_step = -1
        self.last_refusal: Optional[Refusal] = None
        self.n_batches = 0
        self.n_audits = 0
        self.n_groups_total = 0
        self.n_killed_total = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module, "credit_terms", None)):
            raise TypeError(
                f"ProcessRewardCallback needs the LightningModule to implement `credit_terms(batch) -> CreditTerms` "
                f"with `tokens` and `rewards`, got {type(pl_module).__name__} without it."
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # The step this batch trains at (global_step before the optimizer step increments it).
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.n_batches += 1
        if (self.n_batches - 1) % self.every_n_steps:
            return
        step = getattr(self, "_step", trainer.global_step)
        audit = self._audit(pl_module, batch, step)
        if trainer.world_size > 1:
            # The metric sync below is a collective: every rank skips it together if any rank has no reading.
            failed = torch.tensor(0.0 if audit is not None else 1.0, device=pl_module.device)
            if float(trainer.strategy.reduce(failed, reduce_op="sum")) > 0:
                return
        elif audit is None:
            return
        self.metric.to(pl_module.device)
        self.metric.reset()
        self.metric.update(*readings_to_tensors(audit.readings))
        values = self.metric.compute()  # synced over ranks: every rank reaches this line on the same batches
        self.metric.reset()
        pl_module.log_dict(
            {f"{self.prefix}{k}": v.float() for k, v in values.items()},
            on_step=True,
            on_epoch=False,
            sync_dist=False,
            batch_size=max(audit.n_groups, 1),
        )
        self.last_audit = audit
        self.last_audit_step = step
        self.n_audits += 1
        self.n_groups_total += audit.n_groups
        self.n_killed_total += audit.n_killed
        if self.log_text_every_n_steps and (self.n_audits - 1) % self.log_text_every_n_steps == 0:
            self._log_text(trainer, audit.render(), step)
        if self.log_figure_every_n_steps and (self.n_audits - 1) % self.log_figure_every_n_steps == 0:
            self._log_figure(trainer, audit, step)

    def _audit(self, pl_module: LightningModule, batch: Any, step: int) -> Optional[ProcessAudit]:
        """The step's audit, or None with ``last_refusal`` set: a reading that fails never stops training."""
        dev = pl_module.device
        # `index or 0` would fork GPU 0 for a module on "cuda" (no index) while it runs on another GPU.
        devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                terms = pl_module.credit_terms(batch)
            groups = groups_from_terms(terms)
            return audit_groups(groups, source=f"step {step}")
        except Exception as err:  # noqa: BLE001 - any failure of the reading becomes a Refusal
            condition = "inputs" if isinstance(err, ValueError) else "reading"
            refusal = Refusal(
                condition,
                f"step {step}: {type(err).__name__}: {err}",
                numbers={"step": step},
                remedy="return `tokens` and `rewards` from `credit_terms(batch)` for the rollout batch of the step",
            )
            if self.last_refusal is None:
                rank_zero_warn(
                    f"ProcessRewardCallback: no reading at step {step} (later failures are not repeated): {err}"
                )
            self.last_refusal = refusal
            return None

    @staticmethod
    def _log_text(trainer: Trainer, text: str, step: int) -> None:
        log_text(trainer, "process/verdict", text, step)

    @staticmethod
    def _log_figure(trainer: Trainer, audit: ProcessAudit, step: int) -> None:
        if not trainer.is_global_zero or not audit.readings:
            return
        try:
            fig = process_reward_figure(audit)
        except ImportError:
            return
        log_figure(trainer, "process/process_rewards", fig, step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_batches": self.n_batches,
            "n_audits": self.n_audits,
            "n_groups_total": self.n_groups_total,
            "n_killed_total": self.n_killed_total,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k in ("n_batches", "n_audits", "n_groups_total", "n_killed_total"):
            if k in state_dict:
                setattr(self, k, int(state_dict[k]))
