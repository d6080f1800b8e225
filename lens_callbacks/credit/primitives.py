"""Primitives every disintegration engine shares: evaluating the terms, dtypes, the random stream, ``g_full``
held against a reference (``grad_match``), ``project_onto``, and float64 dots of parameter lists.

Below both the dispatcher (:mod:`lens_callbacks.credit.engine`) and the engines
(:mod:`lens_callbacks.credit.engines`), so that neither imports the other for these.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .engines.reductions import diff_sq64, dot64, inner64, sq64
from .inputs.partition import Partition
from .inputs.terms import CreditTerms, validate_terms
from .precision import GRAPH_DTYPES, PrecisionWatch, autocast_dtype

__all__ = [
    "DTypeSpec",
    "DTYPE_NAMES",
    "resolve_dtype",
    "evaluate_terms",
    "audit_passes",
    # the engines' shared pieces (public inside the package: every engine and reading imports them)
    "TermsCall",
    "dots_onto",
    "flat_diff_norm",
    "flat_dot",
    "gram_of",
    "grad_match_to",
    "leaf_grads",
    "native_dtype",
    "partition_label",
    "preserved_rng",
    "reference_parts",
    "rng_devices",
    "sq_norm",
]

DTypeSpec = Union[str, torch.dtype, None]

DTYPE_NAMES = {
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
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(
        f"`dtype` must be one of 'float32', 'float64', 'bfloat16', 'float16', 'native' or a torch.dtype, got {dtype!r}."
    )


class TermsCall(nn.Module):
    """Routes ``functional_call`` to ``credit_terms`` so the audit never touches the live parameters."""

    def __init__(self, inner: nn.Module, fn: Callable[[Any], CreditTerms]) -> None:
        super().__init__()
        self.inner = inner
        self._fn = fn

    def forward(self, batch: Any) -> CreditTerms:
        return self._fn(batch)


class _NonReentrantCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` during an audit's passes.

    Reentrant checkpointing (``checkpoint(..., use_reentrant=True)``, transformers'
    ``gradient_checkpointing_kwargs={"use_reentrant": True}``) refuses ``torch.autograd.grad`` and
    recomputes its forward inside the backward, out of sight of forward hooks. An audit's own pass runs
    the same function through the non-reentrant implementation instead (same values, same recomputation
    of activations in the backward); without grad (a forward-mode pass) nothing is saved, so the
    function simply runs."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args)
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )


@contextlib.contextmanager
def audit_passes() -> Iterator[None]:
    """What every forward of an audit runs under, so that it evaluates the function the step trained.

    - ``torch.compile``: compiled modules and functions run eagerly (``torch.compiler.set_stance("force_eager")``).
      An audit swaps parameter copies in through ``functional_call`` and takes several gradients of one
      graph; through an inductor-compiled module that returns parts whose sum is off by percents
      (``tests/credit/test_audit_passes.py`` keeps the plain-torch reproduction). Eager, they are exact, and
      the compiled code and its caches are never touched by the audit.
    - reentrant activation checkpointing runs as non-reentrant (:class:`_NonReentrantCheckpoint`).

    Nothing of the module changes; both settings are restored on exit.
    """
    import torch.utils.checkpoint as ckpt

    before = ckpt.CheckpointFunction
    ckpt.CheckpointFunction = _NonReentrantCheckpoint  # type: ignore[misc, assignment]
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        ckpt.CheckpointFunction = before  # type: ignore[misc]


def compiled_parts(module: nn.Module) -> list[str]:
    """Names of the parts of ``module`` that ``torch.compile`` wraps ("" for the module itself): an
    ``OptimizedModule``, a module compiled in place (``module.compile()``), or a LightningModule compiled
    by Lightning (``trainer.fit(torch.compile(model))`` keeps the compile context on the module)."""
    from torch._dynamo.eval_frame import OptimizedModule

    out = []
    for name, mod in module.named_modules():
        if (
            isinstance(mod, OptimizedModule)
            or getattr(mod, "_compiled_call_impl", None) is not None
            or (getattr(mod, "_compiler_ctx", None) is not None)
        ):
            out.append(name)
    return out


def rng_devices(module: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def preserved_rng(module: nn.Module, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    with torch.random.fork_rng(devices=rng_devices(module)):
        yield


def detached_state(
    module: nn.Module,
    target: Optional[torch.dtype],
    params: Optional[Mapping[str, torch.Tensor]] = None,
    requires_grad: bool = True,
) -> tuple[list[str], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Detached (cast to ``target`` when given) copies of the module's parameters and floating buffers.

    Returns ``(names, leaves, state)``: the trainable parameters' names and their fresh leaves, and the
    state for :func:`torch.func.functional_call` on a :class:`TermsCall` (keys ``"inner." + name``).
    ``params`` (name → tensor) stands in for the live value of the parameters it names.
    """
    names: list[str] = []
    leaves: list[torch.Tensor] = []
    state: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        q = (params[name] if params is not None and name in params else p).detach()
        if target is not None and q.is_floating_point() and q.dtype != target:
            q = q.to(target)
        if p.requires_grad:
            # A fresh leaf over the same storage (or the cast copy): gradients land here, never in p.grad.
            q = q.detach().requires_grad_(requires_grad)
            names.append(name)
            leaves.append(q)
        state["inner." + name] = q
    if target is not None:
        for name, b in module.named_buffers():
            if b.is_floating_point() and b.dtype != target:
                state["inner." + name] = b.to(target)
    return names, leaves, state


