r"""Global readings of a data-parallel step: the parts of every rank against the gradient applied.

Under data parallelism (DDP, FSDP) with ``W`` ranks the optimizer applies the rank average
``ḡ = (1/W) Σ_r g_r`` of the local gradients. Rank ``r``'s part ``S`` of that step is
``g_{r,S} / W``, so

- ``projected_share[r, S] = <g_{r,S}, ḡ> / (W · ||ḡ||²)``: each rank dots its own parts with the
  averaged ``.grad`` it already holds (``disintegrate(..., project_onto=ḡ)``), and only these scalars
  travel; they sum to 1 over all ranks up to ``grad_match``;
- ``cancellation = Σ_{r,S} ||g_{r,S}|| / (W · ||G||)`` with ``G = (1/W) Σ_r g_full_r`` the audit's own
  global gradient: the local norms travel as scalars;
- ``conservation_error = ||(1/W) Σ_r (Σ_S g_{r,S} − g_full_r)|| / ||G||`` and
  ``grad_match = ||G − ḡ|| / ||G||`` need the cross-rank sum of parameter-sized vectors (``||Σ_r x_r||``
  has cross terms): one all-reduce of ``[g_full_r, Σ_S g_{r,S} − g_full_r]`` (``2·|θ|`` elements) per
  audited step.

Nothing here knows a trainer: the caller hands in :class:`Collectives` (e.g. built from a Lightning
strategy's ``all_gather`` and ``reduce``). Every rank must call :func:`global_report` on the same steps,
also a rank whose local audit failed (it passes ``None``): the collectives then run on every rank, and
every rank returns the same :class:`~lens_callbacks.refusal.Refusal`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ...refusal import Refusal
from ..inputs.partition import POSITIONAL_PARTITIONS, Partition
from ..inputs.terms import CreditTerms
from ..report import CreditGrads, CreditReport
from .derived import PartitionShares, coarsening, derive_shares, rows_per_part

__all__ = ["Collectives", "global_report", "global_part_name", "global_extra_shares"]


@dataclass(frozen=True)
class Collectives:
    """The two collectives a global reading needs.

    Attributes:
        rank: this process's rank.
        world_size: number of ranks ``W``.
        all_gather: ``x [*] -> [W, *]``, the stacked tensors of every rank (same shape on each).
        all_reduce_sum: ``x -> Σ_r x_r`` (may work in place on ``x``).
        all_gather_object: ``obj -> [obj of rank 0, …, obj of rank W−1]`` (picklable objects), for the
            readings whose size differs by rank (:func:`global_extra_shares`); None where not available.
    """

    rank: int
    world_size: int
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    all_gather_object: Optional[Callable[[Any], list]] = None


def global_part_name(rank: int, name: str) -> str:
    """``r{rank}/{name}``: part names are local to a rank's batch, so the rank prefixes them."""
    return f"r{rank}/{name}"


def _flat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.detach().reshape(-1) for x in xs]) if xs else torch.zeros(0)


