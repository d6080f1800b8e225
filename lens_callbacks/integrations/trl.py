r"""The credit audit and step conservation for TRL's ``GRPOTrainer``.

Two pieces, used together::

    from trl import GRPOTrainer
    from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback

    class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
        pass

    trainer = AuditedGRPO(model=..., reward_funcs=..., args=..., train_dataset=...,
                          callbacks=[LensTRLCallback()])
    trainer.train()

:class:`LensGRPOMixin` captures what a ``TrainerCallback`` cannot see: the micro-batches of each
optimizer step as the loss saw them (after TRL's shuffle and split), a run-wide unique rollout id, the
prompt group and the outcome reward of every row (attached while generating and scoring, before the
shuffle, as extra ``[B]`` tensors that travel through the split), the entropy coefficient each
micro-batch applied, and the pre-clip gradient norm (transformers clips *before*
``on_pre_optimizer_step``). It exposes ``credit_terms``: TRL's per-token loss re-derived for the
configured ``loss_type`` with TRL's own ``_get_per_token_logps_and_entropies`` (so the forward, its
autocast and its fused LM head are TRL's), divided by that loss type's own normaliser, the
accumulation count included, plus the KL and entropy-bonus terms at the positions they come from.
Summed over the step's micro-batches, the terms' gradient is the gradient the optimizer receives before
clipping.

Where it is exact (one process, no mixed precision, every trained parameter in a layer the one-pass
engine's hooks cover — a trained LM head, which TRL's fused head reads outside the layer, is recorded by
:class:`~lens_callbacks.integrations.trl_fused_head.FusedHeadCapture` off Triton devices), the audit rides on
TRL's own forward and backward: the mixin runs TRL's forward inside the hooks, TRL's loss is taken and
backpropagated on that forward's outputs unchanged, and the per-rollout readings are reduced inside TRL's
backward (with gradient accumulation: every micro-batch captured on its own backward and the step read
once after the last one, against the accumulated ``.grad``, by
:func:`~lens_callbacks.credit.engines.ghost.report_accumulated`); the adapter's terms are held, every
micro-batch, to send the same gradient into the forward's outputs as TRL's loss. Elsewhere, and as the
fallback of any step that cannot ride, :class:`LensTRLCallback` runs
:func:`lens_callbacks.credit.disintegrate` at ``on_pre_optimizer_step`` (``grad_match`` against ``.grad``
with the clip coefficient divided out) and the step-conservation check at ``on_optimizer_step`` (the
update held against the clip coefficient times ``Σ_S g_S``), and logs both through ``Trainer.log`` — so every ``report_to`` integration, TensorBoard included, gets
them — under the names the Lightning callbacks use (``credit/...``, ``conservation/...``).

Configurations the adapter cannot read exactly are refused by name (:class:`~lens_callbacks.refusal.
Refusal`), never audited into a wrong number: a MoE auxiliary loss (it has no position), vLLM
generation (its importance-sampling correction is untested here), multimodal inputs, parameters sharded across processes (DeepSpeed, FSDP, Megatron-LM, XLA), loss types
this version does not know.

Under several data-parallel processes (DDP: ``accelerate launch``/``torchrun`` with ``MULTI_GPU``/``MULTI_CPU``
and the like) ``.grad`` at the optimizer step is the rank average ``ḡ = (1/W) Σ_r g_r``. Each rank then
disintegrates its own micro-batches with ``project_onto=ḡ / c`` and the ranks combine their readings with
:func:`lens_callbacks.credit.readings.distributed.global_report` over ``torch.distributed``: part names
``r{rank}/...``, shares over all ranks summing to 1, ``grad_match`` and the conservation check held against
the global step. Every rank holds the same readings; only the main process logs them.

Supported versions: trl >= 1.16, < 1.17 with transformers >= 5.0 (tested: trl 1.16.0, transformers
5.24.0, peft 0.21.2, accelerate 1.15.0). Install the extra from a checkout: ``pip install -e '.[trl]'``.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..refusal import Refusal

SUPPORTED_TRL = (">=1.16", "<1.17")
SUPPORTED_TRANSFORMERS = (">=5.0",)
_TRL_MIN, _TRL_MAX, _TF_MIN = "1.16", "1.17", "5.0"


def _check_versions() -> None:
    from packaging.version import Version

    try:
        import transformers
        import trl
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "lens_callbacks.integrations.trl needs the `trl` extra (trl >= 1.16, < 1.17 and transformers >= 5.0): "
            f"pip install -e '.[trl]' in a checkout of lens_callbacks. ({e})"
        ) from e
    v = Version(trl.__version__).release
    if not (Version(_TRL_MIN).release <= v < Version(_TRL_MAX).release):
        raise ImportError(
            f"lens_callbacks.integrations.trl supports trl >= {_TRL_MIN}, < {_TRL_MAX}, got trl {trl.__version__}: "
            "each loss type's normaliser is re-derived from that version's GRPOTrainer. Install the `trl` extra "
            "(it pins the tested range): pip install -e '.[trl]' in a checkout of lens_callbacks."
        )
    if Version(transformers.__version__).release < Version(_TF_MIN).release:
        raise ImportError(
            f"lens_callbacks.integrations.trl supports transformers >= {_TF_MIN}, got transformers "
            f"{transformers.__version__}. Install the `trl` extra: pip install -e '.[trl]' in a checkout of lens_callbacks."
        )


_check_versions()

from transformers import Trainer, TrainerCallback  # noqa: E402  (after the version check)

from .._compat import renamed  # noqa: E402
from ..credit import disintegrate, exact_optimizer_precondition, step_conservation  # noqa: E402
from ..credit.engines import check_engine  # noqa: E402
from ..credit.engines.ghost import RideAlong, batch_rows, report_accumulated  # noqa: E402
from ..credit.guard import Suspects, guard  # noqa: E402
from ..credit.inputs.partition import apply_partition, resolve_partition  # noqa: E402
from ..credit.inputs.terms import CreditTerms, CreditTermsError  # noqa: E402
from ..credit.primitives import compiled_parts  # noqa: E402
from ..credit.readings.conservation import UNIT_ROUNDOFF, ConservationReading  # noqa: E402
from ..credit.readings.distributed import Collectives, global_report  # noqa: E402
from ..credit.readings.mismatch import grad_match_threshold, terms_not_loss_words  # noqa: E402
from ..credit.report import CreditReport  # noqa: E402
from .trl_fused_head import fused_head_refusal, head_captures  # noqa: E402

__all__ = [
    "LensGRPOMixin",
    "LensTRLCallback",
    "MicroBatch",
    "LOSS_TYPES",
    "trl_step_precondition",
    "SUPPORTED_TRL",
    "SUPPORTED_TRANSFORMERS",
]

log = logging.getLogger(__name__)

#: The loss types of trl 1.16 whose per-token terms and normalisers :meth:`LensGRPOMixin.credit_terms` re-derives.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "vespo", "luspo")

# accelerate's distributed types that shard parameters, gradients or optimizer state across processes.
_SHARDED_TYPES = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _dist_collectives(device: torch.device) -> Collectives:
    """:class:`Collectives` over ``torch.distributed``'s default group (gloo on CPU, NCCL on GPU)."""
    dist = torch.distributed
    W, rank = dist.get_world_size(), dist.get_rank()

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device).contiguous()
        out = [torch.empty_like(x) for _ in range(W)]
        dist.all_gather(out, x)
        return torch.stack(out)  # [W, *]

    def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device).clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    return Collectives(rank, W, all_gather, all_reduce_sum)


