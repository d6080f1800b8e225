r"""Credit toward a held-out probe objective, checked against the change the step really made.

A probe objective ``L_probe`` (held-out prompts with reference answers, a capability that must not
regress, a format the reward does not see) is a function of the parameters the step does not train on.
The optimizer moves the parameters by ``Δθ = θ_after − θ_before``; to first order the probe changes by
``⟨Δθ, g_probe⟩`` with ``g_probe = ∇θ L_probe(θ_before)``.

For the optimizers whose update is a known diagonal map of this step's gradient ``g`` (the applied
``.grad``) plus a carried term, ``Δθ = −D ⊙ g + c`` (:class:`UpdateMap`):

- ``torch.optim.SGD``: ``D = η`` (``η(1 − dampening)`` on a step with a momentum buffer, ``η(1 + μ(1 −
  dampening))`` with Nesterov), ``c`` = momentum of earlier steps and weight decay;
- ``torch.optim.Adam`` / ``AdamW``: ``D = η (1 − β1) / ((1 − β1^t) (√(v_t / (1 − β2^t)) + ε))``, with
  ``v_t`` the second moment after this step (read from the optimizer's state and this ``g``), ``c`` =
  the first moment of earlier steps through the same denominator, and weight decay (coupled for Adam,
  decoupled for AdamW).

Since ``g = Σ_S g_S`` over the parts of a partition, the probe's first-order change splits exactly:

.. math:: ⟨Δθ, g_{probe}⟩ = \sum_S c_S + ⟨c, g_{probe}⟩, \qquad c_S = −⟨D ⊙ g_S, g_{probe}⟩ = −⟨g_S, D ⊙ g_{probe}⟩.

The right-hand form is a disintegration projected onto ``v = D ⊙ g_probe``
(:func:`~lens_callbacks.credit.engine.disintegrate` with ``project_onto=v``): one pass of the engine
whatever the number of parts. After the step one more evaluation of the probe gives the actual change
``ΔL_probe = L_probe(θ_after) − L_probe(θ_before)``; ``first_order_gap = actual − predicted`` says how
far the first-order reading can be trusted this step (it grows with the step size and the curvature).

What this cannot do: ``c_S`` is a first-order statement about this step at these parameters. It is not a
counterfactual: removing a rollout changes the whole step (with Adam, the denominator too), so the
probe would not move by ``−c_S``. Any other optimizer, gradient clipping or accumulation is a
:class:`~lens_callbacks.refusal.Refusal`.

This module is pure torch: it never imports lightning.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ...refusal import Refusal
from ..engine import DTypeSpec, TermsCall, disintegrate, native_dtype, partition_label, resolve_dtype
from ..engines.ghost import SPLITS_ROWS, RideAlong
from ..engines.reductions import inner64, inners64
from ..inputs.partition import Partition, PartitionFn, resolve_partition
from ..inputs.terms import CreditTerms
from ..primitives import audit_passes, detached_state
from ..report import CreditReport
from .conservation import UNIT_ROUNDOFF, trainer_preconditions
from .derived import coarsening
from .step_readings import RecordingPartition

__all__ = [
    "UpdateMap",
    "PartInfo",
    "ProbeCreditReport",
    "optimizer_update_map",
    "probe_value_and_grad",
    "probe_credit",
    "with_actual",
    "combine_ranks",
    "KNOWN_OPTIMIZERS",
    "DEFAULT_SPLITS",
]

#: The optimizers whose update is read as ``−D ⊙ g + c`` (exact types; subclasses may step otherwise).
KNOWN_OPTIMIZERS = ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW")

#: The stable-name partitions the contributions are summed into (each read where its field is present).
DEFAULT_SPLITS = ("by_advantage_sign", "by_reward", "by_source")

_REMEDY = (
    "probe credit reads torch.optim.SGD (with or without momentum), torch.optim.Adam and torch.optim.AdamW "
    "with maximize=False, no gradient clipping and accumulate_grad_batches=1"
)

ProbeFn = Callable[[Any], Union[CreditTerms, torch.Tensor]]


# ---- the optimizer's update as a diagonal map of this step's gradient ------------------------------


@dataclass(frozen=True)
class UpdateMap:
    r"""The update one optimizer step applies, as ``Δθ = −D ⊙ g + carried``.

    Attributes:
        optimizer: the optimizer's class path.
        description: what was read (per group: kind, learning rate, momentum or betas, weight decay).
        coeff: ``D`` per trainable parameter (a 0-dim tensor where it is one number), aligned with the
            parameters handed to :func:`optimizer_update_map`; zero for a parameter the step leaves alone.
        carried: the part of ``Δθ`` that is not this step's gradient (momentum of earlier steps, weight
            decay), None where it is zero.
        Both are computed and kept in the parameter's dtype (at least float32), as the optimizer's step is.
    """

    optimizer: str
    description: str
    coeff: list[torch.Tensor] = field(repr=False)
    carried: list[Optional[torch.Tensor]] = field(repr=False)

    def predicted_update(self, grads: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        """``−D ⊙ g + carried`` per parameter (float64): the ``Δθ`` this map says the step applies."""
        out = []
        for d, c, g in zip(self.coeff, self.carried, grads):
            u = torch.zeros((), dtype=torch.float64) if g is None else -(d * g.detach().double())
            out.append(u if c is None else u + c)
        return out


def _class_path(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _f(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def optimizer_update_map(
    optimizer: Any,
    params: Sequence[torch.Tensor],
    grads: Optional[Sequence[Optional[torch.Tensor]]] = None,
    *,
    gradient_clip_val: Optional[float] = None,
    accumulate_grad_batches: int = 1,
    step_skipped: bool = False,
) -> Union[UpdateMap, Refusal]:
    """Read ``D`` and the carried term of the step ``optimizer`` is about to take, from its state.

    Call it before ``optimizer.step()`` with the gradient the step applies in ``.grad`` (or in
    ``grads``). Nothing is modified.

    Args:
        optimizer: a ``torch.optim`` optimizer (a wrapper with ``._optimizer`` is unwrapped).
        params: the parameters to map, in the order the readings use (e.g. the trainable parameters).
        grads: the gradient of each parameter (default: their ``.grad``); None entries are not stepped.
        gradient_clip_val, accumulate_grad_batches, step_skipped: the trainer's settings for the step.

    Returns:
        An :class:`UpdateMap`, or a :class:`Refusal` naming the optimizer or setting outside the known set.

    Example:
        >>> p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> p.grad = torch.tensor([0.5, 0.5])
        >>> m = optimizer_update_map(torch.optim.SGD([p], lr=0.1), [p])
        >>> [round(float(x), 6) for x in m.predicted_update([p.grad])[0]]
        [-0.05, -0.05]
        >>> optimizer_update_map(torch.optim.RMSprop([p]), [p]).condition
        'optimizer'
    """
    inner = getattr(optimizer, "_optimizer", None)
    opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    name = _class_path(opt)
    kind = type(opt)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return Refusal(
            "optimizer",
            f"`optimizer` must be one of {list(KNOWN_OPTIMIZERS)} for probe credit, got {name}: its update is not "
            "read as a diagonal map of this step's gradient plus a carried term.",
            numbers={"optimizer": name},
            remedy=_REMEDY,
        )
    refused = trainer_preconditions(
        "for probe credit", gradient_clip_val, accumulate_grad_batches, step_skipped, _REMEDY
    )
    if refused is not None:
        return refused
    grads = [p.grad for p in params] if grads is None else list(grads)
    if len(grads) != len(params):
        raise ValueError(f"`grads` must hold one entry per parameter ({len(params)}), got {len(grads)}.")
    where = {id(p): i for i, p in enumerate(params)}
    coeff: list[torch.Tensor] = [torch.zeros((), dtype=torch.float64) for _ in params]
    carried: list[Optional[torch.Tensor]] = [None for _ in params]
    lines = []
    for gi, group in enumerate(opt.param_groups):
        if group.get("maximize", False):
            return Refusal(
                "maximize",
                f"`maximize` must be False for probe credit, got True in param group {gi}.",
                numbers={"param_group": gi},
                remedy=_REMEDY,
            )
        lr = _f(group["lr"])
        wd = _f(group.get("weight_decay", 0.0))
        if kind is torch.optim.SGD:
            mom, damp, nest = (
                _f(group.get("momentum", 0.0)),
                _f(group.get("dampening", 0.0)),
                bool(group.get("nesterov", False)),
            )
            lines.append(
                f"group {gi}: SGD lr {lr:g}, momentum {mom:g}, dampening {damp:g}, nesterov {nest}, weight_decay {wd:g}"
            )
        else:
            b1, b2 = (_f(b) for b in group["betas"])
            eps, ams = _f(group["eps"]), bool(group.get("amsgrad", False))
            decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
            lines.append(
                f"group {gi}: {kind.__name__} lr {lr:g}, betas ({b1:g}, {b2:g}), eps {eps:g}, "
                f"weight_decay {wd:g} ({'decoupled' if decoupled else 'coupled'}), amsgrad {ams}"
            )
        for p in group["params"]:
            i = where.get(id(p))
            g = grads[i] if i is not None else p.grad
            if i is None or g is None:
                continue  # the step leaves a parameter without gradient alone; one outside `params` is not read
            if g.is_sparse:
                return Refusal(
                    "sparse_grad",
                    "a sparse gradient is not read by probe credit.",
                    numbers={"param_group": gi},
                    remedy="use dense gradients (e.g. nn.Embedding(sparse=False)).",
                )
            # In the parameter's precision (at least float32), as the optimizer computes its own step: a
            # float64 map of a float32 model would cost twice the memory and match the step no better.
            keep = torch.promote_types(p.dtype, torch.float32)
            theta = p.detach().to(keep)
            state = opt.state.get(p, {})
            if kind is torch.optim.SGD:
                coeff[i], carried[i] = _sgd_map(lr, wd, mom, damp, nest, theta, state.get("momentum_buffer"))
            else:
                coeff[i], carried[i] = _adam_map(lr, wd, b1, b2, eps, ams, decoupled, theta, g.detach().to(keep), state)
    return UpdateMap(name, "; ".join(lines), coeff, carried)


def _sgd_map(lr, wd, mom, damp, nest, theta, buf) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # torch: d = g + wd·θ; buf = d (first step) or μ·buf + (1 − τ)·d; step = d + μ·buf (Nesterov) or buf.
    one = torch.tensor(1.0, dtype=theta.dtype)
    if mom == 0:
        a, old = one, None  # Δθ = −η·d
    elif buf is None:
        a, old = one + (mom if nest else 0.0), None  # the buffer starts as d itself, undamped
    elif nest:
        a, old = one + mom * (1.0 - damp), buf.detach().to(theta.dtype) * (mom * mom)
    else:
        a, old = one * (1.0 - damp), buf.detach().to(theta.dtype) * mom
    d = lr * a
    carried = None
    if wd != 0:
        carried = -(d * wd) * theta
    if old is not None:
        carried = -lr * old if carried is None else carried - lr * old
    return d, carried


# Elements of one block of the optimizer's map (1 MB in float32: a block's five operands stay in cache).
_MAP_BLOCK = 1 << 18


def _adam_map(lr, wd, b1, b2, eps, ams, decoupled, theta, g, state) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # Two parameter-sized tensors are made (D and the carried term) and filled a block at a time, every
    # operation of a block done while it is in cache: a map of a real policy is memory-bound, and the same
    # operations over whole tensors read and write each of them a dozen times.
    step = _f(state["step"]) if "step" in state else 0.0
    t = step + 1.0
    m = state["exp_avg"].detach().to(theta.dtype).reshape(-1) if "exp_avg" in state else None
    v = state["exp_avg_sq"].detach().to(theta.dtype).reshape(-1) if "exp_avg_sq" in state else None
    vmax = state["max_exp_avg_sq"].detach().to(theta.dtype).reshape(-1) if ams and "max_exp_avg_sq" in state else None
    th, gr = theta.reshape(-1), g.reshape(-1)
    bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
    d = torch.empty_like(th)
    carried = None if m is None and wd == 0 else torch.empty_like(th)
    block = _MAP_BLOCK if th.device.type == "cpu" else max(1, th.numel())  # one block on a GPU: no launch per block
    for s in range(0, th.numel(), block):
        e = min(th.numel(), s + block)
        db = d[s:e]
        d_in = gr[s:e] if (decoupled or wd == 0) else gr[s:e] + wd * th[s:e]  # what the moments see
        # v_new = β2·v + (1 − β2)·d_in², in the block of D
        if v is None:
            torch.mul(d_in, d_in, out=db).mul_(1.0 - b2)
        else:
            torch.mul(v[s:e], b2, out=db).addcmul_(d_in, d_in, value=1.0 - b2)
        if vmax is not None:
            torch.maximum(vmax[s:e], db, out=db)
        # k = (lr / bc1) / (sqrt(v_new) / sqrt(bc2) + eps): Δθ = −k ⊙ m_new (+ decoupled decay),
        # m_new = β1·m + (1 − β1)·d_in
        db.sqrt_().div_(math.sqrt(bc2)).add_(eps).reciprocal_().mul_(lr / bc1)
        cb = None if carried is None else carried[s:e]
        if m is not None:
            torch.mul(db, m[s:e], out=cb).mul_(-b1)
        db.mul_(1.0 - b1)
        if wd != 0:
            decay = (lr * wd) * th[s:e] if decoupled else db * (wd * th[s:e])
            if m is None:
                torch.neg(decay, out=cb)
            else:
                cb.sub_(decay)
    return d.view_as(theta), None if carried is None else carried.view_as(theta)


# ---- the probe objective and its gradient -------------------------------------------------------


def rng_devices(module: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def _seeded(module: nn.Module, seed: Optional[int]) -> Iterator[None]:
    """Run under a forked random stream, seeded so that every evaluation of the probe draws alike."""
    with torch.random.fork_rng(devices=rng_devices(module)):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def _scalar_of(out: Any, where: str) -> torch.Tensor:
    if isinstance(out, CreditTerms):
        return out.terms.sum()
    if isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point():
        return out.reshape(())
    raise TypeError(
        f"{where} must return a CreditTerms or a scalar float tensor, got "
        f"{type(out).__name__}{list(out.shape) if isinstance(out, torch.Tensor) else ''}; return the probe loss."
    )


def probe_value_and_grad(
    module: nn.Module,
    probe: ProbeFn,
    batch: Any,
    *,
    dtype: DTypeSpec = "float32",
    grad: bool = True,
    seed: Optional[int] = 0,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    forward_context: Optional[Callable[[], Any]] = None,
) -> tuple[float, Optional[list[torch.Tensor]]]:
    """``L_probe`` at the module's parameters and (``grad=True``) ``∇θ L_probe``, one per trainable parameter.

    ``probe(batch)`` returns the probe loss (a scalar tensor) or ``CreditTerms`` (their sum is the loss). It
    runs on detached (optionally cast) copies of the parameters through ``torch.func.functional_call``, so
    the module's parameters, ``.grad`` and the global random stream are left as they were; with ``seed``
    every evaluation draws the same random numbers (the same dropout masks), so a value before and after a
    step differ by the parameters only.
    """
    _, leaves, state = detached_state(module, resolve_dtype(dtype), params, requires_grad=grad)
    with _seeded(module, seed), torch.set_grad_enabled(grad):
        with forward_context() if forward_context is not None else contextlib.nullcontext(), audit_passes():
            out = torch.func.functional_call(TermsCall(module, probe), state, (batch,), strict=False)
        loss = _scalar_of(out, "the probe objective")
        value = float(loss.detach())
        if not grad:
            return value, None
        if not loss.requires_grad:
            return value, [torch.zeros_like(x) for x in leaves]
        gs = torch.autograd.grad(loss, leaves, allow_unused=True)
    return value, [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(leaves, gs)]


# ---- the reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartInfo:
    """What a part is, for a table a person reads: its rows' group, reward, advantage and text (when one row)."""

    rows: int
    group: Optional[int] = None
    reward: Optional[float] = None
    advantage: Optional[float] = None
    text: Optional[str] = None


