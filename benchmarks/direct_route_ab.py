"""Two ways of the direct route against each other, in one process, inside the real separate pass.

``--compare paths`` (the default): on a CPU the direct route forms one part's piece of a block of weight
rows at a time and reduces it while it is in the core's cache (``ghost_routes._direct_by_part``); on a
GPU, and for the Gram, it forms every part's block at once by one batched product.
``--compare cut``: the direct route multiplies only the positions between each row's first and last term
that is not zero (``ghost_routes._cut``: at the LM head, the prompt and the padding carry no output
gradient), against every position.

This times the separate ``shares`` pass (:func:`disintegrate`, ``engine="ghost"``,
``reference_grads="grad"``) each way, interleaved (each first after the trainer's backward in turn), on
one of ``credit_cost.py``'s real-shape policies with ``--prompt`` of each row untrained, and the time
spent in the direct route itself (a timer around each parameter's ``direct_param`` call): in all, and
for the largest weight (the LM head). Ratios of medians; the plain step for scale. Wall time and the
process's system time (page faults, mostly: a pass maps its activations afresh) are given apart.

    OMP_NUM_THREADS=1 python benchmarks/direct_route_ab.py --row llama:32:128 --repeats 4
    OMP_NUM_THREADS=1 python benchmarks/direct_route_ab.py --row llama:32:128 --compare cut --prompt 0.5
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

COMPARE = {  # way: {name: (one part at a time, dead ends cut)}
    "paths": {"by part": (True, True), "batched": (False, True)},
    "cut": {"cut": (None, True), "every position": (None, False)},
}


def measure_ab(
    kind: str, m: int, T: int, repeats: int, compare: str = "paths", prompt: float = 1 / 8, **override
) -> dict:
    """Both ways timed, interleaved; medians of the pass, of the direct route in all and of its largest weight.
    ``prompt``: the share of each row's positions before its trained ones."""
    if compare not in COMPARE:
        raise ValueError(f"`compare` must be one of {sorted(COMPARE)}, got {compare!r}.")
    if not 0 <= prompt < 1:
        raise ValueError(f"`prompt` must be a share of the row in [0, 1), got {prompt!r}.")
    policy = cc.Policy(cc.make_real_model(kind, T, 0, **override))
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, policy.model.config.vocab_size, (m, T), generator=g)  # [m, T]
    adv = torch.randn(m, generator=g)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool)  # [m, T]
    trained[:, int(prompt * T) :] = True
    batch = (ids, adv, trained)
    train_step, fwd_bwd, _ = cc.make_steps(policy, opt, batch, readings="shares")

    spent: dict[tuple[int, ...], float] = {}
    real_direct, real_by_part, real_cut = ghost.direct_param, ghost_routes._by_part, ghost_routes._cut

    def timed_direct(*a, **k):
        t0 = time.perf_counter()
        out = real_direct(*a, **k)
        key = tuple(a[1].shape)  # g_full's shape names the weight
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return out

    def audit(by_part, cut: bool):
        def run():
            if by_part is not None:
                ghost_routes._by_part = lambda device, numel: by_part
            if not cut:
                ghost_routes._cut = lambda f: (f, None)
            try:
                return disintegrate(
                    policy, batch, "by_rollout", engine="ghost", readings="shares", reference_grads="grad"
                )
            finally:
                ghost_routes._by_part, ghost_routes._cut = real_by_part, real_cut

        return run

    paths = {k: audit(*way) for k, way in COMPARE[compare].items()}
    first, second = paths
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
        "kind": kind,
        "m": m,
        "T": T,
        "repeats": repeats,
        "compare": compare,
        "prompt": prompt,
        "step_s": med(times["step"]),
        "step_sys_s": med(sys_s["step"]),
        "share_gap": max(abs(a - b) for a, b in zip(got[first].projected_share, got[second].projected_share)),
        "conservation_error": {k: r.conservation_error for k, r in got.items()},
        "paths": {
            k: {
                "over_step": med(times[k]) / med(times["step"]),
                "sys_s": med(sys_s[k]),
                "direct_s": med(direct[k]),
                "largest_s": med(largest[k]),
            }
            for k in paths
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="llama:32:128", help="KIND:M:T, as credit_cost.py's --real-rows")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument(
        "--compare",
        choices=sorted(COMPARE),
        default="paths",
        help="paths: one part at a time against every part's block at once; cut: dead ends cut or not",
    )
    ap.add_argument("--prompt", type=float, default=1 / 8, help="share of each row before its trained positions")
    args = ap.parse_args(argv)
    kind, m, T = args.row.split(":")
    torch.set_num_threads(1)
    r = measure_ab(kind, int(m), int(T), args.repeats, compare=args.compare, prompt=args.prompt)
    print(
        f"{kind}, m = {m}, T = {T}, prompt {args.prompt:.3g} of a row, {args.repeats} repeats; plain step "
        f"{r['step_s']:.2f} s ({r['step_sys_s']:.2f} s system); the two ways' "
        f"projected shares differ by {r['share_gap']:.1e}"
    )
    print("| way | separate `shares` pass / step | its system time (s) | direct route (s) | largest weight (s) |")
    print("|---|---:|---:|---:|---:|")
    for k, p in r["paths"].items():
        print(f"| {k} | {p['over_step']:.2f}× | {p['sys_s']:.2f} | {p['direct_s']:.2f} | {p['largest_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
