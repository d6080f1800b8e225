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
from functools import cached_property
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from ...refusal import Refusal
from ..engine import DTypeSpec, TermsCall, disintegrate, native_dtype, partition_label, resolve_dtype
from ..engines.ghost import SPLITS_ROWS, RideAlong
from ..engines.reductions import BLOCK, AlongSums, along_sums, cache_block, diff_dot64, inner64, sum_dtype
from ..inputs.partition import Partition, PartitionFn, resolve_partition
from ..inputs.terms import CreditTerms
from ..primitives import audit_passes, detached_state
from ..report import CreditReport
from .conservation import UNIT_ROUNDOFF, trainer_preconditions
from .derived import coarsening
from .step_readings import RecordingPartition

__all__ = [
    "UpdateMap",
    "MapAlong",
    "PartInfo",
    "ProbeCreditReport",
    "optimizer_update_map",
    "probe_value_and_grad",
    "probe_credit",
    "with_actual",
    "update_dot",
    "combine_ranks",
    "scratch_like",
    "copy_into",
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


class _ParamStep(NamedTuple):
    """One parameter's step as the optimizer will take it: what its ``D`` and carried term are made of.

    Flat views of the live tensors (no copies), with their version counters when read: a map used after any
    of them changed (``optimizer.step()`` ran) raises instead of reading the new values."""

    kind: str  # "sgd" or "adam"
    hyper: tuple[float, ...]  # the group's numbers (see _sgd_fill, _adam_fill)
    keep: torch.dtype  # the dtype the optimizer computes its step in (the parameter's, at least float32)
    shape: torch.Size
    theta: torch.Tensor  # [n]
    grad: torch.Tensor  # [n]
    state: tuple[
        Optional[torch.Tensor], ...
    ]  # [n] each: SGD (momentum buffer,), Adam (exp_avg, exp_avg_sq, max_exp_avg_sq)
    versions: tuple[int, ...]

    def inputs(self) -> list[torch.Tensor]:
        return [self.theta, self.grad, *(s for s in self.state if s is not None)]

    def check_fresh(self) -> None:
        if tuple(t._version for t in self.inputs()) != self.versions:
            raise RuntimeError(
                "the update map's inputs changed after it was read (a parameter, its gradient or the optimizer's "
                "state: did `optimizer.step()` run?); read `optimizer_update_map` again before the step and use it "
                "before the step."
            )

    @property
    def scalar_coeff(self) -> bool:
        """``D`` is one number (SGD's ``η·a``)."""
        return self.kind == "sgd"

    @property
    def has_carried(self) -> bool:
        if self.kind == "sgd":
            return self.hyper[1] != 0 or (self.hyper[2] != 0 and self.state[0] is not None)
        return self.state[0] is not None or self.hyper[1] != 0

    def coeff_scalar(self) -> torch.Tensor:
        """SGD's ``D`` as a 0-dim tensor of the step's dtype."""
        lr, _, mom, damp, nest = self.hyper
        one = torch.tensor(1.0, dtype=self.keep)
        if mom == 0:
            a = one
        elif self.state[0] is None:
            a = one + (mom if nest else 0.0)  # the buffer starts as d itself, undamped
        else:
            a = one + mom * (1.0 - damp) if nest else one * (1.0 - damp)
        return lr * a

    def fill(self, s: int, e: int, d: Optional[torch.Tensor], c: Optional[torch.Tensor]) -> None:
        """``D`` (where not one number) and the carried term of elements ``[s, e)`` into ``d`` and ``c``."""
        (_sgd_fill if self.kind == "sgd" else _adam_fill)(self, s, e, d, c)


def _sgd_fill(st: _ParamStep, s: int, e: int, d: Optional[torch.Tensor], c: Optional[torch.Tensor]) -> None:
    # torch: d = g + wd·θ; buf = d (first step) or μ·buf + (1 − τ)·d; step = d + μ·buf (Nesterov) or buf:
    # Δθ = −η·a·g − η·a·wd·θ − η·μ(μ)·buf_old
    lr, wd, mom, _, nest = st.hyper
    buf = st.state[0]
    if c is None:
        return
    dk = st.coeff_scalar()
    old = mom * mom if nest else mom
    if wd != 0:
        torch.mul(st.theta[s:e].to(st.keep), -(dk * wd), out=c)
    if mom != 0 and buf is not None:
        t = buf[s:e].to(st.keep) * old
        if wd != 0:
            c.sub_(t.mul_(lr))
        else:
            torch.mul(t, -lr, out=c)


def _adam_fill(st: _ParamStep, s: int, e: int, d: Optional[torch.Tensor], c: Optional[torch.Tensor]) -> None:
    # Every operation of a block done while it is in cache: a map of a real policy is memory-bound, and the
    # same operations over whole tensors read and write each of them a dozen times.
    lr, wd, b1, b2, eps, decoupled, t = st.hyper
    m, v, vmax = st.state
    keep = st.keep
    th, gr = st.theta[s:e].to(keep), st.grad[s:e].to(keep)
    bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
    d_in = gr if (decoupled or wd == 0) else gr + wd * th  # what the moments see
    # v_new = β2·v + (1 − β2)·d_in², in the block of D
    if v is None:
        torch.mul(d_in, d_in, out=d).mul_(1.0 - b2)
    else:
        torch.mul(v[s:e].to(keep), b2, out=d).addcmul_(d_in, d_in, value=1.0 - b2)
    if vmax is not None:
        torch.maximum(vmax[s:e].to(keep), d, out=d)
    # Δθ = −k ⊙ m_new (+ decoupled decay), m_new = β1·m + (1 − β1)·d_in, with
    # k = (lr / bc1) / (sqrt(v_new) / sqrt(bc2) + eps) = (lr·sqrt(bc2) / bc1) / (sqrt(v_new) + eps·sqrt(bc2)):
    # D = (1 − β1)·k, the carried first moment −β1·k ⊙ m = −β1 / (1 − β1)·D ⊙ m
    r2 = math.sqrt(bc2)
    d.sqrt_().add_(eps * r2).reciprocal_().mul_(lr * r2 / bc1 * (1.0 - b1))
    if m is not None:
        torch.mul(d, m[s:e].to(keep), out=c).mul_(-b1 / (1.0 - b1))
    if wd != 0:
        decay = (lr * wd) * th if decoupled else d * (wd * th)
        if m is None:
            torch.neg(decay, out=c)
        else:
            c.sub_(decay)


# Elements of one block of the map (1 MB in float32): a block's operands (the parameter, its gradient, the
# optimizer's state, the probe's gradient, D, the carried term, v and a product) stay in a core's L2 cache,
# and each of the ~25 operations a block takes runs over enough elements to pay for its dispatch (at
# ``BLOCK`` the Adam map's pass over 33 M elements took 1.5 times as long; ``8 * BLOCK`` gains under 2 %).
_MAP_BLOCK = 4 * BLOCK


def _map_block(n: int, device: torch.device) -> int:
    """Elements per block of the map's pass over ``n`` (:func:`cache_block` elsewhere than on a CPU)."""
    return max(1, min(n, _MAP_BLOCK if device.type == "cpu" else cache_block(device)))


def _map_blocks(n: int, device: torch.device):
    block = _map_block(n, device)
    return ((s, min(n, s + block)) for s in range(0, n, block))


class MapAlong(NamedTuple):
    """A probe read along the optimizer's map in one pass (:meth:`UpdateMap.along`): ``v = D ⊙ g_probe`` per
    parameter and every sum the reading takes (float64; products in the operands' dtype, as :func:`inners64`)."""

    onto: list[torch.Tensor]  # v = D ⊙ g_probe, in the audit's dtype
    carried_dot: float  # <c, g_probe>
    grad_dot: float  # <g, g_probe>
    probe_sq: float  # ‖g_probe‖²
    onto_sq: Optional[float] = None  # ‖v‖² (None: left to the engine, ``check=False``)
    onto_grad: Optional[float] = None  # <v, g>
    grad_sq: Optional[float] = None  # ‖g‖²


@dataclass(frozen=True)
class UpdateMap:
    r"""The update one optimizer step applies, as ``Δθ = −D ⊙ g + carried``.

    Read from the optimizer's state before the step (:func:`optimizer_update_map`) and used before it: the map
    holds the live tensors it is made of, no copy, and raises if any of them changed since.

    Attributes:
        optimizer: the optimizer's class path.
        description: what was read (per group: kind, learning rate, momentum or betas, weight decay).
        coeff: ``D`` per trainable parameter (a 0-dim tensor where it is one number), aligned with the
            parameters handed to :func:`optimizer_update_map`; zero for a parameter the step leaves alone.
        carried: the part of ``Δθ`` that is not this step's gradient (momentum of earlier steps, weight
            decay), None where it is zero.
        Both are computed on first use and kept in the parameter's dtype (at least float32), as the
        optimizer's step is. :meth:`along` reads a probe along the map without forming either.
    """

    optimizer: str
    description: str
    steps: tuple[Optional[_ParamStep], ...] = field(repr=False, compare=False)

    @cached_property
    def _made(self) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
        coeff: list[torch.Tensor] = []
        carried: list[Optional[torch.Tensor]] = []
        for st in self.steps:
            if st is None:
                coeff.append(torch.zeros((), dtype=torch.float64))
                carried.append(None)
                continue
            st.check_fresh()
            n = st.theta.numel()
            d = st.coeff_scalar() if st.scalar_coeff else st.theta.new_empty(n, dtype=st.keep)
            c = st.theta.new_empty(n, dtype=st.keep) if st.has_carried else None
            for s, e in _map_blocks(n, st.theta.device):
                st.fill(s, e, None if st.scalar_coeff else d[s:e], None if c is None else c[s:e])
            coeff.append(d if st.scalar_coeff else d.view(st.shape))
            carried.append(None if c is None else c.view(st.shape))
        return coeff, carried

    @property
    def coeff(self) -> list[torch.Tensor]:
        return self._made[0]

    @property
    def carried(self) -> list[Optional[torch.Tensor]]:
        return self._made[1]

    def predicted_update(self, grads: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        """``−D ⊙ g + carried`` per parameter (float64): the ``Δθ`` this map says the step applies."""
        out = []
        for d, c, g in zip(self.coeff, self.carried, grads):
            u = torch.zeros((), dtype=torch.float64) if g is None else -(d * g.detach().double())
            out.append(u if c is None else u + c)
        return out

    def along(
        self,
        probe_grad: Sequence[torch.Tensor],
        grads: Sequence[Optional[torch.Tensor]],
        dtype: torch.dtype,
        *,
        check: bool = True,
        out: Optional[Sequence[torch.Tensor]] = None,
    ) -> MapAlong:
        """``v = D ⊙ g_probe`` (in ``dtype``) and the probe reading's sums, in one pass over each parameter a
        block at a time: neither ``D`` nor the carried term is formed whole (:attr:`coeff` formed already is
        read as it is). ``grads``: the gradient the step applies, per parameter (None: not stepped).
        ``check=False`` leaves out the sums a check along ``v`` takes (``‖v‖²``, ``<v, g>``, ``‖g‖²``: None),
        for an engine that takes them itself. ``out``: one contiguous buffer per parameter (its shape,
        ``dtype``, the probe gradient's device) that ``v`` is written into (:func:`scratch_like`); a tensor made
        fresh costs its page faults on a CPU, a buffer kept from an earlier reading does not."""
        if len(probe_grad) != len(self.steps) or len(grads) != len(self.steps):
            raise ValueError(
                f"`probe_grad` and `grads` must hold one entry per parameter of the map ({len(self.steps)}), "
                f"got {len(probe_grad)} and {len(grads)}."
            )
        if out is not None:
            _check_out(out, probe_grad, dtype)
        made = self.__dict__.get("_made")
        keys = ("carried_dot", "grad_dot", "probe_sq") + (("onto_sq", "onto_grad", "grad_sq") if check else ())
        sums: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        onto: list[torch.Tensor] = []
        bufs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

        def dot(key: str, x: torch.Tensor, y: torch.Tensor) -> None:
            dt = sum_dtype(torch.promote_types(x.dtype, y.dtype))
            if dt == torch.float64:
                sums[key].append(torch.dot(x.to(dt), y.to(dt)))
                return
            buf = bufs.get((dt, x.device))
            if buf is None or buf.numel() < x.numel():
                buf = bufs[(dt, x.device)] = torch.empty(max(x.numel(), 1), dtype=dt, device=x.device)
            sums[key].append(torch.mul(x.to(dt), y.to(dt), out=buf[: x.numel()]).sum())

        for i, (st, gp, g) in enumerate(zip(self.steps, probe_grad, grads)):
            shape = gp.shape
            gp = gp.detach().reshape(-1)
            g = None if g is None else g.detach().reshape(-1)
            n = gp.numel()
            v = torch.empty(n, dtype=dtype, device=gp.device) if out is None else out[i].view(-1)
            if st is not None and made is None:
                st.check_fresh()
            scalar = st is None or st.scalar_coeff  # D is one number (0 where the step leaves it alone)
            carries = st is not None and st.has_carried
            if made is not None:  # formed whole already: read it as it is
                d_whole, c_whole = made[0][i].reshape(-1), made[1][i]
                c_whole = None if c_whole is None else c_whole.reshape(-1)
            else:  # one block at a time, into buffers reused over the blocks
                block = _map_block(n, gp.device)
                d_buf = None if scalar else gp.new_empty(block, dtype=st.keep)
                c_buf = gp.new_empty(block, dtype=st.keep) if carries else None
            d_one = None
            if scalar:
                d_one = torch.zeros((), dtype=dtype) if st is None else st.coeff_scalar().to(dtype)
            for s, e in _map_blocks(n, gp.device):
                if made is not None:
                    db = None if scalar else d_whole[s:e]
                    cb = None if c_whole is None else c_whole[s:e]
                else:
                    db = None if scalar else d_buf[: e - s]
                    cb = None if c_buf is None else c_buf[: e - s]
                    if st is not None:
                        st.fill(s, e, db, cb)
                gpb, vb = gp[s:e], v[s:e]
                if scalar:
                    torch.mul(gpb.to(dtype), d_one, out=vb)
                else:
                    torch.mul(db.to(dtype), gpb.to(dtype), out=vb)
                dot("probe_sq", gpb, gpb)
                if cb is not None:
                    dot("carried_dot", cb, gpb)
                if g is not None:
                    gb = g[s:e].to(dtype)
                    dot("grad_dot", gb, gpb.to(dtype))
                    if check:
                        dot("onto_grad", vb, gb)
                        dot("grad_sq", gb, gb)
                if check:
                    dot("onto_sq", vb, vb)
            onto.append(v.view(shape))
        total = {k: float(torch.stack([x.double().cpu() for x in xs]).sum()) if xs else 0.0 for k, xs in sums.items()}
        return MapAlong(onto, **total)


def _check_out(out: Sequence[torch.Tensor], like: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    if len(out) != len(like):
        raise ValueError(f"`out` must hold one buffer per parameter of the map ({len(like)}), got {len(out)}.")
    for i, (b, x) in enumerate(zip(out, like)):
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"`out[{i}]` must be a tensor, got {type(b).__name__}; make them with `scratch_like`.")
        if tuple(b.shape) != tuple(x.shape) or b.dtype != dtype or b.device != x.device or not b.is_contiguous():
            raise ValueError(
                f"`out[{i}]` must be a contiguous {dtype} tensor of shape {list(x.shape)} on {x.device}, got "
                f"{'a contiguous' if b.is_contiguous() else 'a non-contiguous'} {b.dtype} tensor of shape "
                f"{list(b.shape)} on {b.device}; make the buffers with `scratch_like(params, dtype)`."
            )


def scratch_like(
    params: Sequence[torch.Tensor], dtype: torch.dtype, held: Optional[Sequence[torch.Tensor]] = None
) -> list[torch.Tensor]:
    """One contiguous buffer of ``dtype`` per parameter, of its shape and device, for :meth:`UpdateMap.along`'s
    ``out`` (and then :func:`copy_into`): each entry of ``held`` that fits is reused as it is, the others are
    made. Their values are left as they were (uninitialised where made)."""
    out = []
    for i, p in enumerate(params):
        b = held[i] if held is not None and i < len(held) else None
        fits = (
            b is not None
            and tuple(b.shape) == tuple(p.shape)
            and b.dtype == dtype
            and b.device == p.device
            and b.is_contiguous()
        )
        out.append(b if fits else torch.empty(p.shape, dtype=dtype, device=p.device))
    return out


def copy_into(buffers: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each parameter, written into its buffer where the buffer has its dtype (a clone otherwise):
    ``θ_before`` in the buffers a reading took ``v`` in, so that one parameter size serves both."""
    if len(buffers) != len(params):
        raise ValueError(f"`buffers` must hold one buffer per parameter ({len(params)}), got {len(buffers)}.")
    out = []
    for b, p in zip(buffers, params):
        p = p.detach()
        same = b.dtype == p.dtype and b.device == p.device and tuple(b.shape) == tuple(p.shape)
        out.append(b.copy_(p) if same else p.clone())
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
    steps: list[Optional[_ParamStep]] = [None for _ in params]
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
            state = opt.state.get(p, {})
            if kind is torch.optim.SGD:
                hyper: tuple[float, ...] = (lr, wd, mom, damp, float(nest))
                read = (state.get("momentum_buffer"),)
            else:
                t = (_f(state["step"]) if "step" in state else 0.0) + 1.0
                hyper = (lr, wd, b1, b2, eps, float(decoupled), t)
                read = (state.get("exp_avg"), state.get("exp_avg_sq"), state.get("max_exp_avg_sq") if ams else None)
            flat = [None if x is None else x.detach().reshape(-1) for x in (p, g, *read)]
            steps[i] = _ParamStep(
                "sgd" if kind is torch.optim.SGD else "adam",
                hyper,
                keep,
                p.shape,
                flat[0],
                flat[1],
                tuple(flat[2:]),
                tuple(x._version for x in flat if x is not None),
            )
    return UpdateMap(name, "; ".join(lines), tuple(steps))


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
    onto_out: Optional[Sequence[torch.Tensor]] = None,
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
        onto_out: buffers ``v = D ⊙ g_probe`` is written into (:func:`scratch_like`, the audit's dtype), as
            :meth:`UpdateMap.along`'s ``out``; ``v`` is not needed after this call, so the caller may reuse them.
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    for name, xs in (("probe_grad", probe_grad), ("update.steps", update.steps)):
        if len(xs) != len(trainable):
            raise ValueError(f"`{name}` must hold one entry per trainable parameter ({len(trainable)}), got {len(xs)}.")
    target = resolve_dtype(dtype) or native_dtype(module)
    for gp, p in zip(probe_grad, trainable):
        if tuple(gp.shape) != tuple(p.shape):
            raise ValueError(
                f"`probe_grad` entries must match their parameter's shape {list(p.shape)}, got {list(gp.shape)}."
            )
    applied = [p.grad for p in trainable] if applied_grad is None else list(applied_grad)
    # Riding, the check along v holds the parts against `.grad`: where `.grad` is the applied gradient in the
    # audit's dtype, the map's pass takes its sums (‖g‖², <v, g>, ‖v‖²) while g and v are in cache, and the
    # ride reads them instead of a pass of its own; otherwise the ride takes them from `.grad` itself.
    same_dtype = all(g is None or g.dtype == target for g in applied)
    hand_over = ride is not None and applied_grad is None and same_dtype
    # v = D ⊙ g_probe in the audit's dtype and every parameter-wide sum of the reading, in one pass over the
    # optimizer's map (D kept in the parameter's own precision, as the optimizer steps; neither D nor the
    # carried term formed whole)
    sums = update.along(probe_grad, applied, target, check=ride is None or hand_over, out=onto_out)
    onto = sums.onto
    mapped = AlongSums(sums.grad_sq, sums.onto_grad, sums.onto_sq) if sums.onto_sq is not None else None
    spec = resolve_partition(partition)
    name = partition_label(partition)
    recorder = RecordingPartition(spec, name)
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
        rep = ride.report(
            recorder,
            partition_name=name,
            readings="projected",
            project_onto=onto,
            along=mapped if hand_over and mapped is not None else True,
        )
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
            # the readings are dots with v: the parts' sum is checked along v, never formed; with `.grad` as g_full
            # in the audit's dtype, the map's pass took that check's sums already
            along=mapped if mapped is not None and given is not None and same_dtype else True,
        )
    terms, part = recorder.take()
    # ‖v‖², <v, g> and ‖g‖² the riding reading took already (its g_full is `.grad`, the applied gradient)
    along = ride.last_along if ride is not None and ride_fallback is None and applied_grad is None else None
    if along is not None and any(g is not None and g.dtype != v.dtype for g, v in zip(applied, onto)):
        along = None  # its ‖g‖² took products in `.grad`'s dtype, the reading takes them in the audit's
    if along is None:
        along = (
            mapped
            if mapped is not None
            else along_sums(
                [torch.zeros_like(v) if g is None else g.detach().to(v.dtype) for g, v in zip(applied, onto)], onto
            )
        )
    onto_sq = along.onto_sq
    reason = None
    if onto_sq == 0.0:
        contribution = tuple(0.0 for _ in rep.part_names)  # v = 0: every ⟨g_S, v⟩ is exactly zero
    elif not math.isfinite(onto_sq):
        contribution = tuple(float("nan") for _ in rep.part_names)
        reason = f"D ⊙ g_probe is not finite (||v||² = {onto_sq}); contributions are undefined this step."
    else:
        contribution = tuple(-scale * s * onto_sq for s in rep.projected_share)
    carried, dgp, gg, pp, gdotp = sums.carried_dot, along.full_dot, along.full_sq, sums.probe_sq, sums.grad_dot
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
    *,
    applied: Optional[float] = None,
) -> ProbeCreditReport:
    """The report with the real change: ``L_probe(θ_after)`` and ``⟨Δθ, g_probe⟩``, from ``Δθ`` and ``g_probe`` or
    given as ``applied`` (:func:`update_dot`)."""
    if delta is not None and probe_grad is not None:
        if applied is not None:
            raise ValueError("pass `delta` and `probe_grad`, or `applied`, not both.")
        applied = _dot64(delta, probe_grad)
    return replace(report, loss_after=float(loss_after), applied=applied)


def update_dot(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], probe_grad: Sequence[torch.Tensor]
) -> float:
    """``⟨θ_after − θ_before, g_probe⟩`` over parameter lists, a block at a time (:func:`diff_dot64`): no
    parameter-sized difference is formed; each difference is exact for two nearby values of the parameter's
    dtype, the products in that dtype (at least float32), every block summed in float64."""
    if not len(before) == len(after) == len(probe_grad):
        raise ValueError(
            f"`before`, `after` and `probe_grad` must hold one entry per parameter, got {len(before)}, {len(after)} "
            f"and {len(probe_grad)}."
        )
    return _sum64(diff_dot64(a.detach(), b.detach(), gp.detach()) for b, a, gp in zip(before, after, probe_grad))


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
