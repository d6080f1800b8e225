"""The reference disintegration engine: one backward pass per part, plus an independent full one.

What this cannot do:
The conservation identity is a claim about the optimizer, so step_conservation refuses to assert it
for any optimizer outside the exact set. The disintegration is a statement about this gradient at
these parameters, so it says where the step went and not what any part of the trajectory contributed
to the run as a whole. And every number here is first-order: removing a turn does not remove its
share, because removing it changes every downstream position.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .partition import Partition, PartitionFn, apply_partition, resolve_partition
from .report import CreditGrads, CreditReport, share_readings
from .terms import CreditTerms, validate_terms

__all__ = ["disintegrate", "resolve_dtype", "evaluate_terms", "DTypeSpec"]

DTypeSpec = Union[str, torch.dtype, None]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: DTypeSpec) -> Optional[torch.dtype]:
    """``"float32"`` (default), ``"float64"``, ``"bfloat16"``, a ``torch.dtype``, or ``"native"``/None."""
    if dtype is None or dtype == "native":
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating dtype, got {dtype!r}.")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(
        f"`dtype` must be one of 'float32', 'float64', 'bfloat16', 'float16', 'native' or a torch.dtype, got {dtype!r}."
    )


class _TermsCall(nn.Module):
    """Routes ``functional_call`` to ``credit_terms`` so the audit never touches the live parameters."""

    def __init__(self, inner: nn.Module, fn: Callable[[Any], CreditTerms]) -> None:
        super().__init__()
        self.inner = inner
        self._fn = fn

    def forward(self, batch: Any) -> CreditTerms:
        return self._fn(batch)


def _rng_devices(module: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def _preserved_rng(module: nn.Module, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    with torch.random.fork_rng(devices=_rng_devices(module)):
        yield


def evaluate_terms(
    module: nn.Module,
    batch: Any,
    dtype: DTypeSpec = "float32",
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
) -> tuple[CreditTerms, list[str], list[torch.Tensor], str]:
    """Run ``credit_terms`` on detached (optionally cast) copies of the parameters.

    Returns ``(terms, names, leaves, dtype_used)`` where ``leaves`` are the trainable parameter copies the
    terms' graph hangs from. The module's own parameters, ``.grad`` and buffers are never modified: the
    copies are swapped in through :func:`torch.func.functional_call`. ``params`` (name → tensor)
    evaluates the terms at other weights (e.g. an anchor's snapshot) instead of the live ones.
    """
    fn = terms_fn if terms_fn is not None else getattr(module, "credit_terms", None)
    if fn is None or not callable(fn):
        raise TypeError(
            f"`module` must implement `credit_terms(batch) -> CreditTerms` (see lens_callbacks.credit.CreditSource), "
            f"got {type(module).__name__} without it; or pass `terms_fn`."
        )
    target = resolve_dtype(dtype)
    names: list[str] = []
    leaves: list[torch.Tensor] = []
    state: dict[str, torch.Tensor] = {}
    if params is not None:
        unknown = sorted(set(params) - {n for n, _ in module.named_parameters()})
        if unknown:
            raise ValueError(f"`params` must name parameters of the module, got unknown names {unknown[:5]!r}.")
    for name, p in module.named_parameters():
        q = (params[name] if params is not None and name in params else p).detach()
        if target is not None and q.is_floating_point() and q.dtype != target:
            q = q.to(target)
        if p.requires_grad:
            # A fresh leaf over the same storage (or the cast copy): gradients land here, never in p.grad.
            q = q.detach().requires_grad_(True)
            names.append(name)
            leaves.append(q)
        state["inner." + name] = q
    if target is not None:
        for name, b in module.named_buffers():
            if b.is_floating_point() and b.dtype != target:
                state["inner." + name] = b.to(target)
    used = str(target if target is not None else _native_dtype(module)).replace("torch.", "")
    wrapper = _TermsCall(module, fn)
    with torch.enable_grad():
        terms = torch.func.functional_call(wrapper, state, (batch,), strict=False)
    validate_terms(terms)  # the contract is checked here, not at construction inside the training step
    return terms, names, leaves, used


def _native_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _grad(loss: torch.Tensor, leaves: Sequence[torch.Tensor], retain: bool) -> list[torch.Tensor]:
    if not loss.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    gs = torch.autograd.grad(loss, leaves, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return math.fsum(float(torch.sum(x.double() * y.double())) for x, y in zip(a, b))


def _sqnorm(a: Sequence[torch.Tensor]) -> float:
    return math.fsum(float(torch.sum(x.double() ** 2)) for x in a)


def _diff_norm(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(torch.sum((x.double() - y.double()) ** 2)) for x, y in zip(a, b)))


def _partition_name(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Partition):
        return "custom"
    return getattr(spec, "__name__", type(spec).__name__)


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
) -> CreditReport:
    r"""Split the step's gradient into exact parts, one backward pass per part.

    For a partition ``S_1 … S_m`` of the trained positions, ``g_S = ∇θ Σ_{(k,t)∈S} terms[k,t]``, so
    ``Σ_S g_S = ∇θ Σ terms = g_full`` by linearity. ``g_full`` is taken by its own backward pass and the
    gap is reported as ``conservation_error``. Peak memory: three parameter-sized buffers (``g_full``,
    the running sum, the current part) plus the activations of one forward pass.

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
            :mod:`lens_callbacks.credit.distributed`). ``cancellation``, ``conservation_error`` and
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
            ``conservation_error`` now holds the parts against ``.grad`` directly). One-pass engine only.

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
    if project_onto is not None and engine not in ("auto", "reference", "ghost"):
        raise ValueError(f"`project_onto` needs engine='reference', 'ghost' or 'auto', got engine={engine!r}.")
    if full_grad is not None and engine not in ("auto", "ghost"):
        raise ValueError(f"`full_grad` needs engine='ghost' (or 'auto' on a row partition), got engine={engine!r}.")
    if engine != "reference":
        fast = _dispatch(
            module, batch, partition, spec, engine=engine, readings=readings, dtype=dtype,
            reference_grads=reference_grads, terms_fn=terms_fn, keep_grads=keep_grads, keep_parts=keep_parts,
            preserve_rng=preserve_rng, params=params, forward_context=forward_context, project_onto=project_onto,
            full_grad=full_grad,
        )
        if fast is not None:
            return fast
    if full_grad is not None:
        raise ValueError(
            f"`full_grad` needs the one-pass engine, which cannot read this partition ({_partition_name(partition)}): "
            "pass full_grad=None (g_full by the audit's own backward)."
        )
    with _preserved_rng(module, preserve_rng):
        with (forward_context() if forward_context is not None else contextlib.nullcontext()):
            terms, names, leaves, used = evaluate_terms(module, batch, dtype, terms_fn, params=params)
        onto = _onto(leaves, project_onto)
        part = apply_partition(spec, terms)
        ids = part.ids.to(terms.terms.device)

        with torch.enable_grad():
            loss = terms.terms.sum()
            # g_full by its own backward: never derived from the parts, else the audit is vacuous.
            g_full = _grad(loss, leaves, retain=True)
            running = [torch.zeros_like(g) for g in g_full]
            dots: list[float] = []
            sq: list[float] = []
            kept: list[list[torch.Tensor]] = []
            for i in range(part.n_parts):
                mask = ids == i  # [B, T]
                loss_i = terms.terms.masked_select(mask).sum()
                g_i = _grad(loss_i, leaves, retain=i < part.n_parts - 1)
                dots.append(_dot(g_i, g_full if onto is None else onto))
                sq.append(_sqnorm(g_i))
                for r, g in zip(running, g_i):
                    r.add_(g)
                if keep_parts:
                    kept.append([g.detach().clone() for g in g_i])
                del g_i

    full_sq = _sqnorm(g_full)
    full_norm = math.sqrt(full_sq)
    part_norm = tuple(math.sqrt(s) for s in sq)
    norm_total = math.fsum(part_norm)
    reason, projected, conservation, cancellation = share_readings(
        dots, full_sq, _diff_norm(running, g_full), norm_total, None if onto is None else _sqnorm(onto)
    )
    norm_share = tuple(n / norm_total if norm_total > 0 else float("nan") for n in part_norm)

    grad_match = _grad_match(module, names, reference_grads, g_full, full_norm)

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
        partition=_partition_name(partition),
        reason=reason,
        grads=grads,
        engine="reference",
        readings="all",
        gram=_gram(kept) if keep_parts else None,
    )