@dataclass(frozen=True)
class ProbeCreditReport:
    r"""Each part's first-order contribution to the change of a probe objective over one step.

    Attributes:
        probe: the probe's name.
        part_names: one name per part of the step's partition.
        contribution: ``c_S = −⟨D ⊙ g_S, g_probe⟩`` per part (negative: the part lowered the probe loss).
        carried: ``⟨carried, g_probe⟩``: momentum of earlier steps and weight decay.
        from_grad: ``⟨−D ⊙ g + carried, g_probe⟩`` with ``g`` the applied ``.grad``: the same prediction from the
            gradient the optimizer holds (the parts' sum must match it: ``parts_gap``).
        loss_before: ``L_probe(θ_before)``.
        alignment: ``cos(g, g_probe)``: ``> 0`` means a plain descent step on the training loss descends the
            probe loss too (to first order).
        grad_norm, probe_grad_norm: ``‖g‖``, ``‖g_probe‖``.
        optimizer: the optimizer's class path; dtype: the audit dtype; n_trained: trained positions.
        partition: the partition's name; engine: the engine that made the dots.
        splits: per stable-name partition ``(name, part names, contributions)``.
        part_info: one :class:`PartInfo` per part (empty when unknown).
        loss_after: ``L_probe(θ_after)``, once the step is taken (:func:`with_actual`).
        applied: ``⟨θ_after − θ_before, g_probe⟩``, once the step is taken (checks the update map).
        reason: why the contributions are undefined (None when defined).
        step: the optimizer step.
        ride_fallback: why a step captured riding on the training step was read by a pass of its own
            instead (None when it was not captured, or was read from its captures).
    """

    probe: str
    part_names: tuple[str, ...]
    contribution: tuple[float, ...]
    carried: float
    from_grad: float
    loss_before: float
    alignment: float
    grad_norm: float
    probe_grad_norm: float
    optimizer: str
    dtype: str
    n_trained: int
    partition: str = ""
    engine: str = ""
    splits: tuple[tuple[str, tuple[str, ...], tuple[float, ...]], ...] = ()
    part_info: tuple[PartInfo, ...] = ()
    loss_after: Optional[float] = None
    applied: Optional[float] = None
    reason: Optional[str] = None
    step: Optional[int] = None
    ride_fallback: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def n_parts(self) -> int:
        return len(self.part_names)

    @property
    def parts_sum(self) -> float:
        """``Σ_S c_S``."""
        return math.fsum(self.contribution)

    @property
    def predicted(self) -> float:
        """``Σ_S c_S + carried``: the first-order change of the probe loss over the step."""
        return self.parts_sum + self.carried

    @property
    def actual(self) -> float:
        """``L_probe(θ_after) − L_probe(θ_before)`` (NaN before the step is read)."""
        return float("nan") if self.loss_after is None else self.loss_after - self.loss_before

    @property
    def first_order_gap(self) -> float:
        """``actual − predicted``: the second- and higher-order change the contributions do not hold."""
        return self.actual - self.predicted

    @property
    def relative_gap(self) -> float:
        """``|actual − predicted| / |actual|``; NaN when the probe did not move."""
        a = self.actual
        return abs(self.first_order_gap) / abs(a) if a != 0 and math.isfinite(a) else float("nan")

    @property
    def actual_floor(self) -> float:
        """``u(dtype)·(|L_before| + |L_after|)``: the smallest change the two rounded losses resolve."""
        u = UNIT_ROUNDOFF.get(getattr(torch, self.dtype, torch.float32), 2.0**-24)
        return u * (abs(self.loss_before) + abs(self.loss_after if self.loss_after is not None else self.loss_before))

    @property
    def parts_gap(self) -> float:
        """``|predicted − from_grad| / |from_grad|``: the audit's parts against the applied gradient through ``D``."""
        return abs(self.predicted - self.from_grad) / abs(self.from_grad) if self.from_grad else float("nan")

    @property
    def update_match(self) -> float:
        """``|from_grad − applied| / |applied|``: the update map against the update the optimizer applied."""
        if self.applied is None or self.applied == 0:
            return float("nan")
        return abs(self.from_grad - self.applied) / abs(self.applied)

    def helped(self, k: int = 3) -> list[int]:
        """The ``k`` parts that lowered the probe loss most (most negative ``c_S``), best first."""
        order = sorted((i for i, c in enumerate(self.contribution) if c < 0), key=lambda i: self.contribution[i])
        return order[:k]

    def hurt(self, k: int = 3) -> list[int]:
        """The ``k`` parts that raised the probe loss most (largest positive ``c_S``), worst first."""
        order = sorted((i for i, c in enumerate(self.contribution) if c > 0), key=lambda i: -self.contribution[i])
        return order[:k]

    def split(self, partition: str) -> dict[str, float]:
        for name, names, values in self.splits:
            if name == partition:
                return dict(zip(names, values))
        raise KeyError(f"`partition` must be one of {[s[0] for s in self.splits]}, got {partition!r}.")

    def to_dict(self, prefix: Optional[str] = None) -> dict[str, float]:
        """Flat scalars for loggers (names in docs/metrics.md); ``prefix`` defaults to ``probe/<probe>/``."""
        p = f"probe/{self.probe}/" if prefix is None else prefix
        helped, hurt = self.helped(1), self.hurt(1)
        neg = math.fsum(c for c in self.contribution if c < 0)
        pos = math.fsum(c for c in self.contribution if c > 0)
        out = {
            f"{p}predicted": self.predicted,
            f"{p}parts_sum": self.parts_sum,
            f"{p}carried": self.carried,
            f"{p}actual": self.actual,
            f"{p}first_order_gap": self.first_order_gap,
            f"{p}relative_gap": self.relative_gap,
            f"{p}actual_floor": self.actual_floor,
            f"{p}alignment": self.alignment,
            f"{p}loss_before": self.loss_before,
            f"{p}parts_gap": self.parts_gap,
            f"{p}update_match": self.update_match,
            f"{p}helped_sum": neg,
            f"{p}hurt_sum": pos,
            f"{p}top_helped": self.contribution[helped[0]] if helped else 0.0,
            f"{p}top_hurt": self.contribution[hurt[0]] if hurt else 0.0,
            f"{p}n_parts": float(self.n_parts),
            f"{p}undefined": 0.0 if self.ok else 1.0,
            f"{p}refused": 0.0,
        }
        for name, names, values in self.splits:
            for n, v in zip(names, values):
                out[f"{p}split/{name}/{n}"] = float(v)
        return {k: float(v) for k, v in out.items()}

    def render(self, top_k: int = 5, max_text: int = 60) -> str:
        """A readable account: the prediction against the real change, the parts that helped and hurt, the splits."""
        where = f" at step {self.step}" if self.step is not None else ""
        lines = [
            f"probe '{self.probe}'{where}: {self.n_parts} parts by {self.partition or 'partition'}, {self.n_trained} "
            f"trained positions, {self.dtype}, {self.optimizer}",
            f"  predicted ΔL_probe  {self.predicted:+.6e}  (Σ_S c_S {self.parts_sum:+.6e} + carried {self.carried:+.6e})",
        ]
        if self.loss_after is not None:
            lines.append(
                f"  actual ΔL_probe     {self.actual:+.6e}  (L_probe {self.loss_before:.6g} → {self.loss_after:.6g})"
            )
            lines.append(
                f"  first_order_gap     {self.first_order_gap:+.6e}  (relative {self.relative_gap:.3e}; the losses resolve "
                f"changes above {self.actual_floor:.1e})"
            )
        lines.append(
            f"  cos(g, g_probe)     {self.alignment:+.4f}   parts vs applied .grad through D: {self.parts_gap:.2e}"
        )
        if self.applied is not None:
            lines.append(f"  update map vs the applied update: {self.update_match:.2e}")
        if self.reason:
            lines.append(f"  UNDEFINED: {self.reason}")
        for title, idx in (
            ("helped (lowered the probe loss)", self.helped(top_k)),
            ("hurt (raised it)", self.hurt(top_k)),
        ):
            lines.append(f"  {title}:")
            if not idx:
                lines.append("    none")
            for i in idx:
                lines.append(f"    {self.part_names[i]:<14} c_S {self.contribution[i]:+.4e}{self._info(i, max_text)}")
        for name, names, values in self.splits:
            lines.append(f"  by {name}: " + ", ".join(f"{n} {v:+.4e}" for n, v in zip(names, values)))
        return "\n".join(lines)

    def _info(self, i: int, max_text: int) -> str:
        if i >= len(self.part_info):
            return ""
        info = self.part_info[i]
        bits = []
        if info.group is not None:
            bits.append(f"group {info.group}")
        if info.reward is not None:
            bits.append(f"reward {info.reward:g}")
        if info.advantage is not None:
            bits.append(f"advantage {info.advantage:+.3f}")
        if info.text is not None:
            t = info.text.replace("\n", " ")
            bits.append(repr(t if len(t) <= max_text else t[: max_text - 1] + "…"))
        return ("  " + ", ".join(bits)) if bits else ""


