"""Where a separate ``shares`` pass's time goes beyond the step's own forward and backward.

On one of ``credit_cost.py``'s real-shape policies, timed interleaved in one process (one thread): the
plain step (forward + backward + Adam), a plain forward + backward, and the separate one-pass ``shares``
audit (:func:`disintegrate`, ``engine="ghost"``, ``reference_grads="grad"``, started right after a
backward as at ``on_before_optimizer_step``). Inside the audit, a timer around each parameter's
reduction (everything the engine adds to its own forward and backward) and, within those, around the
products ``torch.mm`` makes in :mod:`~lens_callbacks.credit.engines.ghost_routes` (on a CPU's direct route,
one part's piece of a block of weight rows; on the ghost route, a weight's dot products, which the route
count does not pick on these shapes). Medians, as fractions of the plain step:

- ``fwd_bwd``: what the pass re-runs (its ``credit_terms`` forward and backward);
- ``pass − reductions``: the same, measured inside the pass (hooks and captures included);
- ``products``: the per-row products, a weight gradient's worth of multiply-adds less the cut positions;
- ``reductions − products``: everything else the engine does (dots, norms, ``Σ_S g_S``, the conservation
  difference, finding the dead ends, the embedding's tokens, Python) — what a fused kernel could remove.

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

PARTS = ("step", "fwd_bwd", "pass", "reductions", "products")


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
    red, prod = [0.0], [0.0]
    real_param, real_torch = ghost._Reducer.param, ghost_routes.torch

    def timed_param(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return real_param(self, *a, **k)
        finally:
            red[0] += time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in PARTS}
    ghost._Reducer.param = timed_param
    ghost_routes.torch = _TimedTorch(prod)
    try:
        s.train_step()
        s.fwd_bwd()
        report = audit()  # warm-up
        for _ in range(repeats):
            times["step"].append(cc.clock(s.train_step))
            times["fwd_bwd"].append(cc.clock(s.fwd_bwd))  # also the backward the pass follows
            red[0] = prod[0] = 0.0
            times["pass"].append(cc.clock(audit))
            times["reductions"].append(red[0])
            times["products"].append(prod[0])
    finally:
        ghost._Reducer.param, ghost_routes.torch = real_param, real_torch
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"kind": kind, "m": m, "T": T, "repeats": repeats, "seconds": med,
            "over_step": {k: v / med["step"] for k, v in med.items()}, "conservation_error": report.conservation_error}


def render(r: dict) -> str:
    o = r["over_step"]
    return "\n".join([
        f"{r['kind']}, m = {r['m']}, T = {r['T']}, {r['repeats']} repeats; plain step {r['seconds']['step']:.2f} s "
        f"(conservation_error {r['conservation_error']:.1e})",
        "| separate `shares` pass | forward + backward alone | pass − reductions | per-row products | reductions − products |",
        "|---:|---:|---:|---:|---:|",
        f"| {o['pass']:.3f} | {o['fwd_bwd']:.3f} | {o['pass'] - o['reductions']:.3f} | {o['products']:.3f} | "
        f"{o['reductions'] - o['products']:.3f} |",
        "(each a fraction of the plain step)",
    ])


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
