"""Where a separate ``shares`` pass's time goes beyond the step's own forward and backward.

On one of ``credit_cost.py``'s real-shape policies, timed interleaved in one process (one thread): the
plain step (forward + backward + Adam), a plain forward + backward, and the separate one-pass ``shares``
audit (:func:`disintegrate`, ``engine="ghost"``, ``reference_grads="grad"``, started right after a
backward as at ``on_before_optimizer_step``). Inside the audit, a timer around each parameter's
reduction (everything the engine adds to its own forward and backward) and, within those, around the
products ``torch.mm`` makes in :mod:`~lens_callbacks.credit.engines.ghost_routes` (on a CPU's direct route,
one part's piece of a block of weight rows; on the ghost route, a weight's dot products, which the route
count does not pick on these shapes), around the scans for each row's dead ends, around the
conservation differences and around the reads of each part's piece; and around what the pass does once
its backward is over (``end``: the small parameters batched until then, ``‖g_full‖²``, ``grad_match`` and
the report). Medians, as fractions of the plain step:

- ``fwd_bwd``: what the pass re-runs (its ``credit_terms`` forward and backward);
- ``pass − reductions − end``: the same, measured inside the pass (hooks and captures included);
- ``end``: the work after the backward listed above;
- ``products``: the per-row products, a weight gradient's worth of multiply-adds less the cut positions;
- ``scans``: finding each row's dead ends (the positions without a term, cut off the products);
- ``differences``: the conservation difference ``‖Σ_S g_S − g_full‖²``, block by block;
- ``reads``: the direct route's reads of each part's piece of a block (its dot with ``g_full``, its norm,
  adding it into ``Σ_S g_S``: :func:`~lens_callbacks.credit.engines.ghost_routes.read_piece`);
- ``rest``: everything else the reductions do (selecting each row's live positions, the embedding's tokens,
  the small parameters' pieces, allocating the blocks, the Python around them).

The table has two rows: wall time, and user CPU time (each part's, over the step's: the work, whatever
the kernel charges for mapping fresh memory, which moves with the allocator's state from run to run and
can move the wall ratios by tenths). Under the table, each call's CPU time as ``credit_cost.py`` lists it:
the user time against the step's, the system seconds and page faults.

    OMP_NUM_THREADS=1 python benchmarks/pass_split.py --row llama:8:128 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import credit_cost as cc  # noqa: E402
from credit_cost import resource  # noqa: E402  (None where the platform has no getrusage)

from lens_callbacks.credit.engines import ghost, ghost_routes  # noqa: E402

PARTS = ("step", "fwd_bwd", "pass", "reductions", "products", "scans", "differences", "reads", "end")


def _now() -> tuple[float, float]:
    """Wall seconds and user CPU seconds of the process (CPU time with the system's share where the
    platform does not split them)."""
    user = resource.getrusage(resource.RUSAGE_SELF).ru_utime if resource is not None else time.process_time()
    return time.perf_counter(), user


def _add(spent: list, t0: tuple[float, float]) -> None:
    t1 = _now()
    spent[0] += t1[0] - t0[0]
    spent[1] += t1[1] - t0[1]


class _TimedTorch(types.ModuleType):
    """``torch`` as :mod:`ghost_routes` sees it, with ``mm`` timed (every other name is torch's own)."""

    def __init__(self, spent: list) -> None:
        super().__init__("torch")
        self._spent = spent

    def __getattr__(self, name):
        return getattr(torch, name)

    def mm(self, *a, **k):
        t0 = _now()
        out = torch.mm(*a, **k)
        _add(self._spent, t0)
        return out


def measure_split(kind: str, m: int, T: int, repeats: int, **override) -> dict:
    """Medians of the step, a forward + backward, the pass and its timed parts: ``seconds`` by wall time,
    ``user`` by user CPU time (each a dict keyed by :data:`PARTS`)."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be at least 1, got {repeats!r}.")
    s = cc._real_setup(kind, m, T, ("step", "sep_shares"), **override)
    audit = s.audits["sep_shares"]
    red, prod, scans, diffs, reads, end = ([0.0, 0.0] for _ in range(6))
    inside = [0]  # the scans and differences are counted only within a timed reduction
    outer_end = [0]  # the end's functions call each other: only the outermost call is timed
    real = {
        (ghost._Reducer, "param"): red,
        (ghost_routes, "_cut"): scans,
        (ghost_routes, "diff_sq64"): diffs,
        (ghost_routes, "sq64"): diffs,
        (ghost, "diff_sq64"): diffs,
        (ghost_routes, "read_piece"): reads,
    }
    after = {
        (ghost._Reducer, "finish"): end,
        (ghost, "_sum_sq"): end,
        (ghost, "grad_match_to"): end,
        (ghost, "build_report"): end,
    }
    saved = {key: getattr(*key) for key in (*real, *after)}
    saved[(ghost_routes, "torch")] = ghost_routes.torch

    def timed(fn, spent, outer):
        def wrapper(*a, **k):
            if not (outer or inside[0]):
                return fn(*a, **k)
            inside[0] += outer
            t0 = _now()
            try:
                return fn(*a, **k)
            finally:
                _add(spent, t0)
                inside[0] -= outer

        return wrapper

    def timed_end(fn, spent):
        def wrapper(*a, **k):
            if outer_end[0] or inside[0]:  # nested in another end function, or part of a timed reduction
                return fn(*a, **k)
            outer_end[0] += 1
            t0, r0 = _now(), list(red)
            try:
                return fn(*a, **k)
            finally:
                _add(spent, t0)
                # a parameter the backward did not reach is reduced in `finish`: it counts as a reduction
                spent[0] -= red[0] - r0[0]
                spent[1] -= red[1] - r0[1]
                outer_end[0] -= 1

        return wrapper

    times: dict[str, list[float]] = {k: [] for k in PARTS}
    users: dict[str, list[float]] = {k: [] for k in PARTS}
    usage: dict[str, list] = {"step": [], "fwd_bwd": [], "pass": []}

    def timed_call(key, fn):
        t0 = None if resource is not None else _now()  # clock_usage reads the user time where it can
        t, cpu = cc.clock_usage(fn)
        times[key].append(t)
        users[key].append(cpu[0] if cpu is not None else _now()[1] - t0[1])
        if cpu is not None:
            usage[key].append(cpu)

    for (owner, name), spent in real.items():
        setattr(owner, name, timed(saved[(owner, name)], spent, outer=int(owner is ghost._Reducer)))
    for (owner, name), spent in after.items():
        setattr(owner, name, timed_end(saved[(owner, name)], spent))
    ghost_routes.torch = _TimedTorch(prod)
    try:
        s.train_step()
        s.fwd_bwd()
        report = audit()  # warm-up
        for _ in range(repeats):
            timed_call("step", s.train_step)
            timed_call("fwd_bwd", s.fwd_bwd)  # also the backward the pass follows
            for spent in (red, prod, scans, diffs, reads, end):
                spent[:] = [0.0, 0.0]
            timed_call("pass", audit)
            for k, spent in (
                ("reductions", red),
                ("products", prod),
                ("scans", scans),
                ("differences", diffs),
                ("reads", reads),
                ("end", end),
            ):
                times[k].append(spent[0])
                users[k].append(spent[1])
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
    med = {k: statistics.median(v) for k, v in times.items()}
    umed = {k: statistics.median(v) for k, v in users.items()}
    # user time, system time and page faults of each call (medians): on a CPU the system share moves with
    # the allocator's state from one run to the next, the user share with the work
    cpu = {k: [statistics.median(c[i] for c in v) for i in range(3)] for k, v in usage.items() if len(v) == repeats}
    return {
        "kind": kind,
        "m": m,
        "T": T,
        "repeats": repeats,
        "seconds": med,
        "user": umed,
        "cpu": cpu or None,
        "over_step": {k: v / med["step"] for k, v in med.items()},
        "user_over_step": {k: v / umed["step"] for k, v in umed.items()} if umed["step"] > 0 else None,
        "conservation_error": report.conservation_error,
    }


def _cells(o: dict) -> str:
    rest = o["reductions"] - o["products"] - o["scans"] - o["differences"] - o["reads"]
    return (
        f"{o['pass']:.3f} | {o['fwd_bwd']:.3f} | {o['pass'] - o['reductions'] - o['end']:.3f} | {o['end']:.3f} | "
        f"{o['products']:.3f} | {o['scans']:.3f} | {o['differences']:.3f} | {o['reads']:.3f} | {rest:.3f} |"
    )


def render(r: dict) -> str:
    rows = [f"| wall | {_cells(r['over_step'])}"]
    if r.get("user_over_step"):
        rows.append(f"| user CPU | {_cells(r['user_over_step'])}")
    return "\n".join(
        [
            f"{r['kind']}, m = {r['m']}, T = {r['T']}, {r['repeats']} repeats; plain step {r['seconds']['step']:.2f} s "
            f"(conservation_error {r['conservation_error']:.1e})",
            "| time | separate `shares` pass | forward + backward alone | pass − reductions − end | end (after the backward) | "
            "per-row products | dead-end scans | conservation differences | reads of the pieces | rest of the reductions |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "(each a fraction of the plain step's wall time, and of its user CPU time)",
        ]
        + ([cc._cpu_text(r["cpu"])] if r.get("cpu") and r["cpu"]["step"][0] > 0 else [])
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="llama:8:128", type=cc._real_row, help="KIND:M:T, as credit_cost.py's --real-rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        type=cc._shape_override,
        metavar="KEY=INT",
        help="override one field of the policy's shape, as credit_cost.py's --shape",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"`repeats` must be at least 1, got {args.repeats!r}.")
    torch.set_num_threads(1)
    kind, m, T = args.row
    print(render(measure_split(kind, m, T, args.repeats, **dict(args.shape))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
