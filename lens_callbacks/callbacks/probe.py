"""``ProbeCreditCallback``: which rollouts moved a held-out probe objective, checked against its real change.

A thin adapter over :mod:`lens_callbacks.credit.readings.probe`. At ``on_before_optimizer_step`` (the step's
unclipped ``.grad`` and the optimizer's pre-step state in place) it reads the optimizer's update map,
takes ``g_probe = ∇θ L_probe`` for every named probe batch (one backward each, on detached copies of the
parameters), and disintegrates the step's ``credit_terms`` projected onto ``D ⊙ g_probe`` (one pass of the
engine): ``c_S = −⟨D ⊙ g_S, g_probe⟩`` per part. After the step (``on_train_batch_end``) one forward of
each probe batch gives the actual change, and ``θ_after − θ_before`` the update really applied. With
``capture="training_step"`` the parts are read from what the engine's hooks captured in the training step's
own forward and backward instead of a pass of their own. When the next step is read too, that forward after
the step also takes the next reading's ``g_probe`` (``reuse_probe_pass``): the parameters do not move between
the two, so the next reading takes no probe pass of its own.

The module opts in with ``probe_terms(probe_batch) -> CreditTerms`` or ``probe_loss(probe_batch) ->
Tensor`` and a ``probe_batches`` attribute or method holding ``{name: probe_batch}`` (a single batch is
named ``probe``). It is read-only: parameters, ``.grad``, optimizer state, the modules' train/eval flags
and the random stream are left as they were.

DDP: ``.grad`` is the rank average at the hook, so ``D`` is the global step's; ``g_probe`` and the probe
losses are averaged over ranks (one all-reduce of ``|θ|`` elements per probe), each rank dots its own
parts (scaled by ``1/W``), and the per-rank readings are gathered into one reading of the global step,
parts named ``r{rank}/{part}``. Every rank calls the same collectives on the same steps.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lens_callbacks.credit.engine import native_dtype, resolve_dtype
from lens_callbacks.credit.engines import check_engine
from lens_callbacks.credit.engines.ghost import RideAlong
from lens_callbacks.credit.inputs.partition import resolve_partition
from lens_callbacks.credit.inputs.terms import is_credit_source
from lens_callbacks.credit.primitives import compiled_parts
from lens_callbacks.credit.readings.probe import (
    DEFAULT_SPLITS,
    ProbeCreditReport,
    combine_ranks,
    copy_into,
    optimizer_update_map,
    probe_credit,
    probe_value_and_grad,
    scratch_like,
    update_dot,
    with_actual,
)
from lens_callbacks.metrics.probe import ProbeCreditMetric
from lens_callbacks.refusal import Refusal

from ._capture import check_capture, compiled_blocks_ride
from ._logging import log_scalars, log_text

__all__ = ["ProbeCreditCallback"]

PROBE_MODES = ("eval", "train")


class ProbeCreditCallback(Callback):
    """Each part's first-order contribution to the change of held-out probe objectives, every n steps.

    Logged per probe (``prefix`` = ``probe/``, names in docs/metrics.md): ``probe/<name>/predicted``,
    ``actual``, ``first_order_gap``, ``relative_gap``, ``actual_floor``, ``alignment``, ``carried``,
    ``parts_sum``, ``parts_gap``, ``update_match``, ``helped_sum``, ``hurt_sum``, ``top_helped``,
    ``top_hurt``, ``loss_before``, ``split/<partition>/<part>`` for the stable-name partitions, and
    ``refused``; epoch means as ``probe/<name>/epoch/...``. The table (the parts that helped and hurt
    most, with group, reward, advantage and text) goes to TensorBoard text as ``probe/<name>/table``.

    Args:
        every_n_steps: read the steps with ``global_step % every_n_steps == 0``.
        partition: the step's partition (``"by_rollout"``, ``"by_group"``, ... or an import path).
        split_by: stable-name partitions the contributions are summed into (read where the terms carry
            the field: advantages, rewards, source).
        probe_batches: the module attribute or method holding ``{name: probe_batch}``.
        probe_mode: ``"eval"`` (default: the probe is evaluated with dropout off, the module's flags
            restored afterwards) or ``"train"`` (as the module is; every evaluation draws the same masks).
        dtype: audit precision (``"float32"``, ``"float64"``, ``"native"``).
        engine: the disintegration engine (``"auto"``: one pass for row partitions).
        capture: ``"separate"`` (default: the parts are read by a pass of the engine's own, which takes the
            step's ``.grad`` as ``g_full``) or ``"training_step"``: the one-pass engine's hooks ride on the
            training step's own forward and backward, and each probe's parts are read from what they captured
            against ``D ⊙ g_probe`` (no forward or backward of the step's batch beyond the training step's).
            The covered layers' inputs and output gradients are held from the training backward to the
            reading (``D`` exists only once ``.grad`` does). Where the captures cannot be read (the loss is not
            ``terms.sum()``, several processes, a compiled module, a parameter outside the covered layers) the
            step is read by the separate pass, and a warning says so once; parts inside rows are read by the
            forward-mode tangent pass along ``.grad`` either way.
        reuse_probe_pass: when the next step is read too (``every_n_steps=1``), the probe's forward after a read
            step takes ``g_probe`` as well, and the next reading uses it instead of a forward and backward of its
            own: one probe backward per reading where two probe passes were (the parameters are the same at
            both: checked by their version counters, and the probe batch by value; anything else changed and the
            reading evaluates the probe itself). Costs ``g_probe`` (one parameter size per probe, float32) held
            through the next step's forward and backward; False keeps that memory free.
        keep_scratch: one parameter-sized buffer (the audit's dtype) holds each probe's ``D ⊙ g_probe`` in turn
            and then ``θ_before``; True (default) keeps it from one reading to the next when the next step is read
            too (``every_n_steps=1``), so a reading writes into memory already mapped instead of a tensor made
            fresh (whose page faults a CPU pays on every write). It is held through the next step's forward and
            backward; False frees it after each reading.
        top_k: parts listed as helped and hurt in the table.
        log_table_every_n_steps: at least this many steps between two text tables (0: only the last); the last
            reading's table is always written at the end of fit, as ``CreditAuditCallback`` does.
        seed: seeds the random stream every probe evaluation runs under (forked; the run's is untouched).
        precision_context: evaluate under the trainer's autocast, as ``training_step`` runs.
        prefix: metric namespace.

    Attributes:
        last_reports: the latest reading per probe (a :class:`ProbeCreditReport` or a :class:`Refusal`).
        history: ``(step, probe, predicted, actual)`` of every reading made (kept across a resume).
        n_readings, n_refusals: counts (kept across a resume).
        n_probe_reused: readings whose probe pass was the previous step's forward after it (``reuse_probe_pass``).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lens_callbacks import ProbeCreditCallback
        >>> probe = ProbeCreditCallback(every_n_steps=20, partition="by_rollout")  # reads module.probe_batches()
        >>> trainer = Trainer(callbacks=[probe], max_steps=100, logger=False, enable_checkpointing=False)
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        partition: str = "by_rollout",
        split_by: Optional[Sequence[str]] = None,
        probe_batches: str = "probe_batches",
        probe_mode: str = "eval",
        dtype: str = "float32",
        engine: str = "auto",
        capture: str = "separate",
        reuse_probe_pass: bool = True,
        keep_scratch: bool = True,
        top_k: int = 3,
        log_table_every_n_steps: int = 10,
        seed: int = 0,
        precision_context: bool = True,
        prefix: str = "probe/",
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("top_k", top_k, 0),
            ("log_table_every_n_steps", log_table_every_n_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
        if probe_mode not in PROBE_MODES:
            raise ValueError(f"`probe_mode` must be one of {list(PROBE_MODES)}, got {probe_mode!r}.")
        if not isinstance(probe_batches, str) or not probe_batches.isidentifier():
            raise ValueError(
                f"`probe_batches` must name a module attribute or method, got {probe_batches!r}; e.g. 'probe_batches'."
            )
        if not (isinstance(partition, str) and "." in partition):
            resolve_partition(partition)  # an unknown name raises here, naming the valid ones
        splits = list(DEFAULT_SPLITS) if split_by is None else list(split_by)
        for spec in splits:
            if not (isinstance(spec, str) and "." in spec):
                resolve_partition(spec)
        resolve_dtype(dtype)
        check_engine(engine, "projected")
        check_capture(capture)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an int, got {seed!r}.")
        for name, flag in (("reuse_probe_pass", reuse_probe_pass), ("keep_scratch", keep_scratch)):
            if not isinstance(flag, bool):
                raise ValueError(f"`{name}` must be a bool, got {flag!r}.")
        self.every_n_steps = every_n_steps
        self.partition = partition
        self.split_by = splits
        self.probe_batches_attr = probe_batches
        self.probe_mode = probe_mode
        self.dtype = dtype
        self.engine = engine
        self.capture = capture
        self.reuse_probe_pass = reuse_probe_pass
        self.keep_scratch = keep_scratch
        self.top_k = top_k
        self.log_table_every_n_steps = log_table_every_n_steps
        self.seed = seed
        self.precision_context = bool(precision_context)
        self.prefix = prefix
        self.metrics: dict[str, ProbeCreditMetric] = {}
        self.last_reports: dict[str, Union[ProbeCreditReport, Refusal]] = {}
        self.last_values: dict[str, float] = {}
        self.last_epoch_values: dict[str, float] = {}  # the epoch means logged at the latest epoch end
        self.history: list[tuple[int, str, float, float]] = []
        self.n_readings = 0
        self.n_refusals = 0
        self.n_ride_along = 0  # readings whose parts were read from the training step's own captures
        self.n_probe_reused = 0  # readings whose probe pass was the forward after the previous step
        self._ahead: dict[str, _Ahead] = {}  # probe -> its pass after the previous read step, for the next reading
        self._scratch: Optional[list[torch.Tensor]] = None  # the previous reading's buffer, for the next reading
        self._batch: Any = None
        self._ride: Optional[RideAlong] = None
        self._ride_blocked: Optional[str] = None  # why this fit's steps are not captured (set at setup / first step)
        self._compiled: Optional[list[str]] = None
        self._ride_warned = False
        self._pending: Optional[_Pending] = None
        self._refusals_logged: set[str] = set()
        self._last_table_step: Optional[int] = None
        self._unwritten: dict[str, tuple[str, int]] = {}  # probe -> (table, step) of a reading not yet tabled
        self._global = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            partition=str(self.partition), every_n_steps=self.every_n_steps, prefix=self.prefix
        )

    # ---- setup -----------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from ._distributed import check_strategy

        if not is_credit_source(pl_module):
            raise TypeError(
                f"ProbeCreditCallback needs the LightningModule to implement `credit_terms(batch) -> CreditTerms`, got "
                f"{type(pl_module).__name__} without it (see docs/interface.md)."
            )
        if self._probe_fn(pl_module) is None:
            raise TypeError(
                f"ProbeCreditCallback needs the LightningModule to implement `probe_terms(probe_batch) -> CreditTerms` or "
                f"`probe_loss(probe_batch) -> Tensor`, got {type(pl_module).__name__} without either (see docs/probe_credit.md)."
            )
        if not hasattr(pl_module, self.probe_batches_attr):
            raise TypeError(
                f"`probe_batches` names `{self.probe_batches_attr}`, which {type(pl_module).__name__} does not have: give "
                "the module an attribute or method holding {name: probe_batch}, or pass its name."
            )
        check_strategy(trainer, "ProbeCreditCallback")
        self._global = trainer.world_size > 1
        self._batch = None  # a resumed or repeated fit never reads a batch of an earlier one
        self._ahead.clear()
        self._scratch = None
        self._ride_blocked = None
        if self.capture == "training_step" and self._global:
            self._ride_blocked = "several processes: `.grad` is the rank average, not this rank's terms' gradient"
        self._compiled = None  # read at the first step: configure_model may compile after setup

    @staticmethod
    def _probe_fn(pl_module: Any) -> Any:
        for name in ("probe_terms", "probe_loss"):
            fn = getattr(pl_module, name, None)
            if callable(fn):
                return fn
        return None

    def _probes(self, pl_module: Any) -> dict[str, Any]:
        got = getattr(pl_module, self.probe_batches_attr)
        got = got() if callable(got) else got
        if not isinstance(got, Mapping):
            return {"probe": got}
        for name in got:
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"probe batch names must be non-empty strings without '/', got {name!r}.")
        return dict(got)

    # ---- the reading --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        self._pending = None
        self._stop_ride()
        if self.capture != "training_step" or int(trainer.global_step) % self.every_n_steps:
            return
        if int(trainer.accumulate_grad_batches) > 1:
            return  # probe credit refuses an accumulated step by name: nothing to capture for it
        if self._compiled is None:
            self._compiled = compiled_parts(pl_module)
            if self._compiled and self._ride_blocked is None:
                self._ride_blocked = compiled_blocks_ride(self._compiled)
        if self._ride_blocked is None:
            self._ride = RideAlong(pl_module).start()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._ride is not None:  # only captured: D ⊙ g_probe exists after the backward
            self._ride.on_loss(loss, scale=1.0 / int(trainer.accumulate_grad_batches))

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._ride is not None:
            self._ride.stop()  # captured; another callback's pass before the reading is not the training step's

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_ride()
        self._ahead.clear()

    def _stop_ride(self) -> None:
        if self._ride is not None:
            self._ride.clear()
            self._ride = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        step = int(trainer.global_step)
        if step % self.every_n_steps:
            return
        if self._ride is None and self.capture == "training_step" and self._ride_blocked is not None:
            self._warn_ride(self._ride_blocked)
        try:
            self._read_step(trainer, pl_module, optimizer, step)
        finally:
            self._stop_ride()
            self._ahead.clear()  # a probe pass is reused by the reading right after it, or by none

    def _warn_ride(self, why: str) -> None:
        if not self._ride_warned:
            self._ride_warned = True
            warnings.warn(
                f"probe credit: capture='training_step' falls back to a separate pass ({why}).",
                RuntimeWarning,
                stacklevel=3,
            )

    def _read_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any, step: int) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        update = self._update_map(trainer, pl_module, optimizer, params)
        probes: dict[str, Any] = {}
        if not isinstance(update, Refusal):
            failure = None
            try:
                probes = self._probes(pl_module)
            except Exception as err:  # a probe that cannot be read must not end the training run
                failure = f"{type(err).__name__}: {err}"
            if self._global:  # every rank reads the same probes, or none does: the collectives below pair up
                failure = self._agree(trainer, failure, sorted(probes))
            if failure is not None:
                update = Refusal(
                    "probe_batches",
                    failure,
                    numbers={"step": step},
                    remedy="make `probe_batches` return {name: probe_batch}, the same names on every rank",
                )
        if isinstance(update, Refusal):
            self._refuse(trainer, update, step, sorted(probes) or self._known_names(pl_module))
            return
        # One parameter-sized buffer: each probe's v = D ⊙ g_probe in turn (no reading holds it past its own),
        # then θ_before, copied after the readings (nothing between changes θ), for Δθ after the step.
        held, self._scratch = self._scratch, None
        scratch = scratch_like(params, resolve_dtype(self.dtype) or native_dtype(pl_module), held)
        pending: dict[str, tuple[ProbeCreditReport, list[torch.Tensor], Any]] = {}
        for name in sorted(probes):
            got = self._read_one(trainer, pl_module, update, name, probes[name], step, scratch)
            if isinstance(got, Refusal):
                self._refuse(trainer, got, step, [name])
            else:
                pending[name] = (*got, probes[name])  # the very batch is evaluated again after the step
        self._pending = _Pending(step, copy_into(scratch, params), pending, scratch) if pending else None

    def _known_names(self, pl_module: Any) -> list[str]:
        """The probes' names for a refused step: the module's, else those read before, else ``probe``."""
        try:
            return sorted(self._probes(pl_module))
        except Exception:  # the refusal itself says what went wrong
            return sorted(self.metrics) or ["probe"]

    def _update_map(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any, params: list[torch.Tensor]):
        from ._distributed import is_sharded

        if is_sharded(pl_module):
            return Refusal(
                "sharded",
                "probe credit reads whole parameters and gradients; sharded (FSDP2) parameters are not read.",
                remedy="use DDP for the steps you want probe credit on",
            )
        if not getattr(pl_module, "automatic_optimization", True):
            return Refusal(
                "manual_optimization",
                "probe credit reads the step Lightning takes; manual optimization hides it.",
                remedy="use automatic optimization",
            )
        if is_overridden("configure_gradient_clipping", pl_module, LightningModule):
            return Refusal(
                "configure_gradient_clipping",
                f"`configure_gradient_clipping` must not be overridden for probe credit, got an override in "
                f"{type(pl_module).__name__}: it may rescale the gradient after it is read.",
                numbers={"module": type(pl_module).__name__},
                remedy="remove the override on the steps you read",
            )
        return optimizer_update_map(
            optimizer,
            params,
            gradient_clip_val=trainer.gradient_clip_val,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
        )

    def _evaluate(self, pl_module: LightningModule, batch: Any, grad: bool):
        from ._distributed import precision_context

        ctx = precision_context(pl_module.trainer) if self.precision_context else None
        with self._mode(pl_module), torch.enable_grad() if grad else torch.no_grad():
            return probe_value_and_grad(
                pl_module,
                self._probe_fn(pl_module),
                batch,
                dtype=self.dtype,
                grad=grad,
                seed=self.seed,
                forward_context=ctx,
            )

    @contextlib.contextmanager
    def _mode(self, pl_module: LightningModule) -> Iterator[None]:
        if self.probe_mode == "train":
            yield
            return
        flags = [(m, m.training) for m in pl_module.modules()]
        pl_module.eval()
        try:
            yield
        finally:
            for m, was in flags:
                m.training = was

    def _read_one(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        update: Any,
        name: str,
        batch: Any,
        step: int,
        scratch: Sequence[torch.Tensor],
    ):
        """Before the step: ``g_probe``, ``L_probe(θ_before)`` and the contributions (collectives on every rank)."""
        from ._distributed import precision_context

        failure: Optional[str] = None
        loss, gp = float("nan"), None
        ahead = self._ahead.pop(name, None)
        if ahead is not None and ahead.fits(batch, pl_module):
            loss, gp = ahead.loss, ahead.grad  # the forward after the previous step, at these very parameters
            self.n_probe_reused += 1
        else:
            try:
                loss, gp = self._evaluate(pl_module, batch, grad=True)
            except Exception as err:  # a user-data failure must not end the training run
                failure = f"probe {name!r}: {type(err).__name__}: {err}"
        if self._global:
            gp, loss, failure = self._average(trainer, pl_module, gp, loss, failure)
        report: Optional[ProbeCreditReport] = None
        if failure is None:
            try:
                ctx = precision_context(trainer) if self.precision_context else None
                with torch.enable_grad():  # the hook may run inside optimizer.step with grad mode off
                    report = probe_credit(
                        pl_module,
                        self._batch,
                        self.partition,
                        update,
                        gp,
                        probe=name,
                        loss_before=loss,
                        dtype=self.dtype,
                        forward_context=ctx,
                        engine=self.engine,
                        split_by=self.split_by,
                        texts=_texts(pl_module),
                        scale=1.0 / trainer.world_size if self._global else 1.0,
                        step=step,
                        ride=self._ride,
                        onto_out=scratch,
                    )
            except Exception as err:
                failure = f"probe {name!r}: {type(err).__name__}: {err}"
        if report is not None and self._ride is not None:
            if report.ride_fallback is not None:
                self._warn_ride(report.ride_fallback)
            else:
                self.n_ride_along += 1
        if self._global:
            report, failure = self._gather(report, failure)
        if failure is not None or report is None:
            return Refusal(
                "probe_credit",
                str(failure),
                numbers={"step": step},
                remedy="check probe_loss/probe_terms and credit_terms on this step's batches (docs/probe_credit.md)",
            )
        return report, gp

    def _average(self, trainer: Trainer, pl_module: LightningModule, gp, loss, failure):
        """``g_probe`` and ``L_probe`` averaged over ranks; a failure on any rank fails every rank alike."""
        from ._distributed import strategy_collectives

        coll = strategy_collectives(trainer)
        like = [p for p in pl_module.parameters() if p.requires_grad]
        pieces = [torch.zeros_like(p) for p in like] if gp is None else gp
        flat = torch.cat([x.detach().double().reshape(-1) for x in pieces])  # [|θ|]
        head = torch.tensor([0.0 if failure is None else 1.0, loss if failure is None else 0.0], dtype=torch.float64)
        total = coll.all_reduce_sum(torch.cat([head, flat]))
        w = coll.world_size
        if float(total[0]) > 0:
            return None, float("nan"), failure or "probe evaluation failed on another rank"
        out, i = [], 2
        for p in like:
            out.append((total[i : i + p.numel()] / w).view(p.shape).to(pieces[0].dtype))
            i += p.numel()
        return out, float(total[1]) / w, None

    @staticmethod
    def _agree(trainer: Trainer, failure: Optional[str], names: list[str]) -> Optional[str]:
        """``failure`` if any rank failed to read its probes or names other probes than rank 0, else None."""
        objs: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(objs, (failure, names))
        bad = [f for f, _ in objs if f is not None]
        if bad:
            return bad[0]
        if any(n != objs[0][1] for _, n in objs):
            return f"the ranks name different probe batches: {[n for _, n in objs]}"
        return None

    def _gather(self, report, failure):
        objs: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(objs, (report, failure))
        failures = [f for _, f in objs if f is not None]
        if failures:
            return None, failures[0]
        return combine_ranks([r for r, _ in objs]), None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pending, self._pending = self._pending, None
        self._batch = None
        self._stop_ride()  # a step that ended without its optimizer step (skipped) is never read
        if pending is None:
            return
        step, before, reports, scratch = pending
        params = [p for p in pl_module.parameters() if p.requires_grad]
        values: dict[str, float] = {}
        n = self.log_table_every_n_steps
        table = bool(n) and (self._last_table_step is None or step - self._last_table_step >= n)
        # the next step is read too: this forward after the step is its probe pass (g_probe taken with it), and
        # the buffer that held v and θ_before is the next reading's
        next_read = (step + 1) % self.every_n_steps == 0
        ahead = self.reuse_probe_pass and next_read
        for name, (report, gp, probe_batch) in reports.items():
            try:
                after = self._after(pl_module, name, probe_batch, ahead)
                failure = None
            except Exception as err:
                after, failure = float("nan"), f"{type(err).__name__}: {err}"
            if self._global:
                after, failure = self._average_scalar(trainer, after, failure)
            if failure is not None:
                self._refuse(
                    trainer,
                    Refusal("probe_after", f"probe {name!r} after the step: {failure}", numbers={"step": step}),
                    step,
                    [name],
                )
                continue
            report = with_actual(report, after, applied=update_dot(before, params, gp))  # no Δθ formed
            self.last_reports[name] = report
            self.n_readings += 1
            self._metric(name).update(report)
            self.history.append((step, name, report.predicted, report.actual))
            del self.history[:-4096]
            values.update(report.to_dict(f"{self.prefix}{name}/"))
            if table:
                log_text(trainer, f"{self.prefix}{name}/table", report.render(self.top_k), step)
                self._unwritten.pop(name, None)
            else:
                self._unwritten[name] = (report.render(self.top_k), step)
        if self.keep_scratch and next_read:
            self._scratch = scratch
        if table and values:
            self._last_table_step = step
        self.last_values = values
        log_scalars(trainer, values, step)

    def _after(self, pl_module: LightningModule, name: str, batch: Any, ahead: bool) -> float:
        """``L_probe(θ_after)``; with ``ahead``, ``g_probe`` too, kept for the next reading."""
        if ahead:
            try:
                loss, grad = self._evaluate(pl_module, batch, grad=True)
            except Exception:  # read without the gradient below: this reading's failure, if any, is named there
                pass
            else:
                self._ahead[name] = _Ahead(batch, loss, grad, _marks(pl_module))
                return loss
        return self._evaluate(pl_module, batch, grad=False)[0]

    @staticmethod
    def _average_scalar(trainer: Trainer, value: float, failure: Optional[str]):
        from ._distributed import strategy_collectives

        coll = strategy_collectives(trainer)
        t = coll.all_reduce_sum(
            torch.tensor([0.0 if failure is None else 1.0, value if failure is None else 0.0], dtype=torch.float64)
        )
        if float(t[0]) > 0:
            return float("nan"), failure or "the probe failed on another rank"
        return float(t[1]) / coll.world_size, None

    def _metric(self, name: str) -> ProbeCreditMetric:
        if name not in self.metrics:
            self.metrics[name] = ProbeCreditMetric()
        return self.metrics[name]

    def _refuse(self, trainer: Trainer, refusal: Refusal, step: int, names: Sequence[str]) -> None:
        values: dict[str, float] = {}
        for name in names:
            self.last_reports[name] = refusal
            self.n_refusals += 1
            self._metric(name).update(refusal)
            values.update(refusal.to_dict(f"{self.prefix}{name}/"))
        log_scalars(trainer, values, step)
        self.last_values = values
        if refusal.condition not in self._refusals_logged:  # once per condition: a refused optimizer refuses every step
            self._refusals_logged.add(refusal.condition)
            warnings.warn(f"probe credit at step {step} declined: {refusal.reason}", RuntimeWarning, stacklevel=2)
            log_text(trainer, f"{self.prefix}refusal", refusal.render(), step)

    # ---- epoch means and state -----------------------------------------------------------------------

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The last reading's table, when its step wrote none (``log_table_every_n_steps`` skipped it, or 0)."""
        for name, (text, step) in self._unwritten.items():
            log_text(trainer, f"{self.prefix}{name}/table", text, step)
        self._unwritten.clear()
        self._ahead.clear()
        self._scratch = None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        values: dict[str, float] = {}
        for name, metric in self.metrics.items():
            if float(metric.readings) == 0:
                continue
            for k, v in metric.compute().items():
                if math.isfinite(float(v)):
                    values[f"{self.prefix}{name}/epoch/{k}"] = float(v)
            metric.reset()
        self.last_epoch_values = values
        log_scalars(trainer, values, max(int(trainer.global_step) - 1, 0))

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_readings": self.n_readings,
            "n_refusals": self.n_refusals,
            "history": list(self.history),
            "last_table_step": self._last_table_step,
            "metrics": {
                name: {k: getattr(m, k).detach().cpu().clone() for k in m._defaults} for name, m in self.metrics.items()
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_readings = int(state_dict.get("n_readings", 0))
        self.n_refusals = int(state_dict.get("n_refusals", 0))
        self.history = [tuple(h) for h in state_dict.get("history", [])]
        self._last_table_step = state_dict.get("last_table_step")
        for name, states in state_dict.get("metrics", {}).items():
            m = self._metric(name)
            for k, v in states.items():
                if k in m._defaults:
                    setattr(m, k, v.to(getattr(m, k).dtype))


def _marks(pl_module: Any) -> list[tuple[int, int, int]]:
    """Each trainable parameter's identity, storage and version counter: equal marks, the same values."""
    return [(id(p), p.data_ptr(), p._version) for p in pl_module.parameters() if p.requires_grad]


def _same_batch(a: Any, b: Any) -> bool:
    """Whether two probe batches hold the same values (tensors, containers, plain scalars; anything else: identity)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return list(a.keys()) == list(b.keys()) and all(_same_batch(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_batch(x, y) for x, y in zip(a, b))
    if isinstance(a, (str, bytes, int, float, bool, type(None))):
        return bool(a == b)
    return False


class _Pending(NamedTuple):
    """A read step's readings, completed after the optimizer step (``on_train_batch_end``)."""

    step: int
    before: list[torch.Tensor]  # θ_before (in `scratch` where its dtype is the parameter's)
    reports: dict[str, tuple[ProbeCreditReport, list[torch.Tensor], Any]]  # probe -> (report, g_probe, batch)
    scratch: list[torch.Tensor]  # the buffer v was written into, kept for the next reading


class _Ahead(NamedTuple):
    """A probe's pass after a read step (``L_probe(θ_after)`` and ``g_probe`` there), for the next reading."""

    batch: Any
    loss: float
    grad: list[torch.Tensor]
    marks: list[tuple[int, int, int]]

    def fits(self, batch: Any, pl_module: Any) -> bool:
        """The parameters are untouched since (the same tensors, storages and versions) and the batch is the same."""
        return _marks(pl_module) == self.marks and _same_batch(self.batch, batch)


def _texts(pl_module: Any) -> Optional[list[Optional[str]]]:
    """One text per row of the step's batch (``last_rollouts``: prompt and completion), when the module keeps them."""
    rollouts = getattr(pl_module, "last_rollouts", None)
    if not rollouts:
        return None
    out: list[Optional[str]] = []
    for r in rollouts:
        get = (lambda k: r.get(k)) if isinstance(r, Mapping) else (lambda k: getattr(r, k, None))
        prompt, completion = get("prompt"), get("completion")
        out.append(None if completion is None else f"{prompt or ''}{completion}")
    return out