def evaluate_terms(
    module: nn.Module,
    batch: Any,
    dtype: DTypeSpec = "float32",
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    watch: Optional[PrecisionWatch] = None,
) -> tuple[CreditTerms, list[str], list[torch.Tensor], str]:
    """Run ``credit_terms`` on detached (optionally cast) copies of the parameters.

    Returns ``(terms, names, leaves, dtype_used)`` where ``leaves`` are the trainable parameter copies the
    terms' graph hangs from. The module's own parameters, ``.grad`` and buffers are never modified: the
    copies are swapped in through :func:`torch.func.functional_call`. ``params`` (name → tensor)
    evaluates the terms at other weights (e.g. an anchor's snapshot) instead of the live ones. ``watch``
    (a :class:`~lens_callbacks.credit.precision.PrecisionWatch`) records the coarsest dtype the forward
    computed the gradient's values in.
    """
    fn = terms_fn if terms_fn is not None else getattr(module, "credit_terms", None)
    if fn is None or not callable(fn):
        raise TypeError(
            f"`module` must implement `credit_terms(batch) -> CreditTerms` (see lens_callbacks.credit.CreditSource), "
            f"got {type(module).__name__} without it; or pass `terms_fn`."
        )
    target = resolve_dtype(dtype)
    if params is not None:
        unknown = sorted(set(params) - {n for n, _ in module.named_parameters()})
        if unknown:
            raise ValueError(f"`params` must name parameters of the module, got unknown names {unknown[:5]!r}.")
    names, leaves, state = detached_state(module, target, params)
    used = str(target if target is not None else native_dtype(module)).replace("torch.", "")
    wrapper = TermsCall(module, fn)
    by_graph = watch is not None and GRAPH_DTYPES  # read off the graph afterwards: nothing per op of the forward
    with torch.enable_grad(), audit_passes(), watch if watch is not None and not by_graph else contextlib.nullcontext():
        terms = torch.func.functional_call(wrapper, state, (batch,), strict=False)
    validate_terms(terms)  # the contract is checked here, not at construction inside the training step
    if by_graph:
        watch.see_graph(terms.terms)
    return terms, names, leaves, used