def _onto(
    leaves: Sequence[torch.Tensor], vec: Optional[Sequence[Optional[torch.Tensor]]], name: str = "project_onto"
) -> Optional[list[torch.Tensor]]:
    if vec is None:
        return None
    vec = list(vec)
    if len(vec) != len(leaves):
        raise ValueError(
            f"`{name}` must hold one tensor per trainable parameter ({len(leaves)}), got {len(vec)}; "
            "align it with [p for p in module.parameters() if p.requires_grad]."
        )
    out = []
    for x, v in zip(leaves, vec):
        if v is None:
            out.append(torch.zeros_like(x))
        elif tuple(v.shape) != tuple(x.shape):
            raise ValueError(f"`{name}` entries must match their parameter's shape {list(x.shape)}, got {list(v.shape)}.")
        else:
            out.append(v.detach().to(x.device))  # the dots are taken in float64 whatever the dtype
    return out
def _gram(parts: Sequence[Sequence[torch.Tensor]]) -> tuple[tuple[float, ...], ...]:
    """``<g_S, g_S'>`` of kept parts, summed parameter by parameter in float64."""
    return tuple(tuple(_dot(a, b) for b in parts) for a in parts)


def _dispatch(module, batch, partition, spec, *, engine, readings, dtype, reference_grads, terms_fn, keep_grads, keep_parts, preserve_rng, params=None, forward_context=None, project_onto=None, full_grad=None):
    """Run the engine ``engine`` names (``"auto"``: the fastest exact one); None means: the reference engine.

    ``params``, ``forward_context`` and ``project_onto`` reach the one-pass engine; the forward-mode
    engine takes none of them, so with any set ``"auto"`` reads within-row parts with the reference engine.
    """
    import dataclasses

    from .engines import choose_engine, get_engine
    from .engines.ghost import NotRowSeparable, RowInteraction

    if keep_parts and engine != "auto":
        raise ValueError(f"`keep_parts=True` needs engine='reference' (it keeps every g_S), got engine={engine!r}.")
    name = "reference" if keep_parts else (choose_engine(spec, readings) if engine == "auto" else engine)
    if name == "ghost":
        try:
            return get_engine("ghost")(
                module, batch, partition, dtype=dtype, reference_grads=reference_grads, terms_fn=terms_fn,
                keep_grads=keep_grads, preserve_rng=preserve_rng, readings=readings,
                params=params, forward_context=forward_context, project_onto=project_onto, full_grad=full_grad,
            )
        except (NotRowSeparable, RowInteraction) as err:
            if engine != "auto":
                raise
            # auto: the documented fallback. A split row goes to the within-row engine, mixing rows to the oracle.
            within = isinstance(err, NotRowSeparable) and readings == "projected"
            name = "jvp" if within and "jvp" in _engines_available() else "reference"
    if name == "jvp" and (params is not None or forward_context is not None or project_onto is not None or full_grad is not None):
        if engine != "auto":
            raise ValueError("engine='jvp' takes none of `params`, `forward_context`, `project_onto`; use engine='reference' or 'auto'.")
        return None
    if name == "jvp":
        report = get_engine("jvp")(
            module, batch, partition, dtype=dtype, reference_grads=reference_grads, terms_fn=terms_fn,
            preserve_rng=preserve_rng, readings=readings,
        )
        return dataclasses.replace(report, engine="jvp", readings=readings)
    return None


