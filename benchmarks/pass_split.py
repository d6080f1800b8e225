"""Where a separate ``shares`` pass's time goes beyond the step's own forward and backward.

On one of ``credit_cost.py``'s real-shape policies, timed interleaved in one process (one thread): the
plain step (forward + backward + Adam), a plain forward + backward, and the separate one-pass ``shares``
audit (:func:`disintegrate`, ``engine="ghost"``, ``reference_grads="grad"``, started right after a
backward as at ``on_before_optimizer_step``). Inside the audit, a timer around each parameter's
reduction (everything the engine adds to its own forward and backward) and, within those, around the
products ``torch.mm`` makes in :mod:`~lens_callbacks.credit.engines.ghost_routes` (on a CPU's direct route,
one part's piece of a block of weight rows; on the ghost route, a weight's dot products, which the route
count does not pick on these shapes), around the scans for each row's dead ends and around the
conservation differences. Medians, as fractions of the plain step:

- ``fwd_bwd``: what the pass re-runs (its ``credit_terms`` forward and backward);
- ``pass − reductions``: the same, measured inside the pass (hooks and captures included);
- ``products``: the per-row products, a weight gradient's worth of multiply-adds less the cut positions;
- ``scans``: finding each row's dead ends (the positions without a term, cut off the products);
- ``differences``: the conservation difference ``‖Σ_S g_S − g_full‖²``, block by block;
- ``rest``: everything else the reductions do (each part's dot and norm, adding it into ``Σ_S g_S``, the
  embedding's tokens, the Python around them) — what a kernel fusing the reads into the products could
  remove at most.

(The small parameters batched until the end of the pass are reduced after the timed reductions, and
count in ``pass − reductions``.) Under the table, each call's CPU time as ``credit_cost.py`` lists it: the
user time against the step's (the work), the system seconds and page faults (the kernel mapping fresh
memory, which moves with the allocator's state from run to run and can move the wall ratios by tenths).

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
from lens_callbacks.credit.engines import ghost, ghost_routes  # noqa: E402

PARTS = ("step", "fwd_bwd", "pass", "reductions", "products", "scans", "differences")


class _TimedTorch(types.ModuleType):
    """``torch`` as :mod:`ghost_routes` sees it, with ``mm`` timed (every other name is torch's own)."""

    def __init__(self, spent: list) -> None:
        super().__init__("torch")
        self._spent = spent

    def __getattr__(self, name):
        return getattr(torch, name)

    def mm(self, *a, **k):
        t0 = time.perf_counter()
        out = torch.mm(*a, **k)
        self._spent[0] += time.perf_counter() - t0
        return out


def measure_split(kind: str, m: int, T: int, repeats: int, **override) -> dict:
    """Medians (seconds) of the step, a forward + backward, the pass, its reductions and their products."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be at least 1, got {repeats!r}.")
    s = cc._real_setup(kind, m, T, ("step", "sep_shares"), **override)
    audit = s.audits["sep_shares"]
    red, prod, scans, diffs = [0.0], [0.0], [0.0], [0.0]
    inside = [0]  # the scans and differences are counted only within a timed reduction
    real = {(ghost._Reducer, "param"): red, (ghost_routes, "_cut"): scans, (ghost_routes, "diff_sq64"): diffs,
            (ghost_routes, "sq64"): diffs, (ghost, "diff_sq64"): diffs}
    saved = {key: getattr(*key) for key in real}
    saved[(ghost_routes, "torch")] = ghost_routes.torch

    def timed(fn, spent, outer):
        def wrapper(*a, **k):
            if not (outer or inside[0]):
                return fn(*a, **k)
            inside[0] += outer
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
                inside[0] -= outer

        return wrapper

    times: dict[str, list[float]] = {k: [] for k in PARTS}
    usage: dict[str, list] = {"step": [], "fwd_bwd": [], "pass": []}

    def timed_call(key, fn):
        t, cpu = cc.clock_usage(fn)
        times[key].append(t)
        if cpu is not None:
            usage[key].append(cpu)

    for (owner, name), spent in real.items():
        setattr(owner, name, timed(saved[(owner, name)], spent, outer=int(owner is ghost._Reducer)))
    ghost_routes.torch = _TimedTorch(prod)
    try:
        s.train_step()
        s.fwd_bwd()
        report = audit()  # warm-up
        for _ in range(repeats):
            timed_call("step", s.train_step)
            timed_call("fwd_bwd", s.fwd_bwd)  # also the backward the pass follows
            red[0] = prod[0] = scans[0] = diffs[0] = 0.0
            timed_call("pass", audit)
            for k, spent in (("reductions", red), ("products", prod), ("scans", scans), ("differences", diffs)):
                times[k].append(spent[0])
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
    med = {k: statistics.median(v) for k, v in times.items()}
    # user time, system time and page faults of each call (medians): on a CPU the system share moves with
    # the allocator's state from one run to the next, the user share with the work
    cpu = {k: [statistics.median(c[i] for c in v) for i in range(3)] for k, v in usage.items() if len(v) == repeats}
    return {"kind": kind, "m": m, "T": T, "repeats": repeats, "seconds": med, "cpu": cpu or None,
            "over_step": {k: v / med["step"] for k, v in med.items()}, "conservation_error": report.conservation_error}


def render(r: dict) -> str:
    o = r["over_step"]
    return "\n".join([
        f"{r['kind']}, m = {r['m']}, T = {r['T']}, {r['repeats']} repeats; plain step {r['seconds']['step']:.2f} s "
        f"(conservation_error {r['conservation_error']:.1e})",
        "| separate `shares` pass | forward + backward alone | pass − reductions | per-row products | dead-end scans | "
        "conservation differences | rest of the reductions |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {o['pass']:.3f} | {o['fwd_bwd']:.3f} | {o['pass'] - o['reductions']:.3f} | {o['products']:.3f} | "
        f"{o['scans']:.3f} | {o['differences']:.3f} | {o['reductions'] - o['products'] - o['scans'] - o['differences']:.3f} |",
        "(each a fraction of the plain step)",
    ] + ([cc._cpu_text(r["cpu"])] if r.get("cpu") and r["cpu"]["step"][0] > 0 else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="llama:8:128", type=cc._real_row, help="KIND:M:T, as credit_cost.py's --real-rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shape", action="append", default=[], type=cc._shape_override, metavar="KEY=INT",
                    help="override one field of the policy's shape, as credit_cost.py's --shape")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kind, m, T = args.row
    print(render(measure_split(kind, m, T, args.repeats, **dict(args.shape))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
