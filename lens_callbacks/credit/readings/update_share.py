r"""Credit against the update the optimizer actually applied.

With ``Δθ = θ_before − θ_after`` of one optimizer step and ``g_S`` the gradient of part ``S`` at
``θ_before``, the update share of a part is

    ``u_S = <g_S, Δθ> / <g, Δθ>``,   ``g = Σ_S g_S``.

It sums to 1 for any optimizer (``<·, Δθ>`` is linear in ``g_S``), equals the projected share
``<g_S, g> / ‖g‖²`` under plain SGD (``Δθ = η·g``), and ``−<g_S, Δθ>`` is part ``S``'s share of the
first-order change of the loss over the step, ``L(θ_after) − L(θ_before) ≈ −<g, Δθ>``.

What it is not: with Adam or momentum the update is not the gradient direction, so a part can hold
a large projected share and a small update share (the preconditioner or the momentum moved the step
elsewhere); and it is first-order, so it says nothing about the curvature of the step. When
``<g, Δθ>`` is zero or not finite (a skipped step, an update orthogonal to the gradient) the shares are
undefined: NaN with a reason.

All ``<g_S, Δθ>`` come from one forward-mode pass of ``credit_terms`` along ``Δθ`` at ``θ_before``
(:func:`~lens_callbacks.credit.engines.jvp.terms_jvp`), whatever the number of parts; ``<g, Δθ>``
from ``g`` by its own backward pass, so ``Σ_S <g_S, Δθ>`` against it is a conservation check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from ..engine import DTypeSpec, evaluate_terms, flat_dot, leaf_grads, partition_label, preserved_rng, sq_norm
from ..engines.jvp import _replayed_rng, _rng_snapshot, part_sums, terms_jvp
from ..inputs.partition import Partition, PartitionFn, apply_partition, resolve_partition
from ..inputs.terms import CreditTerms

__all__ = ["UpdateShareReport", "update_shares"]


@dataclass(frozen=True)
class UpdateShareReport:
    r"""Each part's share of the step the optimizer took, at the parameters before it.

    Attributes:
        part_names: one name per part.
        update_share: ``u_S = <g_S, Δθ> / <g, Δθ>`` per part (sums to 1; may be negative).
        part_update_dot: ``<g_S, Δθ>`` per part (from the forward-mode pass).
        update_dot: ``<g, Δθ>`` (from ``g``'s own backward pass).
        update_norm: ``‖Δθ‖``.
        full_grad_norm: ``‖g‖`` at ``θ_before``.
        conservation_error: ``|Σ_S <g_S, Δθ> − <g, Δθ>| / |<g, Δθ>|``.
        dtype: the dtype the audit ran in.
        n_trained: trained positions.
        partition: the partition's name.
        reason: why the shares are undefined (``None`` when defined).

    Example:
        >>> r = UpdateShareReport(("a", "b"), (0.75, 0.25), (3.0, 1.0), 4.0, 2.0, 4.0, 0.0, "float64", 5)
        >>> r.to_dict("credit/")["credit/update_share/a"], r.update_grad_cosine
        (0.75, 0.5)
    """

    part_names: tuple[str, ...]
    update_share: tuple[float, ...]
    part_update_dot: tuple[float, ...]
    update_dot: float
    update_norm: float
    full_grad_norm: float
    conservation_error: float
    dtype: str
    n_trained: int
    partition: str = ""
    reason: Optional[str] = None

    @property
    def n_parts(self) -> int:
        return len(self.part_names)

    @property
    def ok(self) -> bool:
        """Whether the shares are defined (``<g, Δθ>`` non-zero and finite)."""
        return self.reason is None

    @property
    def share_sum(self) -> float:
        return math.fsum(self.update_share)

    @property
    def update_grad_cosine(self) -> float:
        """``<g, Δθ> / (‖g‖ ‖Δθ‖)``: 1 under plain SGD; how far the optimizer turned the step from ``g``."""
        den = self.full_grad_norm * self.update_norm
        return self.update_dot / den if den > 0 and math.isfinite(den) else float("nan")

    def share(self, name: str) -> float:
        return self.update_share[self.part_names.index(name)]

    def to_dict(self, prefix: str = "credit/", max_parts: Optional[int] = None) -> dict[str, float]:
        """Flat scalars for loggers; per-part shares for the first ``max_parts`` parts (all if None)."""
        out = {
            f"{prefix}update_share_sum": float(self.share_sum),
            f"{prefix}update_conservation_error": float(self.conservation_error),
            f"{prefix}update_grad_cosine": float(self.update_grad_cosine),
            f"{prefix}update_undefined": 0.0 if self.ok else 1.0,
        }
        k = self.n_parts if max_parts is None else min(max_parts, self.n_parts)
        for i in range(k):
            out[f"{prefix}update_share/{self.part_names[i]}"] = float(self.update_share[i])
        return out

    def render(self, max_rows: int = 64) -> str:
        """A readable table: one row per part, then the closing checks."""
        w = max([len("part")] + [len(n) for n in self.part_names[:max_rows]])
        head = f"{'part':<{w}}  {'update_share':>12}  {'<g_S, Δθ>':>12}"
        lines = [
            f"credit against the applied update, by {self.partition or 'partition'} ({self.n_parts} parts, "
            f"{self.n_trained} trained positions, {self.dtype})",
            head,
            "-" * len(head),
        ]
        for i, name in enumerate(self.part_names[:max_rows]):
            lines.append(f"{name:<{w}}  {self.update_share[i]:>12.6f}  {self.part_update_dot[i]:>12.4e}")
        if self.n_parts > max_rows:
            lines.append(f"... {self.n_parts - max_rows} more parts")
        lines.append("-" * len(head))
        lines.append(f"{'sum':<{w}}  {self.share_sum:>12.6f}")
        lines.append(
            f"<g, Δθ> {self.update_dot:.4e}, ||Δθ|| {self.update_norm:.4e}, cos(g, Δθ) {self.update_grad_cosine:.4f} "
            "(1 under plain SGD)"
        )
        lines.append(
            f"conservation_error {self.conservation_error:.3e} (Σ_S <g_S, Δθ> by forward mode vs <g, Δθ> by backward)"
        )
        if self.reason:
            lines.append(f"UNDEFINED: {self.reason}")
        return "\n".join(lines)


def update_shares(
    module: nn.Module,
    batch: Any,
    partition: Union[str, PartitionFn, Partition],
    theta_before: Mapping[str, torch.Tensor],
    theta_after: Optional[Mapping[str, torch.Tensor]] = None,
    *,
    dtype: DTypeSpec = "float32",
    terms_fn: Optional[Callable[[Any], CreditTerms]] = None,
    preserve_rng: bool = True,
) -> UpdateShareReport:
    r"""Each part's share of the applied update ``Δθ = θ_before − θ_after``, at ``θ_before``.

    ``u_S = <g_S, Δθ> / <g, Δθ>``: one backward pass for ``g`` and one forward-mode pass of
    ``credit_terms`` along ``Δθ`` for every ``<g_S, Δθ>``, both at ``θ_before`` and under the same
    random state (the same dropout masks). The module's parameters, ``.grad`` and the random stream
    are left as they were.

    Args:
        module: an ``nn.Module`` implementing ``credit_terms(batch) -> CreditTerms``; every op of its
            forward needs a forward-mode derivative (transformers: ``attn_implementation="eager"``).
        batch: the batch the step trained on.
        partition: a partition name, callable or :class:`Partition` (rows or positions inside rows).
        theta_before: name → tensor for every trainable parameter, before the optimizer step.
        theta_after: name → tensor after it (default: the module's live parameters).
        dtype: the audit dtype; ``Δθ`` is taken in float64 and then cast to it.
        terms_fn: use this instead of ``module.credit_terms``.
        preserve_rng: leave the global random stream as it was.

    Returns:
        An :class:`UpdateShareReport`.

    Example:
        >>> class Toy(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
        ...     def credit_terms(self, x):                                  # x: [2, 1, 2]
        ...         t = -(x @ self.w)                                       # [2, 1]
        ...         return CreditTerms(t, torch.ones(2, 1, dtype=torch.bool), torch.arange(2), torch.zeros(2, dtype=torch.long))
        >>> m, x = Toy(), torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
        >>> before = {"w": m.w.detach().clone()}
        >>> with torch.no_grad():
        ...     m.w += torch.tensor([0.3, 0.1], dtype=torch.float64)           # not the gradient direction
        >>> r = update_shares(m, x, "by_rollout", before, dtype="float64")
        >>> [round(u, 12) for u in r.update_share], r.share_sum
        ([0.75, 0.25], 1.0)
    """
    spec = resolve_partition(partition)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    missing = [n for n in trainable if n not in theta_before]
    if missing:
        raise ValueError(
            f"`theta_before` must hold every trainable parameter, got none for {missing[:5]!r}; copy them "
            "before the optimizer step (`{n: p.detach().clone() for n, p in module.named_parameters()}`)."
        )
    live = dict(module.named_parameters())
    after = theta_after if theta_after is not None else {n: live[n] for n in trainable}
    missing = [n for n in trainable if n not in after]
    if missing:
        raise ValueError(f"`theta_after` must hold every trainable parameter, got none for {missing[:5]!r}.")
    with preserved_rng(module, preserve_rng):
        start = _rng_snapshot(module)
        terms, names, leaves, used = evaluate_terms(module, batch, dtype, terms_fn, params=theta_before)
        part = apply_partition(spec, terms)
        n_trained = terms.n_trained
        with torch.enable_grad():
            g = leaf_grads(terms.terms.sum(), leaves, retain=False)
        del terms, leaves
        # Δθ in float64 first: a difference of rounded parameters loses most of its digits in float32.
        delta = {
            n: (theta_before[n].detach().double() - after[n].detach().to(theta_before[n].device).double()).to(x.dtype)
            for n, x in zip(names, g)
        }
        with _replayed_rng(module, start):
            _, tangent = terms_jvp(module, batch, delta, dtype, terms_fn, params=theta_before)
    dots = part_sums(tangent, part)
    dvec = [delta[n] for n in names]
    full = flat_dot(g, dvec)
    gnorm = math.sqrt(sq_norm(g))
    unorm = math.sqrt(sq_norm(dvec))
    gap = abs(math.fsum(dots) - full)
    nan = float("nan")
    reason: Optional[str] = None
    if not math.isfinite(full):
        reason = f"<g, Δθ> is not finite ({full}); update shares are undefined this step."
    elif full == 0.0:
        reason = (
            "<g, Δθ> is zero (no update was applied, or it is orthogonal to the gradient); update shares are "
            "undefined this step."
        )
    if reason is None:
        shares = tuple(d / full for d in dots)
        conservation = gap / abs(full)
    else:
        shares = tuple(nan for _ in dots)
        conservation = gap if math.isfinite(full) else nan
    return UpdateShareReport(
        part_names=part.names,
        update_share=shares,
        part_update_dot=tuple(dots),
        update_dot=full,
        update_norm=unorm,
        full_grad_norm=gnorm,
        conservation_error=conservation,
        dtype=used,
        n_trained=n_trained,
        partition=partition_label(partition),
        reason=reason,
    )