def compute_dtype_now(module: nn.Module) -> Optional[str]:
    """The autocast dtype in force for ``module``'s device right now (``"bfloat16"``), or None when autocast is off.

    Called inside an audit's ``forward_context``: the reading's rounding is then that of this dtype."""
    p = next(iter(module.parameters()), None)
    d = autocast_dtype(p.device if p is not None else None)
    return None if d is None else str(d).replace("torch.", "")


def precision_watch(module: nn.Module, dtype: DTypeSpec) -> PrecisionWatch:
    """A :class:`~lens_callbacks.credit.precision.PrecisionWatch` that knows the audit's own dtype (ops in it, or
    finer, are passed over at once)."""
    return PrecisionWatch(resolve_dtype(dtype) or native_dtype(module))


def native_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def leaf_grads(loss: torch.Tensor, leaves: Sequence[torch.Tensor], retain: bool) -> list[torch.Tensor]:
    if not loss.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    gs = torch.autograd.grad(loss, leaves, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)]


def flat_dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], exact: bool = True) -> float:
    """``<a, b>`` over parameter lists, every product in float64 (block by block: no float64 copy of a parameter).

    ``exact=False``: products in the parameters' dtype, cascade-summed per block, the blocks in float64
    (:func:`~.engines.reductions.inner64`: ~1e-8 relative in float32, at a fraction of the memory traffic)."""
    xs = [dot64(x, y) if exact else inner64(x, y) for x, y in zip(a, b)]
    return float(torch.stack([x.cpu() for x in xs]).sum()) if xs else 0.0


def sq_norm(a: Sequence[torch.Tensor], exact: bool = True) -> float:
    return flat_dot(a, a, exact)


def flat_diff_norm(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """``‖a − b‖`` over parameter lists, the differences in the wider dtype, their squares summed in float64."""
    xs = [diff_sq64(x, y) for x, y in zip(a, b)]
    return math.sqrt(float(torch.stack([x.cpu() for x in xs]).sum())) if xs else 0.0


def partition_label(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Partition):
        return "custom"
    return getattr(spec, "__name__", type(spec).__name__)


def dots_onto(
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
            raise ValueError(
                f"`{name}` entries must match their parameter's shape {list(x.shape)}, got {list(v.shape)}."
            )
        else:
            out.append(v.detach().to(x.device))  # the dots are taken in float64 whatever the dtype
    return out


def gram_of(parts: Sequence[Sequence[torch.Tensor]]) -> tuple[tuple[float, ...], ...]:
    """``<g_S, g_S'>`` of kept parts, summed parameter by parameter in float64."""
    return tuple(tuple(flat_dot(a, b) for b in parts) for a in parts)


def grad_match_to(
    module: nn.Module,
    names: Sequence[str],
    reference_grads: Any,
    g_full: Sequence[torch.Tensor],
    full_norm: float,
) -> Optional[float]:
    """``||g_full − ref|| / ||g_full||`` against ``reference_grads`` (None when there is nothing to compare)."""
    if reference_grads is None:
        return None
    ref = reference_parts(module, names, reference_grads)
    if ref is None:
        return None
    if not (full_norm > 0 and math.isfinite(full_norm)):
        return float("nan")
    # block by block in float64 (no float64 copy of a parameter: three of them were the separate pass's
    # peak on a 136 M-element tied head)
    sq = []
    for r, g in zip(ref, g_full):
        if r is None:
            sq.append(sq64(g))
            continue
        wide = torch.promote_types(g.dtype, r.dtype)  # a float32 audit against a float64 .grad: compared in float64
        sq.append(diff_sq64(g.to(wide), r.to(g.device, wide)))
    return math.sqrt(float(torch.stack(sq).sum())) / full_norm if sq else 0.0


def reference_parts(
    module: nn.Module,
    names: Sequence[str],
    ref: Union[str, Mapping[str, torch.Tensor], Sequence[Optional[torch.Tensor]]],
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
        raise ValueError(
            f"`reference_grads` must hold one tensor per trainable parameter ({len(names)}), got {len(ref)}."
        )
    return ref