# Inputs a multimodal policy's batch carries; their presence means the forward is not the text-only one.
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)


@dataclass
class MicroBatch:
    """One micro-batch of an optimizer step, as TRL's loss saw it.

    Attributes:
        inputs: the dict ``compute_loss`` received (tensors shared with TRL's buffer, not copied), with
            ``lens_rollout``/``lens_group``/``lens_reward`` ``[B]`` attached at generation.
        accumulation: ``current_gradient_accumulation_steps`` when the loss was taken (TRL divides by it).
        entropy_coef: the entropy-bonus coefficient this micro-batch applied (0 when the bonus is off;
            adaptive control may change it after the step's last micro-batch).
        entropy_mask: the high-entropy token mask ``[B, T]`` the loss applied (``top_entropy_quantile < 1``),
            None otherwise. Its threshold is a quantile over every process's entropies (a collective), so
            the audit reuses the mask training used instead of recomputing it.
    """

    inputs: dict[str, Any]
    accumulation: int
    entropy_coef: float
    entropy_mask: Optional[torch.Tensor] = None


class LensGRPOMixin:
    """Mix into ``GRPOTrainer`` (``class AuditedGRPO(LensGRPOMixin, GRPOTrainer)``) to make its steps auditable.

    Training is unchanged: every override calls TRL's method and only records what it saw (extra
    ``[B]`` tensors in the generation batch are ignored by TRL's loss). ``lens_loss_type`` (default: the
    trainer's ``loss_type``) chooses the normaliser ``credit_terms`` uses; set it to another loss type
    only to see ``grad_match`` catch the mismatch.
    """

    lens_loss_type: Optional[str] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        wrong = _mixin_after(cls)
        if wrong is not None:
            # Said where the class is defined: with the bases in this order nothing binds the callback, so at
            # train time it cannot tell why it has no trainer.
            msg = (
                f"{cls.__name__} lists {wrong.__name__} before LensGRPOMixin in its bases, so {wrong.__name__}'s "
                "methods shadow the mixin's: it never records a micro-batch and nothing is audited. The order is "
                f"wrong: write class {cls.__name__}(LensGRPOMixin, {wrong.__name__})."
            )
            warnings.warn(msg, UserWarning, stacklevel=2)
            log.warning("LensGRPOMixin: %s", msg)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lens_micro: list[MicroBatch] = []
        self._lens_micro_step: Optional[int] = None
        self._lens_next_rollout = 0
        self._lens_rewards_per_func: Optional[torch.Tensor] = None
        self._lens_clip: Optional[tuple[int, torch.Tensor, float]] = None
        self._lens_in_loss = False
        self._lens_ride: Optional[_Ride] = None
        self._lens_ride_result: Optional[tuple[int, Union[CreditReport, str]]] = None
        self._lens_rides: list[_Ride] = []  # the step's earlier micro-batches, captured, read after the last backward
        self._lens_given_forward: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, LensTRLCallback):
                cb.bind(self)

    def add_callback(self, callback: Any) -> None:
        super().add_callback(callback)
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, LensTRLCallback) and cb.trainer is None:
                cb.bind(self)

    # --- capture -------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._lens_rewards_per_func = out  # [B_global, n_funcs], gathered over processes
        return out

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        self._lens_rewards_per_func = None
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        completion_ids = out["completion_ids"]  # [B, T]
        B, dev = completion_ids.size(0), completion_ids.device
        W, r = self.accelerator.num_processes, self.accelerator.process_index
        # Run-wide ids: with num_iterations > 1 the same rollouts train in consecutive steps.
        start = self._lens_next_rollout + r * B
        rollout = torch.arange(start, start + B, device=dev)  # [B]
        self._lens_next_rollout += W * B
        out["lens_rollout"] = rollout
        # TRL groups num_generations consecutive rows of the process-ordered generation batch.
        out["lens_group"] = rollout // int(self.num_generations)  # [B]
        rpf = self._lens_rewards_per_func
        if rpf is not None and rpf.dim() == 2 and rpf.size(0) == W * B:
            w = self.reward_weights.to(rpf.device, rpf.dtype)
            out["lens_reward"] = (rpf * w.unsqueeze(0)).nansum(dim=1)[r * B : (r + 1) * B].to(dev)  # [B]
        self._lens_rewards_per_func = None
        return out

    def _lens_applied_entropy_coef(self) -> float:
        if not getattr(self, "_entropy_bonus_enabled", False):
            return 0.0
        if getattr(self, "use_adaptive_entropy", False):
            return float(self.entropy_coef) if self._last_world_entropy <= self.args.entropy_target else 0.0
        return float(self.entropy_coef)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        if not self.model.training:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        step = int(self.state.global_step)
        if self._lens_micro_step != step:
            self._lens_micro, self._lens_micro_step = [], step
        mb = MicroBatch(dict(inputs), int(self.current_gradient_accumulation_steps), self._lens_applied_entropy_coef())
        self._lens_micro.append(mb)
        if len(self._lens_micro) == 1:  # a new step: what an earlier one left (an interrupted step) goes
            self._lens_drop_rides()
            self._lens_ride_result = None
        self._lens_ride = None
        cb, reason = self._lens_ride_decision()
        if cb is not None:
            try:
                self._lens_ride = self._lens_ride_prepare(cb, mb)
            except Exception as e:  # nothing of the step has run yet: train as without the audit
                reason = f"riding along could not be prepared: {type(e).__name__}: {e}"
        if reason is not None:
            self._lens_drop_rides()
            self._lens_ride_result = (step, reason)
        self._lens_in_loss = True
        try:
            if self._lens_ride is None:
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            return self._lens_ride_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._lens_in_loss = False

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._lens_ride_finish()

    # --- riding on TRL's own forward and backward ----------------------------------------------------

    def _lens_ride_decision(self) -> tuple[Optional["LensTRLCallback"], Optional[str]]:
        """The callback whose audit rides on this micro-batch's backward, or the reason it cannot (None: no audit)."""
        cbs = [c for c in self.callback_handler.callbacks if isinstance(c, LensTRLCallback) and c.trainer is self]
        if not cbs:
            return None, None
        cb = cbs[0]
        step = int(self.state.global_step)
        if step % cb.every_n_steps != 0 or self.lens_setup_refusal() is not None:
            return None, None
        if not cb.ride_along:
            return None, "capture='separate'"
        if cb._ride_structural is not None:
            return None, cb._ride_structural  # found at an earlier step; the model's layers have not changed
        done = self._lens_ride_result
        if done is not None and done[0] == step:
            return None, done[1] if isinstance(done[1], str) else "an earlier micro-batch of this step did not ride"
        if len(self._lens_rides) != len(self._lens_micro) - 1:
            return None, "a micro-batch of this step was trained before the audit began riding along"
        if int(self.accelerator.num_processes) > 1:
            return (
                None,
                f"{int(self.accelerator.num_processes)} processes: the global reading combines the ranks' separate passes",
            )
        head = self._lens_trained_head()
        if head is not None:
            # known before the forward: spares the first step a capture that could not be read
            refused = fused_head_refusal(head.weight.device)
            if refused is not None:
                return None, refused
        if cb.engine not in (None, "auto", "ghost"):
            return None, f"engine={cb.engine!r} asks for the separate pass"
        if self.args.bf16 or self.args.fp16:
            return (
                None,
                "mixed precision: the separate pass reads in the callback's dtype, the training step in its autocast dtypes",
            )
        dtypes = {p.dtype for p in self.model.parameters() if p.requires_grad}
        want = {"float32": torch.float32, "float64": torch.float64}.get(cb.dtype)
        if want is not None and dtypes != {want}:
            return (
                None,
                f"the trained parameters are {sorted(str(d) for d in dtypes)} and the audit's dtype is {cb.dtype!r}",
            )
        return cb, None

    def _lens_trained_head(self) -> Optional[torch.nn.Module]:
        """The policy's LM head when its weight is trained (TRL's fused head then reads it outside the layer)."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        return head if isinstance(weight, torch.Tensor) and weight.requires_grad else None

    def _lens_ride_prepare(self, cb: "LensTRLCallback", mb: MicroBatch) -> "_Ride":
        spec = resolve_partition(cb.partition)
        forward = self._get_per_token_logps_and_entropies  # what TRL's loss calls (its profiling included)
        ride = _Ride(
            cb=cb,
            mb=mb,
            step=int(self.state.global_step),
            forward=forward,
            partition_fn=lambda t: apply_partition(spec, t),
            keep_grads=cb.conservation,
        )
        ride.rider = RideAlong(_RideModule(self.model, lambda args, kwargs: self._lens_ride_terms(ride, args, kwargs)))
        return ride

    def _lens_ride_terms(self, ride: "_Ride", args: tuple, kwargs: dict) -> CreditTerms:
        """TRL's forward, captured by the rider's hooks, and the micro-batch's terms over copies of its outputs.

        TRL's loss is taken, and backpropagated, on the forward's own outputs: the training step is TRL's alone.
        The terms are a function of detached copies of those outputs; after the backward, their gradient there
        is held against the one TRL's loss sent into the forward (recorded by hooks that return nothing).
        """
        logps, entropies, aux = ride.forward(*args, **kwargs)  # [B, T], [B, T]
        # a trained head's use is recorded by the fused-head extension the rider's capture installed
        ride.heads = head_captures(ride.rider.cap)
        ride.returned = (logps, entropies, aux)
        outs = [x for x in (logps, entropies) if x is not None and x.requires_grad]
        mine = tuple(x.detach().requires_grad_(True) for x in outs)
        for i, x in enumerate(outs):
            x.register_hook(_trl_grad_hook(weakref.ref(ride), i))  # weak: the graph would keep the ride alive
        given = dict(zip([id(x) for x in outs], mine))
        self._lens_given_forward = (
            given.get(id(logps), logps.detach()),
            None if entropies is None else given.get(id(entropies), entropies.detach()),
        )
        try:
            terms, trained, tokens = self._lens_micro_terms(ride.mb)  # [B, T] each
        finally:
            self._lens_given_forward = None
        ride.mine, ride.terms = mine, terms
        inputs = ride.mb.inputs
        return CreditTerms(
            terms,
            trained,
            inputs["lens_rollout"].long(),
            inputs["lens_group"].long(),
            rewards=inputs.get("lens_reward"),
            tokens=tokens,
        )

    def _lens_ride_loss(self, model, inputs, return_outputs, num_items_in_batch):  # type: ignore[no-untyped-def]
        ride = self._lens_ride
        assert ride is not None
        rider = ride.rider.start()

        def forward(*args: Any, **kwargs: Any) -> Any:
            if ride.returned is not None:  # a second forward in one loss is outside the contract: plain, and noted
                ride.extra_forwards += 1
                return ride.forward(*args, **kwargs)
            try:
                rider.module.credit_terms(args, kwargs)
            except Exception as e:  # the adapter's terms failed: TRL's forward still runs, plainly
                ride.error = f"{type(e).__name__}: {e}"
            return ride.returned if ride.returned is not None else ride.forward(*args, **kwargs)

        self._get_per_token_logps_and_entropies = forward  # TRL's loss calls it once per micro-batch
        try:
            loss = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        finally:
            del self._get_per_token_logps_and_entropies
        if isinstance(loss, torch.Tensor):
            try:
                if ride.mb.accumulation == 1:  # reduced inside this backward, against its gradient
                    rider.on_loss(loss, ride.partition_fn, readings=ride.readings, keep_grads=ride.keep_grads)
                else:  # only captured: read with the step's other micro-batches after the last backward
                    rider.on_loss(loss)
            except Exception as e:  # never raised into the training step
                ride.error = ride.error or f"{type(e).__name__}: {e}"
        return loss

    def _lens_ride_finish(self) -> None:
        ride, self._lens_ride = self._lens_ride, None
        if ride is None:
            return
        rider = ride.rider
        result: Optional[Union[CreditReport, str]] = None
        kept = False
        try:
            if ride.mb.accumulation == 1:
                result = self._lens_ride_read(ride)
            else:
                rider.stop()  # its hooks off before the next micro-batch's forward; its captures kept
                result = self._lens_ride_check(ride)
                if result is None:
                    self._lens_rides.append(ride)
                    kept = True
                    if len(self._lens_rides) == ride.mb.accumulation:  # the last backward: .grad is the step's
                        result = self._lens_ride_read_accumulated()
        except Exception as e:
            result = f"the ride-along reading failed: {type(e).__name__}: {e}"
        finally:
            if not kept:
                rider.clear()
        if result is None:
            return  # captured; read after the step's last micro-batch
        self._lens_drop_rides()
        if isinstance(result, str) and "outside the layers the hooks cover" in result:
            ride.cb._ride_structural = result  # the same on every step: later steps take the separate pass at once
        self._lens_ride_result = (ride.step, result)

    def _lens_drop_rides(self) -> None:
        """Let the kept micro-batches' captures go."""
        rides, self._lens_rides = self._lens_rides, []
        for r in rides:
            r.rider.clear()

    def _lens_ride_read_accumulated(self) -> Union[CreditReport, str]:
        """The step read once from every micro-batch's captures, against the accumulated (not yet clipped) ``.grad``."""
        rides = self._lens_rides
        first = rides[0]
        return report_accumulated(
            [r.rider for r in rides],
            first.partition_fn,
            partition_name=partition_label(first.cb.partition),
            readings=first.readings,
            keep_grads=first.keep_grads,
        )

    def _lens_ride_check(self, ride: "_Ride") -> Optional[str]:
        """Why this micro-batch's capture is not the terms' (None when it is): the adapter's terms sent the
        same gradient into the forward's outputs as TRL's loss."""
        if ride.error is not None:
            return f"the adapter's terms could not be formed in the training forward: {ride.error}"
        broken = next((h.error for h in ride.heads if h.error is not None), None)
        if broken is not None:
            return f"TRL's fused LM head could not be read: {broken}"
        if ride.extra_forwards or ride.terms is None:
            return f"TRL's loss ran its forward {1 + ride.extra_forwards if ride.terms is not None else 0} times; riding along needs one"
        if len(ride.trl_grads) != len(ride.mine):
            return "the training backward did not reach the forward's outputs"
        # The terms' gradient at the forward's outputs (this fires the rider's check that it is one on every term) ...
        mine = torch.autograd.grad(ride.terms.sum(), ride.mine, allow_unused=True)
        num = den = 0.0
        for i, g in enumerate(mine):
            trl = ride.trl_grads[i].double()
            g = torch.zeros_like(trl) if g is None else g.double()
            num += float(torch.sum((g - trl) ** 2))
            den += float(torch.sum(trl**2))
        gap = math.sqrt(num / den) if den > 0 else math.sqrt(num)
        # ... against the gradient TRL's loss sent there: equal, the per-row pieces the hooks saw are the terms' parts.
        if not gap <= _tolerance(ride.terms.dtype):
            return (
                f"the adapter's terms' gradient differs from TRL's loss gradient by {gap:.3e} (relative) at the "
                "log-probabilities: the re-derived terms are not the loss TRL trained on"
            )
        ride.gap = gap
        return None

    def _lens_ride_read(self, ride: "_Ride") -> Union[CreditReport, str]:
        broken = self._lens_ride_check(ride)
        if broken is not None:
            return broken
        return ride.rider.report(
            ride.partition_fn,
            partition_name=partition_label(ride.cb.partition),
            readings=ride.readings,
            keep_grads=ride.keep_grads,
        )

    def lens_ride_result(self) -> Optional[Union[CreditReport, str]]:
        """This step's reading from riding along, the reason it did not ride, or None (no audit this step)."""
        r = self._lens_ride_result
        return r[1] if r is not None and r[0] == int(self.state.global_step) else None

    def get_high_entropy_mask(self, entropies, mask, threshold):  # type: ignore[no-untyped-def]
        out = super().get_high_entropy_mask(entropies, mask, threshold)
        if self._lens_in_loss and self._lens_micro:
            self._lens_micro[-1].entropy_mask = out.detach()  # [B, T]
        return out

    def _clip_grad_norm(self, model):  # type: ignore[no-untyped-def]
        total = super()._clip_grad_norm(model)
        if isinstance(total, torch.Tensor):
            self._lens_clip = (int(self.state.global_step), total.detach().clone(), float(self.args.max_grad_norm))
        return total

    # --- what the callback reads ---------------------------------------------------------------------

    def lens_micro_batches(self) -> list[MicroBatch]:
        """The micro-batches of the step now being taken (empty before the first loss of the step)."""
        return list(self._lens_micro) if self._lens_micro_step == int(self.state.global_step) else []

    def lens_clip_coefficient(self) -> Union[float, torch.Tensor, None]:
        r"""The factor clipping multiplied ``.grad`` by this step; 1.0 without clipping; None if not recorded.

        Computed as torch's ``clip_grad_norm_`` does: ``min(max_norm / (‖g‖ + 1e-6), 1)`` in the norm's dtype.
        """
        max_norm = float(self.args.max_grad_norm or 0.0)
        if max_norm <= 0:
            return 1.0
        if self._lens_clip is None or self._lens_clip[0] != int(self.state.global_step):
            return None
        _, total, max_norm = self._lens_clip
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)

    def lens_setup_refusal(self) -> Optional[Refusal]:
        """A :class:`Refusal` naming the first configuration the audit cannot read exactly; None if it can."""
        loss_type = self.lens_loss_type or self.loss_type
        if loss_type not in LOSS_TYPES:
            return Refusal(
                "loss_type",
                f"`loss_type` must be one of {list(LOSS_TYPES)} for the audit, got {loss_type!r}.",
                numbers={},
                remedy="use a loss type trl 1.16 ships; the adapter re-derives each one's per-token terms.",
            )
        if getattr(self, "aux_loss_enabled", False):
            return Refusal(
                "moe_aux_loss",
                "the MoE load-balancing loss (router_aux_loss_coef != 0) has no position in the completion, so it "
                "cannot be split into per-token terms; an audit without it would not add up to .grad.",
                numbers={"router_aux_loss_coef": float(getattr(self, "router_aux_loss_coef", float("nan")))},
                remedy="audit with router_aux_loss_coef=0 (or output_router_logits=False in the model config).",
            )
        if getattr(self, "use_vllm", False):
            return Refusal(
                "vllm",
                "generation with vLLM (use_vllm=True) brings sampler log-probs and an importance-sampling "
                "correction into the loss, which this adapter has not been tested against.",
                numbers={
                    "vllm_importance_sampling_correction": int(
                        bool(getattr(self, "vllm_importance_sampling_correction", False))
                    )
                },
                remedy="audit a run that generates with transformers (use_vllm=False).",
            )
        proc = getattr(self, "processing_class", None)
        if proc is not None and hasattr(proc, "image_processor"):
            return Refusal(
                "multimodal",
                f"the processing class is a multimodal processor ({type(proc).__name__}); the adapter re-derives the "
                "text-only forward.",
                remedy="audit a text-only policy.",
            )
        kind = str(getattr(self.accelerator.distributed_type, "value", self.accelerator.distributed_type))
        if kind in _SHARDED_TYPES:
            return Refusal(
                "sharded",
                f"accelerate's distributed type is {kind}: parameters, gradients or optimizer state are split "
                "across processes, so no rank holds the whole averaged gradient the audit reads.",
                numbers={"num_processes": int(self.accelerator.num_processes)},
                remedy="audit a data-parallel run (DDP: accelerate's MULTI_GPU / MULTI_CPU), or a single process.",
            )
        if int(self.accelerator.num_processes) > 1 and not _dist_ready():
            return Refusal(
                "distributed",
                f"{int(self.accelerator.num_processes)} processes but no torch.distributed process group, so the "
                "ranks' readings cannot be combined.",
                numbers={"num_processes": int(self.accelerator.num_processes)},
                remedy="launch with accelerate launch or torchrun, which set up the default process group.",
            )
        return None

    def lens_step_refusal(self, micro: Sequence[MicroBatch]) -> Optional[Refusal]:
        """A :class:`Refusal` for a step whose inputs the audit cannot read; None if it can."""
        if not micro:
            return Refusal(
                "no_micro_batches", "no micro-batch of this step was captured, so there is nothing to audit."
            )
        for i, mb in enumerate(micro):
            present = [k for k in _MULTIMODAL_KEYS if mb.inputs.get(k) is not None]
            if present:
                return Refusal(
                    "multimodal",
                    f"micro-batch {i} carries multimodal inputs {present}; the adapter re-derives the text-only forward.",
                    numbers={"micro_batch": i},
                )
            if mb.inputs.get("importance_sampling_ratio") is not None:
                return Refusal(
                    "vllm_importance_sampling",
                    f"micro-batch {i} carries a vLLM importance-sampling ratio, which this adapter has not been tested against.",
                    numbers={"micro_batch": i},
                )
            if mb.inputs.get("lens_rollout") is None:
                return Refusal(
                    "no_rollout_ids",
                    f"micro-batch {i} was generated without rollout ids (the mixin must wrap the trainer that generated it).",
                    numbers={"micro_batch": i},
                )
        accum = int(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps))
        if len(micro) != accum:
            return Refusal(
                "micro_batches",
                f"the step accumulated {accum} micro-batches but {len(micro)} were captured; the audit would not "
                "see the gradient the optimizer receives.",
                numbers={"captured": len(micro), "accumulation": accum},
            )
        return None

    # --- the terms -----------------------------------------------------------------------------------

    def credit_terms(self, batch: Optional[Sequence[MicroBatch]] = None) -> CreditTerms:
        r"""The step's per-token objective terms: their sum over all micro-batches is the loss TRL backpropagates.

        Each micro-batch is re-scored with TRL's ``_get_per_token_logps_and_entropies`` on ``self.model``
        (under ``functional_call`` in an audit, so on the audit's parameter copies) and its terms are padded to
        the step's longest completion; rows are stacked in the order the micro-batches were trained.

        Args:
            batch: the micro-batches (default: those of the step now being taken).
        """
        micro = self.lens_micro_batches() if batch is None else list(batch)
        if not micro:
            raise ValueError("`batch` must hold at least one micro-batch, got none; call during a training step.")
        parts, r0 = [], 0
        for mb in micro:
            n = int(mb.inputs["completion_ids"].shape[0])
            # rows r0:r0+n of the stacked terms: the one-pass engine reads the micro-batches' layer calls as one batch
            with batch_rows(r0, r0 + n):
                parts.append(self._lens_micro_terms(mb))
            r0 += n
        T = max(p[0].size(1) for p in parts)

        def pad(x: torch.Tensor, value: Any = 0) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, T - x.size(1)), value=value)

        terms = torch.cat([pad(p[0]) for p in parts])  # [B, T]
        trained = torch.cat([pad(p[1], False) for p in parts])  # [B, T]
        tokens = torch.cat([pad(p[2]) for p in parts])  # [B, T]
        rollout = torch.cat([mb.inputs["lens_rollout"] for mb in micro]).long()  # [B]
        group = torch.cat([mb.inputs["lens_group"] for mb in micro]).long()  # [B]
        rewards = None
        if all(mb.inputs.get("lens_reward") is not None for mb in micro):
            rewards = torch.cat([mb.inputs["lens_reward"] for mb in micro])  # [B]
        return CreditTerms(terms, trained, rollout, group, rewards=rewards, tokens=tokens)

    def _lens_micro_terms(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(terms [B, T], trained [B, T], completion_ids [B, T])`` for one micro-batch, as ``_compute_loss`` has it."""
        inputs = mb.inputs
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + T]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B, P + T]
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # [B, T]

        if self._lens_given_forward is not None:
            per_token_logps, entropies = (
                self._lens_given_forward
            )  # [B, T], [B, T]: the training forward's, riding along
        else:
            # TRL's own forward, without its profiling wrapper (an audit is not a training forward).
            fn = type(self)._get_per_token_logps_and_entropies
            fn = getattr(fn, "__wrapped__", fn)
            per_token_logps, entropies, _ = fn(
                self,
                self.model,
                input_ids,
                attention_mask,
                logits_to_keep,
                compute_entropy=True,
                compute_aux_loss=False,
            )  # [B, T], [B, T]

        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            if mb.entropy_mask is not None:
                entropy_mask = mb.entropy_mask  # [B, T], the mask the loss applied
            elif int(self.accelerator.num_processes) > 1:
                # Recomputing it would run a collective on this rank alone.
                raise ValueError(
                    "the high-entropy mask of this micro-batch was not recorded, and recomputing it under several "
                    "processes needs every rank; let LensGRPOMixin wrap the trainer that computed the loss."
                )
            else:
                entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)  # [B, T]

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)  # [B, 1]
        old = inputs.get("old_per_token_logps")
        old = per_token_logps.detach() if old is None else old  # [B, T]

        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old)
            off_policy_mask = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )  # [B, 1]

        log_ratio = per_token_logps - old  # [B, T]
        if self.importance_sampling_level == "token":
            log_w = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
        else:
            raise ValueError(
                f"`importance_sampling_level` must be 'token' or 'sequence', got {self.importance_sampling_level!r}."
            )
        coef_1 = torch.exp(log_w)

        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]  # [B, T]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        loss_type = self.lens_loss_type or self.loss_type
        if loss_type == "cispo":
            per_token_loss = -torch.clamp(coef_1, max=self.epsilon_high).detach() * advantages * per_token_logps
        elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
            if self.args.delta is not None:
                coef_1 = torch.clamp(coef_1, max=self.args.delta)
            per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        elif loss_type == "sapo":
            temps = torch.where(advantages > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg)
            per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * advantages
        elif loss_type == "vespo":
            phi = self.get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=log_ratio,
                mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos,
                k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg,
            )  # [B, 1]
            per_token_loss = -phi * advantages * per_token_logps
        else:
            raise ValueError(f"`loss_type` must be one of {list(LOSS_TYPES)}, got {loss_type!r}.")

        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        B = completion_ids.size(0)
        accum = mb.accumulation
        masked = per_token_loss * mask  # [B, T] (a [B, 1] sequence-level loss broadcasts over the row)
        if loss_type in ("grpo", "sapo"):
            # mean over each row's tokens, then over rows
            terms = masked / mask.sum(-1, keepdim=True).clamp(min=1.0) / B / accum
        elif loss_type == "bnpo":
            terms = masked / mask.sum().clamp(min=1.0) / accum
        elif loss_type == "dr_grpo":
            terms = masked / (B * self.max_completion_length) / accum
        elif loss_type in ("cispo", "dapo", "vespo"):
            # num_items_in_batch spans the generation batch: TRL rescales it to one accumulation window.
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            normaliser = normaliser * accum / self.args.steps_per_generation
            terms = masked / normaliser
        else:  # luspo: sum over each row's tokens, then mean over rows
            terms = masked / B / accum

        if mb.entropy_coef != 0.0:
            eff = mask if entropy_mask is None else mask * entropy_mask  # [B, T]
            terms = terms - mb.entropy_coef * (entropies * eff) / eff.sum().clamp(min=1.0) / accum
        return terms, mask.bool(), completion_ids


def partition_label(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)


def _tolerance(dtype: torch.dtype) -> float:
    """Relative gap allowed between two roundings of one gradient in ``dtype``."""
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 1e-2)


class _RideModule(torch.nn.Module):
    """What :class:`RideAlong` sees: the policy's layers and parameters under their own names, and ``credit_terms``."""

    def __init__(self, model: torch.nn.Module, terms: Any) -> None:
        super().__init__()
        self.model = model
        self._terms = terms

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # the policy's names, no "model." prefix
        return self.model.named_parameters(*args, **kwargs)

    def credit_terms(self, *args: Any) -> CreditTerms:
        return self._terms(*args)


def _trl_grad_hook(ride: Any, i: int) -> Callable[[torch.Tensor], None]:
    """Keeps the gradient TRL's loss sent into output ``i`` on the ride ``ride()`` (a weak reference: a strong one
    would close a cycle through autograd's nodes, ``ride.returned`` holding the outputs, that outlives the step)."""

    def hook(g: torch.Tensor) -> None:
        r = ride()
        if r is not None:
            r.trl_grads[i] = g.detach()

    return hook


@dataclass
class _Ride:
    """One micro-batch's audit riding on TRL's forward and backward."""

    cb: Any
    mb: MicroBatch
    step: int
    forward: Any
    partition_fn: Any
    keep_grads: bool
    readings: str = "all"
    rider: Any = None
    returned: Optional[tuple] = None
    terms: Optional[torch.Tensor] = None
    mine: tuple = ()
    trl_grads: dict = field(default_factory=dict)
    extra_forwards: int = 0
    error: Optional[str] = None
    gap: Optional[float] = None
    heads: list = field(default_factory=list)  # the fused LM head's captures (see trl_fused_head)


def _unwrap_optimizer(optimizer: Any) -> Any:
    # accelerate's AcceleratedOptimizer holds the torch optimizer as `.optimizer`
    # (it subclasses torch.optim.Optimizer itself, so unwrap on the attribute, not on the type).
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    return inner


def trl_step_precondition(
    trainer: Any, optimizer: Any, *, clip_accounted: bool, micro_batches_seen: Optional[int]
) -> Union[tuple[bool, str], Refusal]:
    """Whether ``θ_after = θ_before − η·g`` holds for this TRL step, ``g`` being the gradient held against.

    Reads TRL's optimizer (unwrapped from accelerate's) and ``max_grad_norm``. Clipping is no break when the
    clip coefficient is applied to the held gradient (``clip_accounted``); accumulation is none when the held
    gradient covers every micro-batch of the step (``micro_batches_seen`` equal to the accumulation count).
    """
    max_norm = float(trainer.args.max_grad_norm or 0.0)
    accum = int(getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps))
    skipped = bool(getattr(trainer.accelerator, "optimizer_step_was_skipped", False))
    return exact_optimizer_precondition(
        _unwrap_optimizer(optimizer),
        gradient_clip_val=None if clip_accounted else (max_norm or None),
        accumulate_grad_batches=1 if micro_batches_seen == accum else accum,
        step_skipped=skipped,
    )


