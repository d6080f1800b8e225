"""The direct route's two paths against each other, in one process, inside the real separate pass.

On a CPU the direct route forms one part's piece of a block of weight rows at a time and reduces it
while it is in the core's cache (``ghost_routes._direct_by_part``); on a GPU, and for the Gram, it forms
every part's block at once by one batched product. This times the separate ``shares`` pass
(:func:`disintegrate`, ``engine="ghost"``, ``reference_grads="grad"``) with each path, interleaved (each
first after the trainer's backward in turn), on one of ``credit_cost.py``'s real-shape policies, and the
time spent in the direct route itself (a timer around each parameter's ``direct_param`` call): in all,
and for the largest weight (the LM head). Ratios of medians; the plain step for scale. Wall time and
the process's system time (page faults, mostly: a pass maps its activations afresh) are given apart.

    OMP_NUM_THREADS=1 python benchmarks/direct_route_ab.py --row llama:32:128 --repeats 4
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import credit_cost as cc  # noqa: E402
from lens_callbacks.credit import disintegrate  # noqa: E402
from lens_callbacks.credit.engines import ghost, ghost_routes  # noqa: E402


def measure_ab(kind: str, m: int, T: int, repeats: int, **override) -> dict:
    """Both paths timed, interleaved; medians of the pass, of the direct route in all and of its largest weight."""
    policy = cc.Policy(cc.make_real_model(kind, T, 0, **override))
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, policy.model.config.vocab_size, (m, T), generator=g)  # [m, T]
    adv = torch.randn(m, generator=g)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool)  # [m, T]
    trained[:, T // 8 :] = True
    batch = (ids, adv, trained)
    train_step, fwd_bwd, _ = cc.make_steps(policy, opt, batch, readings="shares")

    spent: dict[tuple[int, ...], float] = {}
    real_direct, real_by_part = ghost.direct_param, ghost_routes._by_part

    def timed_direct(*a, **k):
        t0 = time.perf_counter()
        out = real_direct(*a, **k)
        key = tuple(a[1].shape)  # g_full's shape names the weight
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return out

    def audit(by_part: bool):
        def run():
            ghost_routes._by_part = lambda device: by_part
            try:
                return disintegrate(policy, batch, "by_rollout", engine="ghost", readings="shares", reference_grads="grad")
            finally:
                ghost_routes._by_part = real_by_part
        return run

    paths = {"by part": audit(True), "batched": audit(False)}
    ghost.direct_param = timed_direct
    try:
        train_step()
        fwd_bwd()
        got = {k: f() for k, f in paths.items()}
        times: dict[str, list[float]] = {"step": [], **{k: [] for k in paths}}
        sys_s: dict[str, list[float]] = {"step": [], **{k: [] for k in paths}}

        def clock(key, fn):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            times[key].append(cc.clock(fn))
            sys_s[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - before)

        direct: dict[str, list[float]] = {k: [] for k in paths}
        largest: dict[str, list[float]] = {k: [] for k in paths}
        order = list(paths.items())
        for i in range(repeats):
            clock("step", train_step)
            fwd_bwd()
            j = i % len(order)
            for k, f in order[j:] + order[:j]:
                spent.clear()
                clock(k, f)
                direct[k].append(sum(spent.values()))
                largest[k].append(max(spent.values(), default=0.0))
    finally:
        ghost.direct_param = real_direct
    med = statistics.median
    return {
        "kind": kind, "m": m, "T": T, "repeats": repeats, "step_s": med(times["step"]), "step_sys_s": med(sys_s["step"]),
        "share_gap": max(abs(a - b) for a, b in zip(got["by part"].projected_share, got["batched"].projected_share)),
        "conservation_error": {k: r.conservation_error for k, r in got.items()},
        "paths": {k: {"over_step": med(times[k]) / med(times["step"]), "sys_s": med(sys_s[k]), "direct_s": med(direct[k]),
                      "largest_s": med(largest[k])} for k in paths},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="llama:32:128", help="KIND:M:T, as credit_cost.py's --real-rows")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    kind, m, T = args.row.split(":")
    torch.set_num_threads(1)
    r = measure_ab(kind, int(m), int(T), args.repeats)
    print(f"{kind}, m = {m}, T = {T}, {args.repeats} repeats; plain step {r['step_s']:.2f} s ({r['step_sys_s']:.2f} s "
          f"system); the two paths' "
          f"projected shares differ by {r['share_gap']:.1e}")
    print("| path | separate `shares` pass / step | its system time (s) | direct route (s) | largest weight (s) |")
    print("|---|---:|---:|---:|---:|")
    for k, p in r["paths"].items():
        print(f"| {k} | {p['over_step']:.2f}× | {p['sys_s']:.2f} | {p['direct_s']:.2f} | {p['largest_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
