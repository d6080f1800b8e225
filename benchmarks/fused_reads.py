"""What fusing the reads of a part's piece would save on a CPU's direct route.

The direct route (``ghost_routes._direct_by_part``) forms one part's piece of a block of weight rows
(``[rows, d_R]``, about 1 MB) and then reads it with eager kernels (``ghost_routes.read_piece``): its dot
with ``g_full`` per weight row (``mul`` into a buffer, then ``sum``), its norm per weight row
(``linalg.vector_norm``) and its addition into ``Σ_S g_S`` (``add_``). This script times the engine's
``read_piece`` on one block against the same three reductions fused into one kernel
by ``torch.compile`` (one read of the piece), checks that both give the same numbers, and scales the
difference by the number of part-blocks a pass reads (``--blocks``: 920 on llama at m = 8, T = 128, the
count of the pass's per-row products).

    OMP_NUM_THREADS=1 python benchmarks/fused_reads.py --rows 512 --width 512 --blocks 920
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lens_callbacks.credit.engines.ghost_routes import read_piece  # noqa: E402


def fused_body(P: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same reductions as one expression for ``torch.compile`` to fuse (norms squared, not rooted)."""
    dots = (P * w).sum(1)  # [rows]
    sq = (P * P).sum(1)  # [rows]
    s.add_(P)
    return dots, sq


def _per_call(fn: Callable[[], object], n: int) -> float:
    for _ in range(max(1, n // 20)):  # warm-up
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(rows: int, width: int, blocks: int, calls: int = 2000, backend: str = "inductor", seed: int = 0) -> dict:
    """Seconds a block's reads take eager and fused, the compile time, and the fused results' largest
    difference from the eager ones (dots and squared norms, each relative to its largest value)."""
    for name, v in (("rows", rows), ("width", width), ("blocks", blocks), ("calls", calls)):
        if v < 1:
            raise ValueError(f"`{name}` must be at least 1, got {v!r}.")
    g = torch.Generator().manual_seed(seed)
    P, w = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)  # [rows, d_R]
    tmp, s = torch.empty(rows, width), torch.zeros(rows, width)
    dots, sq = torch.empty(rows), torch.empty(rows)
    t0 = time.perf_counter()
    fused = torch.compile(fused_body, backend=backend, dynamic=False)
    f_dots, f_sq = fused(P, w, s)  # compiles
    compile_s = time.perf_counter() - t0
    read_piece(P, w, s, tmp, dots, sq, first=False)
    diff = max(
        float((f_dots - dots).abs().max()) / max(float(dots.abs().max()), 1e-30),
        float((f_sq - sq.pow(2)).abs().max()) / max(float(sq.pow(2).max()), 1e-30),
    )
    eager_s = _per_call(lambda: read_piece(P, w, s, tmp, dots, sq, first=False), calls)
    fused_s = _per_call(lambda: fused(P, w, s), calls)
    return {
        "rows": rows,
        "width": width,
        "blocks": blocks,
        "backend": backend,
        "eager_s": eager_s,
        "fused_s": fused_s,
        "compile_s": compile_s,
        "saved_s": blocks * (eager_s - fused_s),
        "max_rel_diff": diff,
    }


def render(r: dict) -> str:
    return (
        f"one part's block [{r['rows']}, {r['width']}], float32, {r['backend']}: eager reads {r['eager_s'] * 1e6:.1f} µs, "
        f"fused {r['fused_s'] * 1e6:.1f} µs (compiled in {r['compile_s']:.1f} s; largest relative difference "
        f"{r['max_rel_diff']:.1e}); over {r['blocks']} part-blocks a pass: {r['saved_s']:.3f} s saved"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512, help="weight rows of a block (the engine's: 2^18 elements / d_R)")
    ap.add_argument("--width", type=int, default=512, help="d_R, the weight's inner width")
    ap.add_argument("--blocks", type=int, default=920, help="part-blocks a pass reads (920: llama, m = 8, T = 128)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor needs a C++ compiler)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        r = measure(args.rows, args.width, args.blocks, args.calls, args.backend)
    except ValueError as err:
        ap.error(str(err))
    print(render(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
