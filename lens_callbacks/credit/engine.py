"""``disintegrate``: the dispatcher over the exact engines, and the reference engine (one backward pass per
part, plus an independent full one) that every other engine is tested against.

What this cannot do:
The conservation identity is a claim about the optimizer, so step_conservation refuses to assert it
for any optimizer outside the exact set. The disintegration is a statement about this gradient at
these parameters, so it says where the step went and not what any part of the trajectory contributed
to the run as a whole. And every number here is first-order: removing a turn does not remove its
share, because removing it changes every downstream position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .engines import available_engines, check_engine, choose_engine, get_engine
from .engines.ghost import NotRowSeparable, RowInteraction, SpansInteract
from .engines.reductions import AlongSums
from .inputs.partition import Partition, PartitionFn, apply_partition, resolve_partition
from .inputs.terms import CreditTerms
from .primitives import (  # noqa: F401  (re-exported: `from lens_callbacks.credit.engine import X` keeps working)
    DTYPE_NAMES,
    DTypeSpec,
    TermsCall,
    dots_onto,
    evaluate_terms,
    flat_diff_norm,
    flat_dot,
    grad_match_to,
    gram_of,
    leaf_grads,
    native_dtype,
    partition_label,
    precision_watch,
    preserved_rng,
    reference_parts,
    resolve_dtype,
    rng_devices,
    sq_norm,
)
from .report import CreditGrads, CreditReport, PositionSplit, share_readings

__all__ = ["disintegrate", "resolve_dtype", "evaluate_terms", "DTypeSpec"]


def disintegrate(
    module: nn.Module,
    batch: Any,
    partition: Union[str, PartitionFn, Partition] = "by_rollout",
    *,
    dtype: DTypeSpec = "float32",
    reference_grads: Optional[Union[str, Mapping[str, torch.Tensor], Sequence[Optional[torch.Tensor]]]] = None,
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    keep_grads: bool = False,
    keep_parts: bool = False,
    preserve_rng: bool = True,
    project_onto: Optional[Sequence[Optional[torch.Tensor]]] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    forward_context: Optional[Callable[[], Any]] = None,
    engine: str = "auto",
    readings: str = "all",
    full_grad: Optional[Sequence[Optional[torch.Tensor]]] = None,
    verify_part: Union[bool, str] = False,
    position_split: bool = False,
    along: Union[bool, AlongSums] = False,
) -> CreditReport:
    r"""Split the step's gradient into exact parts and read how each part bears on the step.

    For a partition ``S_1 … S_m`` of the trained positions, ``g_S = ∇θ Σ_{(k,t)∈S} terms[k,t]``, so
    ``Σ_S g_S = ∇θ Σ terms = g_full`` by linearity; the report holds each part's projected share
    ``<g_S, g_full> / ‖g_full‖²``, its norm share, the cancellation and (``readings="all"``) the Gram of
    the parts, with ``Σ_S g_S`` held against ``g_full`` as ``conservation_error``.

    Which engine computes them (``engine="auto"``, the default, takes the fastest exact one):

    - parts that are unions of whole rows (``by_rollout``, ``by_group``): the one-pass engine, one
      forward and one backward with per-layer hooks (:mod:`lens_callbacks.credit.engines.ghost`). Each
      parameter's per-part readings come from what its layers saw (rules per layer family in
      :mod:`lens_callbacks.credit.engines.rules`); no ``g_S`` is formed for embeddings or for weights read
      by the ghost identities, and every dot and norm is summed in float64. Parameters outside the rules
      take one masked backward per part, for those parameters only. Peak memory: about one
      parameter-sized buffer beyond a training step's.
    - parts inside rows with ``readings="projected"``: one forward-mode pass along ``g_full``
      (:mod:`lens_callbacks.credit.engines.jvp`).
    - anything else, or ``engine="reference"`` (the oracle the others are tested against): one forward,
      then one backward per part with the graph retained, plus ``g_full`` by its own backward, never
      derived from the parts. Peak memory: three parameter-sized buffers (``g_full``, the running sum,
      the current part) plus the activations of one forward pass.

    Args:
        module: an ``nn.Module`` implementing ``credit_terms(batch) -> CreditTerms``.
        batch: what ``credit_terms`` takes (the rollout batch the module trained on).
        partition: ``"by_rollout"``, ``"by_group"``, ``"by_segment"``, an import path, a callable
            ``CreditTerms -> Partition``, or a ready :class:`Partition`.
        dtype: ``"float32"`` (default), ``"float64"``, ``"bfloat16"`` or ``"native"``. The audit runs on
            cast copies of the parameters; the module is left as it was.
        reference_grads: ``"grad"`` to compare ``g_full`` with the parameters' ``.grad``; or a mapping
            name → tensor; or a list aligned with the trainable parameters. Gives ``grad_match``.
        terms_fn: use this instead of ``module.credit_terms``.
        keep_grads: attach ``g_full`` and ``Σ g_S`` to the report (``report.grads``).
        keep_parts: also attach every ``g_S`` (memory ``m × |θ|``; for tests and small models).
        preserve_rng: run under ``torch.random.fork_rng`` so dropout in the audit does not consume the
            training run's random stream.
        project_onto: a vector ``v`` (one tensor per trainable parameter, aligned with them; None
            entries read as zero) that replaces ``g_full`` in the shares:
            ``projected_share[S] = <g_S, v> / ||v||²``, and whose zero norm makes them undefined. Under
            DDP ``v`` is the rank-averaged ``.grad`` the optimizer applies, so that a local share divided
            by the world size is that rank's part of the global step (see
            :mod:`lens_callbacks.credit.readings.distributed`). ``cancellation``, ``conservation_error`` and
            ``grad_match`` still read against ``g_full``.
        params: name → tensor to evaluate the terms at instead of the live parameters (e.g. the full
            tensors gathered from sharded ones).
        forward_context: a zero-argument factory of a context manager entered around ``credit_terms``
            (e.g. a trainer's autocast), so the audit evaluates the function the step trained.
        engine: ``"auto"`` (default: ``"ghost"`` for parts that are unions of whole rows, ``"jvp"`` for
            within-row parts with ``readings="projected"`` where installed, else ``"reference"``),
            ``"reference"`` (the engine documented here, the oracle), ``"ghost"`` or ``"jvp"``. See
            :mod:`lens_callbacks.credit.engines`; ``report.engine`` names the one that ran.
        readings: ``"all"`` (default), ``"shares"`` (no interference matrix) or ``"projected"``
            (projected shares only; an engine may then skip the norms). The reference engine always
            makes all readings, and the Gram of the parts (``report.gram``) only with ``keep_parts``.
        full_grad: the trainer's ``.grad`` of this very batch (one tensor per trainable parameter), to be
            ``g_full`` instead of the audit's own backward: the one-pass engine then forms no weight
            gradient of its own (``engine="ghost+grad"`` in the report; ``grad_match`` not read, since
            ``conservation_error`` now holds the parts against ``.grad`` directly), and the forward-mode
            engine runs its tangent pass alone (``"jvp+grad"``). Not the reference engine.
        verify_part: the one-pass engine also takes its largest part's gradient by its own masked backward
            and holds its readings to it (``True``), or does so only where it read the parts as spans of rows
            (``"spans"``: packed rollouts, where attention crossing the spans would make the reading wrong);
            a disagreement raises :class:`~lens_callbacks.credit.engines.ghost.SpansInteract` (or
            ``RowInteraction``).
        position_split: also split the step by the positions its gradient was computed at, every position by
            its segment, trained or not (``report.position_split``; the one-pass engine reads it in the same
            pass; any other engine leaves it unread, with the reason).
        along: with ``project_onto`` and ``readings="projected"``: hold the parts' sum against ``g_full`` along
            ``v`` alone, ``conservation_error = |Σ_S <g_S, v> − <g_full, v>| / (‖v‖ ‖g_full‖)`` (a lower bound
            of the full check, and all that readings along ``v`` depend on; the forward-mode engine's check is
            always this one). The one-pass engine then forms no ``Σ_S g_S``: each weight's parts cost one
            product. The reference engine checks the full sum either way. With ``full_grad`` it may be the sums
            themselves (``AlongSums``: ``‖g_full‖²``, ``<g_full, v>``, ``‖v‖²``, taken by the caller from
            ``full_grad`` and ``project_onto``, as the probe reading's pass over the optimizer's map does), which
            the one-pass and forward-mode engines read instead of a pass over both vectors of their own.

    Returns:
        A :class:`CreditReport`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Toy(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
        ...     def credit_terms(self, batch):
        ...         x, adv = batch                                  # x: [B, T, 2], adv: [B]
        ...         terms = -adv[:, None] * (x @ self.w)            # [B, T]
        ...         B, T = terms.shape
        ...         return CreditTerms(terms, torch.ones(B, T, dtype=torch.bool), torch.arange(B), torch.zeros(B, dtype=torch.long))
        >>> x = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
        >>> r = disintegrate(Toy(), (x, torch.tensor([1.0, 1.0], dtype=torch.float64)), dtype="float64")
        >>> r.projected_share, r.conservation_error
        ((0.5, 0.5), 0.0)
    """
    spec = resolve_partition(partition)
    if reference_grads is not None and not isinstance(reference_grads, (str, Mapping, list, tuple)):
        raise ValueError(
            f"`reference_grads` must be 'grad', a mapping name -> tensor, or a list of tensors, got {type(reference_grads).__name__}."
        )
    _check_engine(engine, readings)
    if along and (project_onto is None or readings != "projected" or keep_grads or keep_parts):
        raise ValueError(
            "`along=True` must come with `project_onto`, readings='projected' and no kept gradients, got "
            f"project_onto={'given' if project_onto is not None else None}, readings={readings!r}, "
            f"keep_grads={keep_grads!r}, keep_parts={keep_parts!r}; pass along=False for the full check."
        )
    if isinstance(along, AlongSums) and full_grad is None:
        raise ValueError(
            "`along` given as sums (AlongSums) must come with `full_grad`, the g_full they were taken from; pass "
            "along=True to have the engine take them from its own g_full."
        )
    if full_grad is not None and engine not in ("auto", "ghost", "jvp"):
        raise ValueError(
            f"`full_grad` needs engine='ghost', 'jvp' or 'auto' (the reference takes its own), got engine={engine!r}."
        )
    if engine != "reference":
        fast = _dispatch(
            module,
            batch,
            partition,
            spec,
            engine=engine,
            readings=readings,
            dtype=dtype,
            reference_grads=reference_grads,
            terms_fn=terms_fn,
            keep_grads=keep_grads,
            keep_parts=keep_parts,
            preserve_rng=preserve_rng,
            params=params,
            forward_context=forward_context,
            project_onto=project_onto,
            full_grad=full_grad,
            verify_part=verify_part,
            position_split=position_split,
            along=along,
        )
        if fast is not None:
            return _position_split_unread(fast, position_split)
    if full_grad is not None:
        raise ValueError(
            f"`full_grad` needs the one-pass engine, which cannot read this partition ({partition_label(partition)}): "
            "pass full_grad=None (g_full by the audit's own backward)."
        )
    with preserved_rng(module, preserve_rng):
        with forward_context() if forward_context is not None else contextlib.nullcontext():
            watch = precision_watch(module, dtype)
            terms, names, leaves, used = evaluate_terms(module, batch, dtype, terms_fn, params=params, watch=watch)
            compute = watch.coarser_than(used)
        onto = dots_onto(leaves, project_onto)
        part = apply_partition(spec, terms)
        ids = part.ids.to(terms.terms.device)

        with torch.enable_grad():
            loss = terms.terms.sum()
            # g_full by its own backward: never derived from the parts, else the audit is vacuous.
            g_full = leaf_grads(loss, leaves, retain=True)
            running = [torch.zeros_like(g) for g in g_full]
            dots: list[float] = []
            sq: list[float] = []
            kept: list[list[torch.Tensor]] = []
            for i in range(part.n_parts):
                mask = ids == i  # [B, T]
                loss_i = terms.terms.masked_select(mask).sum()
                g_i = leaf_grads(loss_i, leaves, retain=i < part.n_parts - 1)
                dots.append(flat_dot(g_i, g_full if onto is None else onto))
                sq.append(sq_norm(g_i))
                for r, g in zip(running, g_i):
                    r.add_(g)
                if keep_parts:
                    kept.append([g.detach().clone() for g in g_i])
                del g_i

    full_sq = sq_norm(g_full)
    full_norm = math.sqrt(full_sq)
    part_norm = tuple(math.sqrt(s) for s in sq)
    norm_total = math.fsum(part_norm)
    reason, projected, conservation, cancellation = share_readings(
        dots, full_sq, flat_diff_norm(running, g_full), norm_total, None if onto is None else sq_norm(onto)
    )
    norm_share = tuple(n / norm_total if norm_total > 0 else float("nan") for n in part_norm)

    grad_match = grad_match_to(module, names, reference_grads, g_full, full_norm)

    grads = None
    if keep_grads or keep_parts:
        grads = CreditGrads(
            tuple(names),
            [g.detach() for g in g_full],
            [r.detach() for r in running],
            kept if keep_parts else None,
        )
    return CreditReport(
        part_names=part.names,
        projected_share=projected,
        norm_share=norm_share,
        part_norm=part_norm,
        cancellation=cancellation,
        conservation_error=conservation,
        grad_match=grad_match,
        dtype=used,
        n_trained=terms.n_trained,
        full_grad_norm=full_norm,
        loss=float(loss.detach()),
        partition=partition_label(partition),
        reason=reason,
        grads=grads,
        engine="reference",
        readings="all",
        gram=gram_of(kept) if keep_parts else None,
        compute_dtype=compute,
        position_split=None
        if not position_split
        else PositionSplit(
            (),
            (),
            float("nan"),
            reason="the position split is read by the one-pass engine, and the reference engine made this reading",
        ),
    )


def _dispatch(
    module,
    batch,
    partition,
    spec,
    *,
    engine,
    readings,
    dtype,
    reference_grads,
    terms_fn,
    keep_grads,
    keep_parts,
    preserve_rng,
    params=None,
    forward_context=None,
    project_onto=None,
    full_grad=None,
    verify_part=False,
    position_split=False,
    along=False,
):
    """Run the engine ``engine`` names (``"auto"``: the fastest exact one); None means: the reference engine."""
    if keep_parts and engine != "auto":
        raise ValueError(f"`keep_parts=True` needs engine='reference' (it keeps every g_S), got engine={engine!r}.")
    name = "reference" if keep_parts else (choose_engine(spec, readings) if engine == "auto" else engine)
    if name == "ghost":
        try:
            return get_engine("ghost")(
                module,
                batch,
                partition,
                dtype=dtype,
                reference_grads=reference_grads,
                terms_fn=terms_fn,
                keep_grads=keep_grads,
                preserve_rng=preserve_rng,
                readings=readings,
                params=params,
                forward_context=forward_context,
                project_onto=project_onto,
                full_grad=full_grad,
                verify_part=verify_part,
                position_split=position_split,
                along=along,
            )
        except (NotRowSeparable, RowInteraction) as err:
            if engine != "auto" or isinstance(err, SpansInteract):
                raise  # packed rollouts whose attention crosses them: the training step has a bug to name
            # auto: the documented fallback. A split row goes to the within-row engine, mixing rows to the oracle.
            within = isinstance(err, NotRowSeparable) and readings == "projected"
            name = "jvp" if within and "jvp" in _engines_available() else "reference"
    if name == "jvp" and keep_grads:
        # the forward-mode engine forms no part gradient, so it has no Σ g_S to keep (a global DDP reading needs it)
        if engine == "jvp":
            raise ValueError(
                "`keep_grads=True` needs the parts' sum, which engine='jvp' never forms; use engine='reference'."
            )
        return None
    if name == "jvp":
        return get_engine("jvp")(
            module,
            batch,
            partition,
            dtype=dtype,
            reference_grads=reference_grads,
            terms_fn=terms_fn,
            preserve_rng=preserve_rng,
            readings=readings,
            params=params,
            forward_context=forward_context,
            project_onto=project_onto,
            full_grad=full_grad,
            along=along if isinstance(along, AlongSums) else None,
        )
    return None


def _position_split_unread(report: CreditReport, asked: bool) -> CreditReport:
    """The report, saying why its position split was not read when it was asked for and the engine could not."""
    if not asked or report.position_split is not None:
        return report
    why = f"the position split is read by the one-pass engine, and engine {report.engine!r} made this reading"
    return dataclasses.replace(report, position_split=PositionSplit((), (), float("nan"), reason=why))


def _check_engine(engine: str, readings: str) -> None:
    check_engine(engine, readings)


def _engines_available() -> tuple[str, ...]:
    return available_engines()