def _check_engine(engine: str, readings: str) -> None:
    from .engines import check_engine

    check_engine(engine, readings)


def _engines_available() -> tuple[str, ...]:
    from .engines import available_engines

    return available_engines()


def _grad_match(
    module: nn.Module,
    names: Sequence[str],
    reference_grads: Any,
    g_full: Sequence[torch.Tensor],
    full_norm: float,
) -> Optional[float]:
    """``||g_full − ref|| / ||g_full||`` against ``reference_grads`` (None when there is nothing to compare)."""
    if reference_grads is None:
        return None
    ref = _reference(module, names, reference_grads)
    if ref is None:
        return None
    ref = [r.to(g.device, g.dtype) if r is not None else torch.zeros_like(g) for r, g in zip(ref, g_full)]
    return _diff_norm(g_full, ref) / full_norm if full_norm > 0 and math.isfinite(full_norm) else float("nan")


def _reference(
    module: nn.Module, names: Sequence[str], ref: Union[str, Mapping[str, torch.Tensor], Sequence[Optional[torch.Tensor]]]
) -> Optional[list[Optional[torch.Tensor]]]:
    if isinstance(ref, str):
        if ref != "grad":
            raise ValueError(f"`reference_grads` must be 'grad' when a string, got {ref!r}.")
        params = dict(module.named_parameters())
        grads = [params[n].grad for n in names]
        return None if all(g is None for g in grads) else grads
    if isinstance(ref, Mapping):
        return [ref.get(n) for n in names]
    ref = list(ref)
    if len(ref) != len(names):
        raise ValueError(f"`reference_grads` must hold one tensor per trainable parameter ({len(names)}), got {len(ref)}.")
    return ref