def _is_main(trainer: Any) -> bool:
    fn = getattr(trainer, "is_world_process_zero", None)
    return bool(fn()) if callable(fn) else True


_CONTROL_FLAGS = ("should_log", "should_evaluate", "should_save", "should_training_stop", "should_epoch_stop")


@dataclass
class _Pending:
    step: int
    params: list[torch.Tensor]
    names: list[Optional[str]]
    before: list[torch.Tensor]
    lrs: list[float]
    group_index: list[int]
    precondition: Union[tuple[bool, str], Refusal]
    held: Optional[list[Optional[torch.Tensor]]]  # None: hold against .grad at the optimizer step
    source: str
    parts_error: Optional[float] = None  # the audit's conservation_error, when `held` is its Σ g_S
    parts_dtype: Optional[torch.dtype] = None  # the coarsest dtype the parts were computed in


@dataclass
class _StepLog:
    values: dict[str, float] = field(default_factory=dict)


def _mixin_after(cls: type) -> Optional[type]:
    """The first trainer class ahead of :class:`LensGRPOMixin` in ``cls``'s MRO that defines a method the mixin overrides."""
    mro = cls.__mro__
    if LensGRPOMixin not in mro:
        return None
    own = {k for k, v in vars(LensGRPOMixin).items() if callable(v) and not k.startswith("__")}
    for base in mro[: mro.index(LensGRPOMixin)]:
        if issubclass(base, LensGRPOMixin):
            continue  # the user's own class (or another mixin built on this one) may override and call super()
        if issubclass(base, Trainer) and own & set(vars(base)):
            return base
    return None


