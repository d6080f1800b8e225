r"""Forward-mode (JVP) engine: every part's ``<g_S, g_full>`` from one directional derivative.

For any partition of the trained positions, ``<g_S, v> = Σ_{(k,t)∈S} ∂terms[k,t]/∂θ · v`` — the
directional derivative of each term along ``v``, summed over the part. One forward-mode pass of
``credit_terms`` along ``v = g_full`` therefore gives the projection of every part at once, whatever
the number of parts ``m``, including parts inside a row (turns, segments), where attention carries a
later position's loss into earlier positions and no per-row hook split applies.

Cost: one forward + one backward for ``g_full`` (as any engine needs) plus one forward with tangents
(about 1.5–3 forwards of arithmetic); no parameter-sized buffer per part. The JVP needs every op of the
module's forward to have a forward-mode derivative. ``scaled_dot_product_attention`` gets one from
:mod:`.attention` while the pass runs (torch's fused kernels have none), so transformers' default
``sdpa`` attention, ``nn.MultiheadAttention`` and eager attention are covered; another fused kernel
(``flash_attention_2``, flex attention) is a :class:`ForwardADUnsupportedError` naming the fix.
``linear`` and ``log_softmax`` take the memory-frugal rules of :mod:`.forward_rules`, so the pass peaks
below the training step on a vocabulary-wide head.

What this cannot do: it gives ``<g_S, g_full>`` and not ``‖g_S‖``. With ``readings="projected"``
``norm_share``, ``part_norm`` and ``cancellation`` are NaN (the shares themselves are defined, so the
report's ``reason`` stays None); ``readings="all"`` takes the exact norms through one backward per part
as the reference engine does, at its cost.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from ..inputs.partition import Partition, PartitionFn, apply_partition, resolve_partition
from ..inputs.terms import CreditTerms, validate_terms
from ..precision import PrecisionWatch
from ..primitives import (
    DTypeSpec,
    TermsCall,
    audit_passes,
    dots_onto,
    evaluate_terms,
    flat_diff_norm,
    grad_match_to,
    leaf_grads,
    native_dtype,
    partition_label,
    precision_watch,
    preserved_rng,
    resolve_dtype,
    rng_devices,
    sq_norm,
)
from ..report import CreditReport
from .attention import AttentionDropoutError
from .forward_rules import DeferredWrite, ForwardRules
from .reductions import AlongSums, along_sums

__all__ = ["disintegrate_jvp", "terms_jvp", "part_sums", "ForwardADUnsupportedError", "READINGS"]

READINGS = ("projected", "shares", "all")


class ForwardADUnsupportedError(RuntimeError):
    """An op in ``credit_terms`` has no forward-mode derivative (e.g. a fused attention kernel)."""


def _rng_snapshot(module: nn.Module) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in rng_devices(module)]


@contextlib.contextmanager
def _replayed_rng(module: nn.Module, snapshot: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]) -> Iterator[None]:
    # The tangent pass must draw the dropout masks the backward's forward drew, and leave the stream as it found it.
    cpu, cuda = snapshot
    with torch.random.fork_rng(devices=rng_devices(module)):
        torch.set_rng_state(cpu)
        for d, s in cuda:
            torch.cuda.set_rng_state(s, d)
        yield


def terms_jvp(
    module: nn.Module,
    batch: Any,
    tangents: Mapping[str, torch.Tensor],
    dtype: DTypeSpec = "float32",
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    watch: Optional[PrecisionWatch] = None,
) -> tuple[CreditTerms, torch.Tensor]:
    r"""``credit_terms`` and its directional derivative along ``tangents`` in one forward-mode pass.

    ``tangent[k, t] = ∇θ terms[k, t] · v`` with ``v`` given per parameter name (parameters not named
    get a zero tangent). Runs on detached (optionally cast) copies, like
    :func:`~lens_callbacks.credit.engine.evaluate_terms`, without building an autograd graph.

    Args:
        module: an ``nn.Module`` implementing ``credit_terms``.
        batch: what ``credit_terms`` takes.
        tangents: parameter name → direction ``v`` (cast to the audit dtype).
        dtype: the audit dtype (see :func:`~lens_callbacks.credit.engine.resolve_dtype`).
        terms_fn: use this instead of ``module.credit_terms``.
        params: evaluate at these weights (name → tensor) instead of the live ones.
        watch: a :class:`~lens_callbacks.credit.precision.PrecisionWatch` that records the coarsest dtype
            the tangents were computed in.

    Returns:
        ``(terms, tangent)``: the terms (values, no graph) and ``tangent`` ``[B, T]``.

    Raises:
        ForwardADUnsupportedError: an op of the forward has no forward-mode derivative.

    Example:
        >>> w = nn.Linear(2, 1, bias=False).double()
        >>> w.weight.data = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
        >>> def f(x):  # terms[k, t] = (w · x[k, t])²
        ...     t = w(x)[..., 0] ** 2                                  # [B, T]
        ...     return CreditTerms(t, torch.ones_like(t, dtype=torch.bool), torch.arange(1), torch.zeros(1, dtype=torch.long))
        >>> x = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)       # [1, 1, 2]
        >>> _, tan = terms_jvp(w, x, {"weight": torch.tensor([[1.0, 0.0]])}, dtype="float64", terms_fn=f)
        >>> tan.tolist()  # 2 (w·x) x·v = 2 · 3 · 1
        [[6.0]]
    """
    fn = terms_fn if terms_fn is not None else getattr(module, "credit_terms", None)
    if fn is None or not callable(fn):
        raise TypeError(
            f"`module` must implement `credit_terms(batch) -> CreditTerms` (see lens_callbacks.credit.CreditSource), "
            f"got {type(module).__name__} without it; or pass `terms_fn`."
        )
    known = {n for n, _ in module.named_parameters()}
    for label, given in (("tangents", tangents), ("params", params or {})):
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"`{label}` must name parameters of the module, got unknown names {unknown[:5]!r}.")
    target = resolve_dtype(dtype)
    with fwAD.dual_level():
        state: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            q = (params[name] if params is not None and name in params else p).detach()
            if target is not None and q.is_floating_point() and q.dtype != target:
                q = q.to(target)
            if name in tangents:
                v = tangents[name].detach().to(device=q.device, dtype=q.dtype)
                if v.shape != q.shape:
                    raise ValueError(f"`tangents[{name!r}]` must have the shape {list(q.shape)}, got {list(v.shape)}.")
                q = fwAD.make_dual(q, v)
            state["inner." + name] = q
        if target is not None:
            for name, b in module.named_buffers():
                if b.is_floating_point() and b.dtype != target:
                    state["inner." + name] = b.to(target)
        try:
            with (
                torch.no_grad(),
                audit_passes(),
                watch if watch is not None else contextlib.nullcontext(),
                ForwardRules() as rules,
            ):
                # forward AD needs no graph: activations are freed as the pass goes; sdpa, linear and
                # log_softmax take their rules (attention.py, forward_rules.py)
                terms = torch.func.functional_call(TermsCall(module, fn), state, (batch,), strict=False)
                if isinstance(getattr(terms, "terms", None), torch.Tensor):
                    terms.terms = rules.resolve(terms.terms)  # a log-softmax returned as the terms: its whole tangent
        except (AttentionDropoutError, DeferredWrite) as err:
            raise ForwardADUnsupportedError(str(err)) from err
        except (NotImplementedError, RuntimeError) as err:
            text = str(err)
            if (
                isinstance(err, NotImplementedError)
                or "forward AD" in text
                or "forward-mode" in text
                or "forward grad" in text
            ):
                first = text.splitlines()[0] if text else type(err).__name__
                raise ForwardADUnsupportedError(
                    f"forward-mode AD failed inside `credit_terms`: {first}. scaled_dot_product_attention has a rule "
                    "while the pass runs (transformers' attn_implementation='sdpa' and 'eager' are covered); another "
                    "fused kernel (e.g. 'flash_attention_2', flex attention) has none: use attn_implementation='sdpa' "
                    "for the audit, or audit with the reference engine."
                ) from err
            raise
        validate_terms(terms)
        primal, tangent = fwAD.unpack_dual(terms.terms)
        if tangent is None:
            # No tangent reached the terms. That is a zero derivative only when every direction is zero;
            # otherwise an op on the way dropped the forward-mode derivative (a compiled region, a custom
            # function without a forward rule), and reading it as zero would make every share zero.
            if any(bool(v.detach().ne(0).any()) for v in tangents.values()):
                raise ForwardADUnsupportedError(
                    "forward-mode AD returned no tangent for the terms although the directions are not zero: an "
                    "op inside `credit_terms` dropped the forward-mode derivative (a torch.compile region run "
                    "compiled, an autograd.Function without a jvp rule). Audit with the reference engine."
                )
            tangent = torch.zeros_like(primal)
        tangent = tangent.detach().clone()  # [B, T]
        terms.terms = primal.detach().clone()  # [B, T]
    return terms, tangent


def part_sums(values: torch.Tensor, part: Partition) -> list[float]:
    """``Σ_{(k,t)∈S} values[k, t]`` for every part ``S`` (float64; positions with id −1 are left out)."""
    ids = part.ids.to(values.device).reshape(-1)  # [B*T]
    flat = values.double().reshape(-1)  # [B*T]
    keep = ids >= 0
    out = torch.zeros(part.n_parts, dtype=torch.float64, device=values.device)  # [m]
    out.index_add_(0, ids[keep], flat[keep])
    return [float(x) for x in out.cpu()]


def disintegrate_jvp(
    module: nn.Module,
    batch: Any,
    partition: Union[str, PartitionFn, Partition] = "by_rollout",
    *,
    dtype: DTypeSpec = "float32",
    reference_grads: Optional[Union[str, Mapping[str, torch.Tensor], Sequence[Optional[torch.Tensor]]]] = None,
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    preserve_rng: bool = True,
    readings: str = "projected",
    params: Optional[Mapping[str, torch.Tensor]] = None,
    forward_context: Optional[Callable[[], Any]] = None,
    project_onto: Optional[Sequence[Optional[torch.Tensor]]] = None,
    full_grad: Optional[Sequence[Optional[torch.Tensor]]] = None,
    along: Optional[AlongSums] = None,
) -> CreditReport:
    r"""Every part's projected share from one forward-mode pass along ``g_full``.

    ``g_full`` is taken by its own backward pass (or given: ``full_grad``); then one JVP of ``credit_terms``
    along ``g_full`` gives ``tangent[k, t] = ∇θ terms[k, t] · g_full``, and
    ``<g_S, g_full> = Σ_{(k,t)∈S} tangent[k, t]`` for every part at once, so the shares cost about one extra
    forward whatever the number of parts. Both passes see the same dropout masks (the tangent pass replays
    the random state the first one started from).

    The conservation check of this engine is scalar: ``Σ_S <g_S, g_full>`` comes from the tangents and
    ``‖g_full‖²`` from the backward, two different arithmetic paths, and
    ``conservation_error = |Σ_S <g_S, g_full> − ‖g_full‖²| / ‖g_full‖²``. It catches a partition that
    misses trained positions and terms that are not what was backpropagated, as the reference's vector
    check does, but not a change that is orthogonal to ``g_full``. Its floor scales with
    ``Σ_{k,t} |tangent[k, t]| / ‖g_full‖²`` (``report.floor_scale``), the cancellation over positions.

    Args:
        module: an ``nn.Module`` implementing ``credit_terms(batch) -> CreditTerms``. Every op of its
            forward needs a forward-mode derivative; ``scaled_dot_product_attention`` has one while the pass
            runs (:mod:`lens_callbacks.credit.engines.attention`).
        batch: what ``credit_terms`` takes.
        partition: as for :func:`~lens_callbacks.credit.disintegrate`; any partition works, the engine is
            made for parts inside rows (``"by_segment"``, ``"by_turn"``).
        dtype: ``"float32"`` (default), ``"float64"``, ``"bfloat16"`` or ``"native"``.
        reference_grads: ``"grad"``, a mapping or a list, as for ``disintegrate``; gives ``grad_match``.
        terms_fn: use this instead of ``module.credit_terms``.
        preserve_rng: leave the global random stream as it was (``torch.random.fork_rng``).
        readings: ``"projected"`` (default): projected shares only — ``norm_share``, ``part_norm`` and
            ``cancellation`` are NaN, while ``reason`` stays None because the shares are defined;
            ``"all"`` or ``"shares"`` (the same here: no interference matrix is formed): also the exact
            norms through one backward per part (the reference engine's cost);
            then ``conservation_error`` is the larger of the reference's ``‖Σ_S g_S − g_full‖ / ‖g_full‖``
            and the scalar check above.
        params: name → tensor to evaluate the terms at instead of the live parameters.
        forward_context: a zero-argument factory of a context manager entered around both passes of
            ``credit_terms`` (a trainer's autocast).
        project_onto: a vector ``v`` (one tensor per trainable parameter) that replaces ``g_full`` as the
            tangent: ``projected_share[S] = <g_S, v> / ‖v‖²``; the scalar check then holds
            ``Σ_S <g_S, v>`` against ``<g_full, v>``.
        full_grad: the step's full gradient (one tensor per trainable parameter: the trainer's ``.grad`` of
            this very batch) as ``g_full``: no forward and backward of the audit's own, the tangent pass
            alone (``engine="jvp+grad"``). The scalar check then holds the terms' tangents along ``.grad``
            against ``‖.grad‖²``, which also catches terms that are not the trained loss; ``grad_match``
            is not read. With ``readings="all"`` the per-part backward passes still need a forward.
        along: with ``project_onto`` and ``full_grad``: ``‖g_full‖²``, ``<g_full, v>`` and ``‖v‖²`` taken by the
            caller from those very vectors (:func:`~lens_callbacks.credit.engines.reductions.along_sums`, or a
            pass over the optimizer's map that read them already); the check reads them instead of a pass of
            its own over both.

    Returns:
        A :class:`~lens_callbacks.credit.CreditReport`.

    Raises:
        ForwardADUnsupportedError: an op of the forward has no forward-mode derivative.

    Example:
        >>> class Toy(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
        ...     def credit_terms(self, x):                        # x: [1, 2, 2], two positions in one row
        ...         t = -(x @ self.w)                             # [1, 2]
        ...         return CreditTerms(t, torch.ones(1, 2, dtype=torch.bool), torch.arange(1), torch.zeros(1, dtype=torch.long),
        ...                            segment=torch.tensor([[0, 1]]))
        >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
        >>> r = disintegrate_jvp(Toy(), x, "by_segment", dtype="float64")
        >>> r.projected_share, r.conservation_error, r.norm_share
        ((0.5, 0.5), 0.0, (nan, nan))
    """
    if readings not in READINGS:
        raise ValueError(f"`readings` must be one of {list(READINGS)}, got {readings!r}.")
    if along is not None and (project_onto is None or full_grad is None):
        raise ValueError(
            "`along` (sums taken from g_full and v) must come with `project_onto` and `full_grad`, the vectors they "
            f"were taken from; got project_onto={'given' if project_onto is not None else None}, "
            f"full_grad={'given' if full_grad is not None else None}."
        )
    spec = resolve_partition(partition)
    if reference_grads is not None and not isinstance(reference_grads, (str, Mapping, list, tuple)):
        raise ValueError(
            f"`reference_grads` must be 'grad', a mapping name -> tensor, or a list of tensors, got {type(reference_grads).__name__}."
        )
    exact_norms = readings in ("all", "shares")
    context = forward_context if forward_context is not None else contextlib.nullcontext
    target = resolve_dtype(dtype)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    with preserved_rng(module, preserve_rng):
        start = _rng_snapshot(module)
        sq: list[float] = []
        running: Optional[list[torch.Tensor]] = None
        part: Optional[Partition] = None
        if full_grad is None or exact_norms:
            with context():
                watch = precision_watch(module, dtype)
                terms, names, leaves, used = evaluate_terms(module, batch, dtype, terms_fn, params=params, watch=watch)
                compute = watch.coarser_than(used)
            part = apply_partition(spec, terms)
            n_trained = terms.n_trained
            with torch.enable_grad():
                loss = terms.terms.sum()
                if full_grad is None:
                    # g_full by its own backward: the tangent pass then projects every part on it at once.
                    g_full = leaf_grads(loss, leaves, retain=exact_norms)
                else:
                    g_full = _given(leaves, full_grad)
                if exact_norms:
                    ids = part.ids.to(terms.terms.device)  # [B, T]
                    running = [torch.zeros_like(g) for g in g_full]
                    for i in range(part.n_parts):
                        loss_i = terms.terms.masked_select(ids == i).sum()
                        g_i = leaf_grads(loss_i, leaves, retain=i < part.n_parts - 1)
                        sq.append(sq_norm(g_i))
                        for r, g in zip(running, g_i):
                            r.add_(g)
                        del g_i
            loss_value = float(loss.detach())
            del terms, loss, leaves
        else:
            like = [p for p in module.parameters() if p.requires_grad]
            g_full = _given(like, full_grad, target)
            used = str(target if target is not None else native_dtype(module)).replace("torch.", "")
            compute, loss_value, n_trained = None, float("nan"), 0
        onto = dots_onto(g_full, project_onto)
        direction = g_full if onto is None else onto
        with _replayed_rng(module, start), context():
            watch = precision_watch(module, dtype)
            tan_terms, tangent = terms_jvp(
                module, batch, dict(zip(names, direction)), dtype, terms_fn, params=params, watch=watch
            )
            if full_grad is not None and not exact_norms:
                compute = watch.coarser_than(used)
    if part is None:  # the tangent pass was the only one: the partition is of its terms
        part = apply_partition(spec, tan_terms)
        n_trained = tan_terms.n_trained
        loss_value = float(tan_terms.terms.detach().double().sum())
    if tuple(tangent.shape) != tuple(part.ids.shape):
        raise ValueError(
            f"`credit_terms` returned terms of shape {list(tangent.shape)} in the tangent pass and {list(part.ids.shape)} "
            "before: it must be a deterministic function of the batch and the parameters."
        )
    dots = part_sums(tangent, part)
    # Products in the parameters' dtype, cascade sums (inners64: each parameter's g_full and v read once): the
    # tangent's dots are no finer, and float64 products of three parameter-sized vectors cost more than the
    # tangent pass itself at a real vocabulary.
    if onto is None:
        full_sq = sq_norm(g_full, exact=False)
        den = expected = full_sq
    else:  # ‖g_full‖², <g_full, v> (what Σ_S <g_S, v> must be), ‖v‖² (the shares' denominator)
        full_sq, expected, den = along if along is not None else along_sums(g_full, onto)
    full_norm = math.sqrt(full_sq)
    gap = abs(math.fsum(dots) - expected)
    norm = den if onto is None else math.sqrt(den) * full_norm
    nan = float("nan")
    reason: Optional[str] = None
    if not math.isfinite(full_sq):
        reason = f"the full gradient is not finite (||g_full||² = {full_sq}); shares are undefined this step."
    elif full_sq == 0.0 and onto is None:
        reason = "the full gradient is zero (e.g. every advantage is 0); shares are undefined this step."
    elif not (math.isfinite(den) and den > 0.0):
        reason = f"the vector the parts are projected onto has ||v||² = {den}; shares are undefined this step."
    scale = None
    if reason is None:
        projected = tuple(d / den for d in dots)
        conservation = gap / norm if norm > 0 else gap
        keep = part.ids.to(tangent.device) >= 0  # [B, T]
        scale = float(tangent.double().abs()[keep].sum()) / norm if norm > 0 else None
    else:
        projected = tuple(nan for _ in dots)
        conservation = nan if not math.isfinite(full_sq) else gap
    if exact_norms:
        part_norm = tuple(math.sqrt(s) for s in sq)
        norm_total = math.fsum(part_norm)
        norm_share = tuple(n / norm_total if norm_total > 0 else nan for n in part_norm)
        assert running is not None
        if reason is None and full_norm > 0:
            cancellation = norm_total / full_norm
            conservation = max(conservation, flat_diff_norm(running, g_full) / full_norm)
            scale = max(scale or 0.0, cancellation)
        else:
            cancellation = nan
            if math.isfinite(full_sq):
                conservation = max(conservation, flat_diff_norm(running, g_full))
    else:
        part_norm = tuple(nan for _ in dots)
        norm_share = part_norm
        cancellation = nan

    grad_match = None if full_grad is not None else grad_match_to(module, names, reference_grads, g_full, full_norm)

    return CreditReport(
        part_names=part.names,
        projected_share=projected,
        norm_share=norm_share,
        part_norm=part_norm,
        cancellation=cancellation,
        conservation_error=conservation,
        grad_match=grad_match,
        dtype=used,
        n_trained=n_trained,
        full_grad_norm=full_norm,
        loss=loss_value,
        partition=partition_label(partition),
        reason=reason,
        engine="jvp" if full_grad is None else "jvp+grad",
        readings=readings,
        compute_dtype=compute,
        floor_scale=scale,
    )


def _given(
    like: Sequence[torch.Tensor], full_grad: Sequence[Optional[torch.Tensor]], dtype: Optional[torch.dtype] = None
) -> list[torch.Tensor]:
    """``full_grad`` aligned with the parameters ``like`` (None entries read as zero), in ``dtype`` (theirs if None)."""
    grads = list(full_grad)
    if len(grads) != len(like):
        raise ValueError(
            f"`full_grad` must hold one tensor per trainable parameter ({len(like)}), got {len(grads)}; "
            "align it with [p for p in module.parameters() if p.requires_grad]."
        )
    out = []
    for x, g in zip(like, grads):
        want = dtype if dtype is not None else x.dtype
        if g is None:
            out.append(torch.zeros(x.shape, dtype=want, device=x.device))
        elif tuple(g.shape) != tuple(x.shape):
            raise ValueError(
                f"`full_grad` entries must match their parameter's shape {list(x.shape)}, got {list(g.shape)}."
            )
        else:
            out.append(g.detach().to(device=x.device, dtype=want))
    return out