def _unflat(v: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for x in like:
        out.append(v[i : i + x.numel()].view(x.shape))
        i += x.numel()
    return out


def global_report(
    local: Optional[CreditReport],
    applied: Sequence[Optional[torch.Tensor]],
    coll: Collectives,
    *,
    failure: Optional[str] = None,
    keep_grads: bool = False,
) -> Union[CreditReport, Refusal]:
    r"""Combine every rank's local report into the reading of the global step (a collective call).

    Args:
        local: this rank's report from ``disintegrate(..., project_onto=applied, keep_grads=True)``, or
            None when the local audit failed (``failure`` says why).
        applied: the averaged gradient the optimizer applies (``.grad`` at the optimizer step), aligned
            with ``local.grads.names``; None entries read as zero. Identical on every rank.
        coll: the collectives.
        failure: why the local audit failed (only with ``local=None``).
        keep_grads: attach the global ``G`` and ``Σ parts`` to ``report.grads`` (e.g. for a conservation
            check), identical on every rank.

    Returns:
        The global :class:`CreditReport` (part names ``r{rank}/{name}``, in rank order), or the same
        :class:`Refusal` on every rank when some rank has no local report.

    Example:
        >>> one = Collectives(0, 1, lambda x: x[None], lambda x: x)
        >>> g = [torch.tensor([3.0, 4.0], dtype=torch.float64)]
        >>> r = CreditReport(("a", "b"), (0.5, 0.5), (0.5, 0.5), (2.5, 2.5), 1.0, 0.0, None, "float64", 2,
        ...                  5.0, 1.0, grads=CreditGrads(("w",), g, g))
        >>> out = global_report(r, g, one)
        >>> out.part_names, out.projected_share, out.grad_match
        (('r0/a', 'r0/b'), (0.5, 0.5), 0.0)
    """
    W, rank = int(coll.world_size), int(coll.rank)
    if local is not None and (local.grads is None or local.grads.parts_sum is None):
        raise ValueError("`local` must be made with keep_grads=True: the global step needs g_full and Σ g_S.")
    names_blob = "\0".join(local.part_names).encode("utf-8") if local is not None else b""
    n_parts = local.n_parts if local is not None else 0
    defined = local is not None and local.ok
    head = torch.tensor([int(local is not None), int(defined), n_parts, len(names_blob)], dtype=torch.int64)
    heads = coll.all_gather(head).reshape(W, 4).cpu()  # [W, 4]
    missing = [r for r in range(W) if int(heads[r, 0]) == 0]
    if missing:
        why = failure if failure else "see that rank's log"
        return Refusal(
            "credit_audit_global",
            f"the audit declined on rank(s) {missing} this step, so the global step has no reading"
            + (f" (rank {rank}: {why})" if local is None else "")
            + ".",
            numbers={"ranks_without_reading": len(missing), "world_size": W},
            remedy="check what credit_terms returns for those ranks' batches (see docs/credit_audit.md)",
        )

    max_p = int(heads[:, 2].max())
    max_b = int(heads[:, 3].max())
    rows = torch.full(
        (max_p + 1, 2), float("nan"), dtype=torch.float64
    )  # [P+1, 2]: (share, norm); row 0 (loss, n_trained)
    rows[0, 0], rows[0, 1] = float(local.loss), float(local.n_trained)
    if n_parts:
        rows[1 : n_parts + 1, 0] = torch.tensor(local.projected_share, dtype=torch.float64)
        rows[1 : n_parts + 1, 1] = torch.tensor(local.part_norm, dtype=torch.float64)
    blob = torch.zeros(max(max_b, 1), dtype=torch.int32)  # [L] utf-8 bytes of the names, '\0'-separated
    if names_blob:
        blob[: len(names_blob)] = torch.tensor(list(names_blob), dtype=torch.int32)
    device = local.grads.g_full[0].device if local.grads.g_full else torch.device("cpu")
    all_rows = coll.all_gather(rows.to(device)).reshape(W, max_p + 1, 2).cpu()  # [W, P+1, 2]
    all_blobs = coll.all_gather(blob.to(device)).reshape(W, -1).cpu()  # [W, L]

    g_full, parts_sum = local.grads.g_full, local.grads.parts_sum
    # One collective for both vectors: the global g_full and the global conservation gap.
    vec = torch.cat([_flat(g_full), _flat(parts_sum) - _flat(g_full)])  # [2|θ|]
    vec = coll.all_reduce_sum(vec.clone()) / W
    n = vec.numel() // 2
    G, E = vec[:n], vec[n:]  # [|θ|], [|θ|]
    ref = _flat(
        [torch.zeros_like(g) if a is None else a.detach().to(g.device, g.dtype) for a, g in zip(applied, g_full)]
    )

    g64, e64, r64 = G.double(), E.double(), ref.double()
    full_norm = float(torch.linalg.vector_norm(g64))
    part_names: list[str] = []
    shares: list[float] = []
    norms: list[float] = []
    for r in range(W):
        k = int(heads[r, 2])
        raw = bytes(int(b) for b in all_blobs[r, : int(heads[r, 3])].tolist())
        local_names = raw.decode("utf-8").split("\0") if k else []
        part_names += [global_part_name(r, nm) for nm in local_names]
        shares += [float(x) / W for x in all_rows[r, 1 : k + 1, 0]]
        norms += [float(x) / W for x in all_rows[r, 1 : k + 1, 1]]
    norm_total = math.fsum(norms)
    undefined = [r for r in range(W) if int(heads[r, 1]) == 0]
    reason: Optional[str] = None
    if undefined:
        reason = (
            f"the shares are undefined on rank(s) {undefined} this step"
            + (f" (rank {rank}: {local.reason})" if local.reason else "")
            + "."
        )
    elif not (math.isfinite(full_norm) and full_norm > 0):
        reason = f"the global gradient has norm {full_norm}; shares are undefined this step."
    if reason is not None:
        shares = [float("nan")] * len(shares)
    ok_norm = math.isfinite(full_norm) and full_norm > 0
    conservation = float(torch.linalg.vector_norm(e64)) / full_norm if ok_norm else float("nan")
    cancellation = norm_total / full_norm if ok_norm and reason is None else float("nan")
    grad_match = float(torch.linalg.vector_norm(g64 - r64)) / full_norm if ok_norm else float("nan")
    grads = None
    if keep_grads:
        grads = CreditGrads(local.grads.names, _unflat(G, g_full), _unflat(G + E, g_full))
    return CreditReport(
        part_names=tuple(part_names),
        projected_share=tuple(shares),
        norm_share=tuple(x / norm_total if norm_total > 0 else float("nan") for x in norms),
        part_norm=tuple(norms),
        cancellation=cancellation,
        conservation_error=conservation,
        grad_match=grad_match,
        dtype=local.dtype,
        n_trained=int(round(float(all_rows[:, 0, 1].sum()))),
        full_grad_norm=full_norm,
        loss=float(all_rows[:, 0, 0].sum()) / W,
        partition=local.partition,
        reason=reason,
        grads=grads,
        # The interference matrix is not global: it would need every rank's part gradients in one place.
        engine=local.engine,
        readings=local.readings,
        coverage=local.coverage,
        compute_dtype=local.compute_dtype,
    )


def global_extra_shares(
    report: CreditReport,
    partition: Optional[Partition],
    terms: Optional[CreditTerms],
    extra: Sequence[tuple[str, Any]],
    coll: Collectives,
) -> tuple[bool, dict[str, Union[PartitionShares, str]]]:
    r"""The extra partitions of a global step, and whether every rank's primary parts are whole rows.

    A collective call (every rank, same steps). Each rank knows which of its rows fall in which part of an
    extra partition that is a union of the primary parts (``by_advantage_sign``, ``by_source``, ``by_group``
    over ``by_rollout``), and the global report holds the global share of each of its rows (``r{rank}/…``);
    it sums those shares into the extra parts, and the ranks' sums meet by part name (positional names,
    ``group_0``, get the rank prefix: they mean another group on every rank). By linearity the result is
    exactly the share a single process would read for the concatenated batch. An extra partition that is not
    such a union on some rank is not read, on every rank, with that rank's reason.

    Returns:
        ``(whole_rows_everywhere, {name: PartitionShares | reason})``, identical on every rank.
    """
    from .step_readings import whole_rows

    if coll.all_gather_object is None:
        why = "the collectives given cannot gather the per-rank parts"
        return False, {name: why for name, _ in extra}
    index = {n: i for i, n in enumerate(report.part_names)}
    mine: dict[str, Any] = {"whole": partition is not None and whole_rows(partition), "extra": {}}
    for name, fn in extra:
        try:
            if partition is None or terms is None:
                raise ValueError("this rank kept no terms for the step")
            coarse = fn if isinstance(fn, Partition) else fn(terms)
            coarse.check_covers(terms.trained)
            mapping = coarsening(partition, coarse)
            if mapping is None:
                raise ValueError(
                    "its parts are not unions of the primary partition's parts, so its global reading would need "
                    "every rank's part gradients (use scope='rank', or a primary partition it coarsens)"
                )
            shares = [report.projected_share[index[global_part_name(coll.rank, n)]] for n in partition.names]
            derived = derive_shares(shares, mapping, coarse, name, rows_per_part(coarse, terms.trained))
            names = [global_part_name(coll.rank, n) if name in POSITIONAL_PARTITIONS else n for n in coarse.names]
            mine["extra"][name] = (names, list(derived.projected_share), list(derived.n_rows or ()))
        except Exception as err:  # a reading beyond the primary one is declined by name, on every rank alike
            mine["extra"][name] = f"{type(err).__name__}: {err}"
    everyone = coll.all_gather_object(mine)
    out: dict[str, Union[PartitionShares, str]] = {}
    for name, _ in extra:
        bad = [(r, e["extra"][name]) for r, e in enumerate(everyone) if isinstance(e["extra"][name], str)]
        if bad:
            out[name] = f"not read on rank {bad[0][0]}: {bad[0][1]}"
            continue
        acc: dict[str, list[float]] = {}
        rows: dict[str, int] = {}
        for e in everyone:
            names, shares, n_rows = e["extra"][name]
            for i, n in enumerate(names):
                acc.setdefault(n, []).append(float(shares[i]))
                rows[n] = rows.get(n, 0) + (int(n_rows[i]) if i < len(n_rows) else 0)
        part_names = tuple(acc)
        out[name] = PartitionShares(
            name,
            part_names,
            tuple(math.fsum(acc[n]) for n in part_names),
            None,
            tuple(rows[n] for n in part_names),
            method="derived over all ranks",
        )
    return all(bool(e["whole"]) for e in everyone), out