class LensTRLCallback(TrainerCallback):
    """Audit a ``GRPOTrainer`` step at the optimizer step and log the readings through ``Trainer.log``.

    Needs the trainer to mix in :class:`LensGRPOMixin` (the mixin binds this callback to itself). Logged at
    the step the readings describe (the trainer's ``global_step`` after the update, as TRL's own loss):
    ``credit/...`` as :meth:`CreditReport.to_dict` writes them, ``conservation/...`` as
    :meth:`ConservationReading.to_dict` does, and ``credit/refused`` / ``conservation/refused`` = 1 with the
    refusal's numbers when a reading is declined (the reason goes to the ``lens_callbacks`` logger).

    Under several data-parallel processes the readings are those of the global step (part names
    ``r{rank}/...``; see :mod:`lens_callbacks.credit.readings.distributed`): the callback must be attached on every
    rank (it runs collectives at each audited step), every rank holds the same readings, and only the main
    process logs them.

    Args:
        partition: ``"by_rollout"`` (default), ``"by_group"``, or any partition ``disintegrate`` takes.
        every_n_steps: audit every n-th optimizer step.
        dtype: the audit's dtype (``"float32"`` default, ``"float64"``, ``"native"``).
        engine: ``"auto"`` (default: the one-pass engine for parts that are whole rows, the reference engine
            otherwise), ``"ghost"``, ``"jvp"`` or ``"reference"``, as in ``CreditAuditCallback``.
        conservation: also run the step-conservation check (refused unless the optimizer is plain SGD).
        tolerance: conservation tolerance for ``conservation/violated``.
        max_logged_parts: log per-part shares for the first this-many parts (None: all), as in
            ``CreditAuditCallback``. The report keeps every part.
        prefix: credit metric prefix. conservation_prefix: conservation metric prefix.
        capture: ``"training_step"`` (default): read the credit from TRL's own forward and backward (the
            one-pass engine's hooks on the training step, :class:`~lens_callbacks.credit.engines.ghost.RideAlong`)
            where that is exact: one process, no mixed precision, every trained parameter in a layer the hooks
            cover (a trained LM head, which TRL's fused head reads outside the layer, is recorded by the
            fused-head capture, except on a Triton device, where TRL scores only the labelled positions), and
            the adapter's terms sending the same gradient into the forward as TRL's loss (checked every
            micro-batch). With gradient accumulation the covered layers' captures of every micro-batch are kept
            to the step's end and read once after the last backward. Any other step, and every step with
            ``"separate"``, takes the separate pass; ``ride_reason`` says why, and ``credit/ride_along`` logs 1
            or 0.
        max_parts, ride_along: the old names of ``max_logged_parts`` and ``capture`` (``ride_along=False`` is
            ``capture="separate"``); deprecated, they warn.

    Example:
        >>> from trl import GRPOTrainer
        >>> from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback
        >>> class AuditedGRPOTrainer(LensGRPOMixin, GRPOTrainer):  # the mixin binds the callback to the trainer
        ...     pass
        >>> audit = LensTRLCallback("by_rollout", every_n_steps=10, conservation=False)
        >>> audit.every_n_steps
        10

    Then ``AuditedGRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=..., callbacks=[audit])``
    (a complete, runnable script: ``lens_callbacks/examples/trl_grpo.py``).
    """

    def __init__(
        self,
        partition: Any = "by_rollout",
        *,
        every_n_steps: int = 1,
        dtype: str = "float32",
        engine: Optional[str] = "auto",
        conservation: bool = True,
        tolerance: float = 1e-4,
        max_logged_parts: Optional[int] = 16,
        prefix: str = "credit/",
        conservation_prefix: str = "conservation/",
        capture: str = "training_step",
        max_parts: Optional[int] = None,
        ride_along: Optional[bool] = None,
    ) -> None:
        max_logged_parts = renamed("LensTRLCallback", "max_parts", "max_logged_parts", max_parts, max_logged_parts, 16)
        if ride_along is not None:
            ride = renamed("LensTRLCallback", "ride_along", "capture", ride_along, capture, "training_step")
            capture = "training_step" if ride else "separate"
        if capture not in ("separate", "training_step"):
            raise ValueError(
                f"`capture` must be 'training_step' (ride on TRL's step where exact) or 'separate', got {capture!r}."
            )
        engine = "auto" if engine is None else engine
        check_engine(engine, "all")
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(
                f"`every_n_steps` must be a positive int, got {every_n_steps!r}; e.g. 1 audits every step."
            )
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
            raise ValueError(f"`tolerance` must be a non-negative float, got {tolerance!r}; e.g. 1e-4.")
        if max_logged_parts is not None and (not isinstance(max_logged_parts, int) or max_logged_parts < 0):
            raise ValueError(f"`max_logged_parts` must be a non-negative int or None, got {max_logged_parts!r}.")
        for name, p in (("prefix", prefix), ("conservation_prefix", conservation_prefix)):
            if not isinstance(p, str):
                raise ValueError(f"`{name}` must be a str, got {p!r}; e.g. 'credit/'.")
        self.partition = partition
        self.every_n_steps = every_n_steps
        self.dtype = dtype
        self.engine = engine
        self.conservation = bool(conservation)
        self.tolerance = float(tolerance)
        self.max_logged_parts = max_logged_parts
        self.prefix = prefix
        self.conservation_prefix = conservation_prefix
        self.capture = capture
        self.ride_along = capture == "training_step"  # whether to try riding along
        #: Why the last audited step did not ride on TRL's backward (None: it did).
        self.ride_reason: Optional[str] = None
        self._ride_reasons_logged: set[str] = set()
        self._ride_structural: Optional[str] = None
        self.trainer: Any = None
        self.last_report: Union[CreditReport, Refusal, None] = None
        self.last_conservation: Union[ConservationReading, Refusal, None] = None
        #: ``(step, CreditReport | Refusal)`` per audited step, in order.
        self.history: list[tuple[int, Union[CreditReport, Refusal]]] = []
        #: ``(step, ConservationReading | Refusal)`` per audited step, in order.
        self.conservation_history: list[tuple[int, Union[ConservationReading, Refusal]]] = []
        self._pending: Optional[_Pending] = None
        self._log: Optional[_StepLog] = None
        self._said: set[str] = set()  # the causes already warned about: once each, not once per step
        #: The factor clipping multiplied ``.grad`` by at the last audited step (1.0: no clipping).
        self.last_clip_coef: Optional[float] = None

    def bind(self, trainer: Any) -> None:
        """Attach to the trainer whose steps to audit (the mixin does this)."""
        self.trainer = trainer

    # --- events --------------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        if tr is None or not isinstance(tr, LensGRPOMixin):
            log.warning(
                "LensTRLCallback: no trainer bound this callback, so nothing will be audited. The trainer must mix in "
                "LensGRPOMixin first in its bases: class AuditedGRPO(LensGRPOMixin, GRPOTrainer); with the bases in "
                "the other order (GRPOTrainer, LensGRPOMixin) the mixin never runs, and the order is wrong."
            )
            return
        ref = tr.lens_setup_refusal()
        if ref is not None and _is_main(tr):
            log.warning("LensTRLCallback: %s", ref.render())

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        step = int(state.global_step)
        self._pending, self._log = None, None
        if not isinstance(tr, LensGRPOMixin) or step % self.every_n_steps != 0:
            return
        self._log = _StepLog()
        report = self.audit()
        if isinstance(report, CreditReport):
            report = self._guarded(tr, report, step)
        self.last_report = report
        self.history.append((step, report))
        if isinstance(report, Refusal):
            self._log.values.update(report.to_dict(self.prefix))
            if _is_main(tr) and f"refused:{report.condition}" not in self._said:
                # Once per reason: every later step refused for it is in `history` and `credit/refused`.
                log.warning(
                    "LensTRLCallback step %d (later refusals for this reason are not repeated): %s",
                    step,
                    report.render(),
                )
            self._said.add(f"refused:{report.condition}")
        else:
            values = report.to_dict(self.prefix, max_parts=self.max_logged_parts)
            # The per-step names CreditAuditCallback logs beside the report's own.
            values[f"{self.prefix}cancelled_fraction"] = report.cancelled_fraction
            values[f"{self.prefix}conservation_error_max"] = report.conservation_error
            values[f"{self.prefix}undefined_fraction"] = 0.0 if report.ok else 1.0
            values[f"{self.prefix}refused"] = 0.0
            self._log.values.update(values)
            self._check_terms_are_loss(tr, report, step)
        if self.conservation:
            optimizer = kwargs.get("optimizer") or tr.optimizer
            self._pending = self._snapshot(tr, optimizer, step, report)

    def _grad_match_limit(self, tr: Any, report: CreditReport) -> float:
        args = getattr(tr, "args", None)
        auto = (
            torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
        )
        return grad_match_threshold(getattr(torch, str(report.dtype), None), auto)

    def _guarded(self, tr: Any, report: CreditReport, step: int) -> Union[CreditReport, Refusal]:
        """The report, or the Refusal that withholds it when its parts do not add up (``credit.guard``)."""
        gm = report.grad_match
        over = gm is not None and math.isfinite(gm) and gm > self._grad_match_limit(tr, report)
        model = getattr(tr, "model", None)
        accumulation = int(getattr(getattr(tr, "args", None), "gradient_accumulation_steps", 1) or 1)
        suspects = Suspects(bool(compiled_parts(model)) if model is not None else False, accumulation, over)
        return guard(report, suspects, step) or report

    def _check_terms_are_loss(self, tr: Any, report: CreditReport, step: int) -> None:
        """Say once, in words, when ``grad_match`` shows the re-derived terms are not the loss TRL trained."""
        gm = report.grad_match
        if gm is None or not math.isfinite(gm) or "terms_not_loss" in self._said:
            return
        limit = self._grad_match_limit(tr, report)
        if gm > limit:
            self._said.add("terms_not_loss")
            if _is_main(tr):
                log.warning("LensTRLCallback: %s", terms_not_loss_words(gm, limit, step))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pend, self._pending = self._pending, None
        if pend is None or self._log is None:
            return
        if isinstance(pend.precondition, Refusal):
            reading: Union[ConservationReading, Refusal] = pend.precondition
        else:
            held = pend.held if pend.held is not None else [p.grad for p in pend.params]
            reading = step_conservation(
                pend.before,
                [p.detach() for p in pend.params],
                pend.lrs,
                held,
                group_index=pend.group_index,
                precondition=pend.precondition,
                tolerance=self.tolerance,
                source=pend.source,
                step=pend.step,
                parts_error=pend.parts_error,
                parts_dtype=pend.parts_dtype,
            )
        if isinstance(reading, ConservationReading) and reading.violated and "violated" not in self._said:
            self._said.add("violated")
            if _is_main(self.trainer):
                log.warning("LensTRLCallback: %s", reading.explain())
        self.last_conservation = reading
        self.conservation_history.append((pend.step, reading))
        self._log.values.update(reading.to_dict(self.conservation_prefix))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry, self._log = self._log, None
        if entry is None or not entry.values or self.trainer is None:
            return
        if not _is_main(self.trainer):
            return  # every rank holds the same readings; the main process logs them once
        # The log event clears `should_log` (and a callback may touch the other flags): keep the trainer's own
        # decisions for this step, so its loss is still logged right after.
        controls = {id(c): c for c in (control, getattr(self.trainer, "control", None)) if c is not None}
        saved = {k: [getattr(c, f) for f in _CONTROL_FLAGS] for k, c in controls.items()}
        try:
            # Trainer.log, not GRPOTrainer.log: TRL's override would flush its own running metrics early.
            Trainer.log(self.trainer, {k: float(v) for k, v in entry.values.items()})
        except Exception as e:  # a logging failure never stops training
            log.warning("LensTRLCallback: logging failed: %s", e)
        finally:
            for k, c in controls.items():
                for f, v in zip(_CONTROL_FLAGS, saved[k]):
                    setattr(c, f, v)

    # --- the readings --------------------------------------------------------------------------------

    def audit(self) -> Union[CreditReport, Refusal]:
        """Disintegrate the step now being taken (call between the last backward and the optimizer step).

        Under several processes this is a collective call: every rank must make it on the same steps (the
        callback does), and every rank returns the same global reading.
        """
        tr = self.trainer
        ref = tr.lens_setup_refusal()
        if ref is not None:
            return ref  # decided by the configuration alone: the same on every rank, no collective skipped
        distributed = int(tr.accelerator.num_processes) > 1
        local, applied = self._audit_local(tr, distributed)
        if not distributed:
            return local
        failure = f"{local.condition}: {local.reason}" if isinstance(local, Refusal) else None
        report = local if isinstance(local, CreditReport) else None
        try:
            coll = _dist_collectives(tr.accelerator.device)
            # Collective on every rank, also one whose local audit failed (it passes None and the reason).
            return global_report(report, applied or [], coll, failure=failure, keep_grads=self.conservation)
        except Exception as e:  # past the agreement on who has a reading, every rank fails alike
            return Refusal("credit_audit_global", f"combining the ranks raised {type(e).__name__}: {e}", numbers={})

    def _audit_local(
        self, tr: Any, distributed: bool
    ) -> tuple[Union[CreditReport, Refusal], Optional[list[Optional[torch.Tensor]]]]:
        """This rank's reading and the un-clipped applied gradient it is projected onto (None before it is known)."""
        micro = tr.lens_micro_batches()
        ref = tr.lens_step_refusal(micro)
        if ref is not None:
            return ref, None
        coef = tr.lens_clip_coefficient()
        if coef is None:
            return Refusal(
                "clip_not_recorded",
                f"max_grad_norm = {tr.args.max_grad_norm} clips .grad before this event, and the clip coefficient "
                "was not recorded this step, so .grad cannot be compared with the audit.",
                numbers={"max_grad_norm": float(tr.args.max_grad_norm)},
            ), None
        self.last_clip_coef = float(coef)
        if self._log is not None:
            self._log.values[f"{self.prefix}clip_coef"] = self.last_clip_coef
        ride = tr.lens_ride_result()
        if isinstance(ride, CreditReport) and not distributed:
            self.ride_reason = None
            if self._log is not None:
                self._log.values[f"{self.prefix}ride_along"] = 1.0
            return ride, None
        self.ride_reason = ride if isinstance(ride, str) else "no ride-along reading was made this step"
        if self._log is not None:
            self._log.values[f"{self.prefix}ride_along"] = 0.0
        if self.ride_along and self.ride_reason not in self._ride_reasons_logged and _is_main(tr):
            self._ride_reasons_logged.add(self.ride_reason)
            log.info("LensTRLCallback: the audit takes a separate pass: %s", self.ride_reason)
        model = tr.model
        # .grad with the clip divided out: one rounding in the gradient's dtype, no copy when nothing was clipped.
        # Under DDP it is the rank average the optimizer applies, the same on every rank.
        applied: list[Optional[torch.Tensor]] = []
        reference: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            g = None
            if p.grad is not None:
                g = p.grad.detach()
                g = g / coef.to(g.device, g.dtype) if isinstance(coef, torch.Tensor) else g
                reference[name] = g
            applied.append(g)
        kwargs: dict[str, Any] = dict(dtype=self.dtype, terms_fn=lambda batch: tr.credit_terms(batch))
        if distributed:
            # Each rank's parts dotted with the averaged gradient; grad_match is read by global_report.
            kwargs.update(project_onto=applied, keep_grads=True)
        else:
            kwargs.update(reference_grads=reference, keep_grads=self.conservation)
        kwargs["engine"] = self.engine
        try:
            return disintegrate(model, micro, self.partition, **kwargs), applied
        except CreditTermsError as e:  # the re-derived terms break the contract: named by field, as the callbacks do
            return Refusal(f"credit_terms.{e.field}", f"{type(e).__name__}: {e}", numbers=dict(e.numbers)), applied
        except Exception as e:  # a reading that cannot be made never crashes the training run
            return Refusal("audit_failed", f"the audit raised {type(e).__name__}: {e}", numbers={}), applied

    def _snapshot(self, tr: Any, optimizer: Any, step: int, report: Union[CreditReport, Refusal]) -> _Pending:
        opt = _unwrap_optimizer(optimizer)
        names_of = {id(p): n for n, p in tr.model.named_parameters()}
        params: list[torch.Tensor] = []
        group_index: list[int] = []
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                params.append(p)
                group_index.append(gi)
        names = [names_of.get(id(p)) for p in params]
        lrs = [float(g["lr"]) for g in opt.param_groups]
        held: Optional[list[Optional[torch.Tensor]]] = None
        source = "grad"
        coef = tr.lens_clip_coefficient()
        grads = getattr(report, "grads", None) if isinstance(report, CreditReport) and report.ok else None
        if grads is not None and coef is not None:
            by_name = dict(zip(grads.names, grads.parts_sum))
            held = []
            for p, n in zip(params, names):
                if n is not None and n in by_name:
                    g = by_name[n]
                    # scaled as clip_grad_norm_ scales .grad, in the gradient's dtype (the report keeps Σ g_S)
                    held.append(g * coef.to(g.device, g.dtype) if isinstance(coef, torch.Tensor) else g)
                elif p.grad is None:
                    held.append(None)
                else:
                    held, source = None, "grad"
                    break
            else:
                source = "credit_parts"
        # .grad already holds the clip and the whole accumulation window; the parts do once scaled by c.
        precondition = trl_step_precondition(
            tr, optimizer, clip_accounted=True, micro_batches_seen=int(tr.current_gradient_accumulation_steps)
        )
        before = [p.detach().clone() for p in params]
        parts_error, parts_dtype = None, None
        if source == "credit_parts":
            # The parts were computed under the trainer's autocast (bf16=True: bfloat16 matmuls): their own
            # rounding, the audit's conservation_error, joins the conservation floor.
            args = getattr(tr, "args", None)
            auto = (
                torch.bfloat16
                if getattr(args, "bf16", False)
                else torch.float16
                if getattr(args, "fp16", False)
                else None
            )
            own = getattr(torch, str(report.dtype), None)
            dtypes = [d for d in (auto, own) if isinstance(d, torch.dtype) and d in UNIT_ROUNDOFF]
            parts_error = report.conservation_error
            parts_dtype = max(dtypes, key=lambda d: UNIT_ROUNDOFF[d], default=None)
        return _Pending(
            step, params, names, before, lrs, group_index, precondition, held, source, parts_error, parts_dtype
        )