def _dot64(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """``<a, b>`` over parameter lists: products in the tensors' dtype, blocks summed in float64 (:func:`inner64`)."""
    return _sum64(inner64(x.detach(), y.detach().to(x.dtype)) for x, y in zip(a, b))


def _sum64(xs: Any) -> float:
    """The sum of float64 0-d tensors, read back once (0.0 for none)."""
    xs = [x.cpu() for x in xs]
    return float(torch.stack(xs).sum()) if xs else 0.0


def _part_info(
    terms: Optional[CreditTerms], part: Optional[Partition], texts: Optional[Sequence[Optional[str]]]
) -> tuple[PartInfo, ...]:
    if terms is None or part is None:
        return ()
    ids = part.ids.cpu()  # [B, T]
    out = []
    for i in range(part.n_parts):
        rows = torch.nonzero((ids == i).any(dim=1)).reshape(-1).tolist()
        if len(rows) != 1:
            out.append(PartInfo(len(rows)))
            continue
        k = rows[0]
        out.append(
            PartInfo(
                1,
                group=int(terms.group[k]),
                reward=None if terms.rewards is None else float(terms.rewards[k]),
                advantage=None if terms.advantages is None else float(terms.advantages[k]),
                text=None if texts is None or k >= len(texts) else texts[k],
            )
        )
    return tuple(out)


def _splits(
    terms: Optional[CreditTerms], part: Optional[Partition], contribution: Sequence[float], split_by: Sequence[Any]
):
    """Sum the contributions into every stable-name partition whose parts are unions of the step's parts."""
    if terms is None or part is None:
        return ()
    out = []
    for spec in split_by:
        name = spec if isinstance(spec, str) else getattr(spec, "__name__", "custom")
        try:
            coarse = resolve_partition(spec)
            coarse = coarse if isinstance(coarse, Partition) else coarse(terms)
        except ValueError:
            continue  # the terms lack the field this partition reads (advantages, rewards, source)
        mapping = coarsening(part, coarse)
        if mapping is None:
            continue  # a part straddles two of its parts: not a sum of contributions
        acc: list[list[float]] = [[] for _ in range(coarse.n_parts)]
        for c, j in zip(contribution, mapping):
            if j >= 0:
                acc[j].append(c)
        out.append((name, tuple(coarse.names), tuple(math.fsum(a) for a in acc)))
    return tuple(out)


def probe_credit(
    module: nn.Module,
    batch: Any,
    partition: Union[str, PartitionFn, Partition],
    update: UpdateMap,
    probe_grad: Sequence[torch.Tensor],
    *,
    probe: str = "probe",
    loss_before: float = float("nan"),
    applied_grad: Optional[Sequence[Optional[torch.Tensor]]] = None,
    dtype: DTypeSpec = "float32",
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    forward_context: Optional[Callable[[], Any]] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    engine: str = "auto",
    split_by: Sequence[Any] = DEFAULT_SPLITS,
    texts: Optional[Sequence[Optional[str]]] = None,
    scale: float = 1.0,
    step: Optional[int] = None,
    use_grad: bool = True,
    ride: Optional[RideAlong] = None,
) -> ProbeCreditReport:
    r"""Each part's first-order contribution ``c_S = −⟨D ⊙ g_S, g_probe⟩`` to the change of a probe objective.

    One disintegration of the step's ``credit_terms`` projected onto ``v = D ⊙ g_probe`` gives every
    ``⟨g_S, v⟩`` (the one-pass engine for row partitions: one forward and one backward); ``c_S =
    −scale·⟨g_S, v⟩``. The carried term and ``from_grad`` are read from ``update`` and ``applied_grad``.

    Args:
        module: implements ``credit_terms(batch)``. batch: the step's batch. partition: as in ``disintegrate``.
        update: :func:`optimizer_update_map` of the step, aligned with the trainable parameters.
        probe_grad: ``∇θ L_probe`` per trainable parameter (:func:`probe_value_and_grad`).
        probe: the probe's name. loss_before: ``L_probe(θ_before)``.
        applied_grad: the gradient the optimizer applies (default: the parameters' ``.grad``).
        dtype, terms_fn, forward_context, params, engine: as in ``disintegrate``.
        split_by: stable-name partitions the contributions are summed into (skipped where not readable).
        texts: one text per row of the batch, for the table.
        scale: multiplies the parts (``1/W`` for one rank's batch of a ``W``-rank data-parallel step); the
            carried term and ``from_grad`` are whole-step values (from the applied gradient) and are not scaled.
        step: the optimizer step, for the report.
        use_grad: with ``scale`` 1, ``params`` None and every ``applied_grad`` present, take it as the batch's
            ``g_full`` (the engine's tangent pass alone); False: the engine's own forward and backward.
        ride: a :class:`~lens_callbacks.credit.engines.ghost.RideAlong` that captured this step's training
            forward and backward (``on_loss`` without a partition): the parts are read from its captures
            against ``v``, with no forward or backward of their own. Where it cannot be read (its contract broken,
            parts inside rows) the step is read by the engine as without it (parts inside rows: the forward-mode
            tangent pass along ``.grad``), and :attr:`ProbeCreditReport.ride_fallback` says why.
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    for name, xs in (("probe_grad", probe_grad), ("update.coeff", update.coeff)):
        if len(xs) != len(trainable):
            raise ValueError(f"`{name}` must hold one entry per trainable parameter ({len(trainable)}), got {len(xs)}.")
    target = resolve_dtype(dtype) or native_dtype(module)
    for gp, p in zip(probe_grad, trainable):
        if tuple(gp.shape) != tuple(p.shape):
            raise ValueError(
                f"`probe_grad` entries must match their parameter's shape {list(p.shape)}, got {list(gp.shape)}."
            )
    # v = D ⊙ g_probe in the audit's dtype (D is kept in the parameter's own precision, as the optimizer steps)
    onto = [
        (d.to(target) * gp.detach().to(target)).expand(p.shape) for d, gp, p in zip(update.coeff, probe_grad, trainable)
    ]
    spec = resolve_partition(partition)
    name = partition_label(partition)
    recorder = RecordingPartition(spec, name)
    applied = [p.grad for p in trainable] if applied_grad is None else list(applied_grad)
    # The step's own gradient is g_full when this batch's gradient is what the optimizer applies (one process,
    # `scale` 1): the engine then takes no forward and backward of its own (the forward-mode engine: its
    # tangent pass along v alone; the one-pass engine: a backward to the layers' outputs).
    given = (
        applied
        if (
            use_grad
            and engine != "reference"
            and scale == 1.0
            and params is None
            and all(g is not None for g in applied)
        )
        else None
    )
    rep: Union[CreditReport, str, None] = None
    ride_fallback = None
    if ride is not None:
        # checked along v: the readings are dots with v, and no parts' sum Σ_S g_S need be formed
        rep = ride.report(recorder, partition_name=name, readings="projected", project_onto=onto, along=True)
        if isinstance(rep, str):
            # Parts inside rows with `.grad` as g_full: the forward-mode engine's tangent pass alone reads them.
            ride_fallback = None if rep.startswith(SPLITS_ROWS) and given is not None else rep
            rep = None
    if rep is None:
        rep = disintegrate(
            module,
            batch,
            recorder,
            dtype=dtype,
            terms_fn=terms_fn,
            forward_context=forward_context,
            params=params,
            project_onto=onto,
            engine=engine,
            readings="projected",
            full_grad=given,
            along=True,  # the readings are dots with v: the parts' sum is checked along v, never formed
        )
    terms, part = recorder.take()
    # ‖v‖², <v, g> and ‖g‖² the riding reading took already (its g_full is `.grad`, the applied gradient)
    along = ride.last_along if ride is not None and ride_fallback is None and applied_grad is None else None
    if along is not None and any(g is not None and g.dtype != v.dtype for g, v in zip(applied, onto)):
        along = None  # its ‖g‖² took products in `.grad`'s dtype, the reading takes them in the audit's
    # Every dot of the reading (‖v‖² as the engines sum it, their shares' denominator), each parameter's
    # operands read once: products in their dtype, cascade sums per block, the blocks in float64 (inner64).
    acc: dict[str, list[torch.Tensor]] = {"vv": [], "carried": [], "dgp": [], "gg": [], "pp": [], "gp": []}
    for c, g, gp, v in zip(update.carried, applied, probe_grad, onto):
        gp = gp.detach()
        keys, pairs = ["pp"], [(gp, gp)]
        if along is None:
            keys.append("vv")
            pairs.append((v, v))
        if c is not None:
            keys.append("carried")
            pairs.append((c, gp))
        if g is not None:
            g = g.detach().to(v.dtype)
            keys.append("gp")  # <g, g_probe>
            pairs.append((g, gp.to(g.dtype)))
            if along is None:
                keys += ["dgp", "gg"]  # <D ⊙ g_probe, g>, ‖g‖²
                pairs += [(v, g), (g, g)]
        for k, x in zip(keys, inners64(pairs)):
            acc[k].append(x)
    onto_sq = _sum64(acc["vv"]) if along is None else along.onto_sq
    reason = None
    if onto_sq == 0.0:
        contribution = tuple(0.0 for _ in rep.part_names)  # v = 0: every ⟨g_S, v⟩ is exactly zero
    elif not math.isfinite(onto_sq):
        contribution = tuple(float("nan") for _ in rep.part_names)
        reason = f"D ⊙ g_probe is not finite (||v||² = {onto_sq}); contributions are undefined this step."
    else:
        contribution = tuple(-scale * s * onto_sq for s in rep.projected_share)
    carried, dgp, gg, pp, gdotp = (_sum64(acc[k]) for k in ("carried", "dgp", "gg", "pp", "gp"))
    if along is not None:
        dgp, gg = along.full_dot, along.full_sq
    from_grad = carried - dgp
    gn, pn = math.sqrt(gg), math.sqrt(pp)
    align = gdotp / (gn * pn) if gn > 0 and pn > 0 else float("nan")
    if reason is None and not all(math.isfinite(c) for c in contribution):
        reason = rep.reason or "the step's gradient is not finite; contributions are undefined this step."
    return ProbeCreditReport(
        probe=probe,
        part_names=tuple(rep.part_names),
        contribution=contribution,
        carried=carried,
        from_grad=from_grad,
        loss_before=float(loss_before),
        alignment=align,
        grad_norm=gn,
        probe_grad_norm=pn,
        optimizer=update.optimizer,
        dtype=rep.dtype,
        n_trained=rep.n_trained,
        partition=name,
        engine=rep.engine,
        splits=_splits(terms, part, contribution, split_by),
        part_info=_part_info(terms, part, texts),
        reason=reason,
        step=step,
        ride_fallback=ride_fallback,
    )


def with_actual(
    report: ProbeCreditReport,
    loss_after: float,
    delta: Optional[Sequence[torch.Tensor]] = None,
    probe_grad: Optional[Sequence[torch.Tensor]] = None,
) -> ProbeCreditReport:
    """The report with the real change: ``L_probe(θ_after)`` and, given ``Δθ`` and ``g_probe``, ``⟨Δθ, g_probe⟩``."""
    applied = None if delta is None or probe_grad is None else _dot64(delta, probe_grad)
    return replace(report, loss_after=float(loss_after), applied=applied)


def combine_ranks(reports: Sequence[ProbeCreditReport]) -> ProbeCreditReport:
    """One reading of a data-parallel step from every rank's (each made with ``scale = 1/W``).

    Parts are named ``r{rank}/{name}``; contributions, ``Σ_S c_S`` and the splits (by name) add over
    ranks. The carried term, ``from_grad``, the probe losses and the alignment are read from the applied
    (rank-averaged) gradient and the same ``g_probe`` on every rank, so each rank holds the whole value:
    rank 0's is kept.
    """
    if not reports:
        raise ValueError("`reports` must hold one report per rank, got none.")
    first = reports[0]
    w = len(reports)
    names, contribution, info = [], [], []
    for r, rep in enumerate(reports):
        names += [f"r{r}/{n}" for n in rep.part_names]
        contribution += list(rep.contribution)
        info += list(rep.part_info) if len(rep.part_info) == rep.n_parts else [PartInfo(0)] * rep.n_parts
    acc: dict[str, dict[str, list[float]]] = {}
    order: dict[str, list[str]] = {}
    for rep in reports:
        for name, pnames, values in rep.splits:
            acc.setdefault(name, {})
            order.setdefault(name, [])
            for n, v in zip(pnames, values):
                if n not in acc[name]:
                    acc[name][n] = []
                    order[name].append(n)
                acc[name][n].append(v)
    splits = tuple(
        (name, tuple(order[name]), tuple(math.fsum(acc[name][n]) for n in order[name]))
        for name in order
        if sum(1 for rep in reports if name in [s[0] for s in rep.splits]) == w
    )
    reason = next((rep.reason for rep in reports if rep.reason), None)
    return replace(
        first,
        part_names=tuple(names),
        contribution=tuple(contribution),
        n_trained=sum(rep.n_trained for rep in reports),
        splits=splits,
        part_info=tuple(info),
        reason=reason,
    )
