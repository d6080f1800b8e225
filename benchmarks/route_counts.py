"""Multiply-adds and bytes moved per audit route, counted from a model's shape (no timing, no model built).

``route_counts(shape, m, T)`` counts, for ``m`` rows of ``T`` positions (``by_rollout``: one part per row),
the multiply-adds (MACs) and the bytes read and written by:

- ``step``: the plain training step (forward, backward with weight gradients, Adam);
- ``ride``: what riding on the step adds (the per-layer reductions: dots with ``g_full``, row norms, the
  parts' sum), each weight on its cheaper exact route;
- ``separate``: a separate pass (its own forward and backward with weight gradients, plus the reductions);
- ``trainer``: a separate pass taking ``g_full`` from ``.grad`` (backward to the layers' outputs only);
- ``vmap`` / ``opacus``: per-row gradients materialised (``m × |θ|``), then the same readings.

The embedding is counted twice where it matters: ``dense`` (a ``[V, d]`` piece per row, zeroed, filled and
read) and ``sparse`` (a row's gradient lives on its ``T`` token ids: dot by gather, norm by the
token-equality Gram). Attention is counted as eager (full ``T × T`` scores). Counts are per the formulas in
docs/performance.md; ratios of counts are what a compute-bound (MACs) or memory-bound (bytes) device would
show, not a measurement.

``python benchmarks/route_counts.py --shape qwen2.5-7b --rows 8 --tokens 4096`` prints the table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

#: Shapes the docs use: vocabulary, width, layers, MLP width, attention heads, KV heads, tied head, q/k/v biases.
SHAPES = {
    "qwen2-bench": dict(
        vocab=151936, hidden=896, layers=2, intermediate=4864, heads=14, kv_heads=2, tied=True, qkv_bias=True
    ),
    "llama-bench": dict(vocab=32000, hidden=512, layers=4, intermediate=1376, heads=8, kv_heads=8, tied=False),
    "qwen2.5-0.5b": dict(
        vocab=151936, hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, tied=True, qkv_bias=True
    ),
    "qwen2.5-7b": dict(
        vocab=152064, hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, tied=False, qkv_bias=True
    ),
}


@dataclass(frozen=True)
class Cost:
    macs: float
    bytes: float

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.macs + o.macs, self.bytes + o.bytes)


def linears(shape: dict) -> list[tuple[int, int]]:
    """``(d_in, d_out)`` of every Linear weight of the decoder stack (not the LM head)."""
    d, f, h, kv = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"]
    hd = d // h
    per_layer = [(d, d), (d, kv * hd), (d, kv * hd), (d, d), (d, f), (d, f), (f, d)]
    return per_layer * shape["layers"]


def n_params(shape: dict) -> int:
    V, d = shape["vocab"], shape["hidden"]
    n = sum(a * b for a, b in linears(shape)) + V * d * (1 if shape["tied"] else 2)
    if shape.get("qkv_bias"):  # Qwen2's q, k and v projections carry a bias
        n += shape["layers"] * (d + 2 * shape["kv_heads"] * (d // shape["heads"]))
    return n + d * (2 * shape["layers"] + 1)  # the norms' weights


def _linear_reduce(d_in: int, d_out: int, m: int, T: int, s: int, gram: bool) -> tuple[str, Cost]:
    """The cheaper exact route for one weight's per-row readings: per-row pieces or the ghost identities."""
    N = m * T
    # direct: B_kᵀA_k per row (the weight-gradient products again, per row), then dot, row norm, parts' sum,
    # a block of the weight's output rows at a time (lens_callbacks.credit.engines.ghost_routes.direct_param,
    # its batched path, which a GPU takes): the blocks stay in cache; what moves is B once, A once per block,
    # g_full once and the sum's difference (a CPU forms one part's piece at a time, in blocks of 2^18 elements)
    P = d_in * d_out
    cap = min(max(1 << 21, min(4 * N * d_in, P)), max(P, 1 << 18))  # as direct_param sizes its blocks
    vb = max(128, cap // max(1, m * d_in))
    blocks = -(-d_out // vb)
    direct = Cost(
        N * d_in * d_out + 2 * m * d_in * d_out + (m * m * d_in * d_out if gram else m * d_in * d_out),
        s * (N * d_out + blocks * N * d_in + 2 * d_in * d_out),
    )
    # ghost: <g_k, G> = Σ (B_k G) ∘ A_k (one product the size of the forward); ‖g_k‖² by the row Grams
    pairs = m * m if gram else m
    ghost = Cost(
        N * d_in * d_out + pairs * T * T * (d_in + d_out + 1),
        s * (N * (d_in + d_out) + d_in * d_out + 2 * pairs * T * T),
    )
    return ("direct", direct) if direct.macs + direct.bytes / 4 <= ghost.macs + ghost.bytes / 4 else ("ghost", ghost)


def _embedding(V: int, d: int, m: int, T: int, s: int, sparse: bool, gram: bool) -> Cost:
    N = m * T
    if not sparse:  # a [V, d] piece per row: zero-filled, scattered into, dotted, normed, summed
        return Cost(2 * m * V * d + (m * m * V * d if gram else 0), s * (4 * m * V * d))
    pairs = m * m if gram else m
    return Cost(N * d + pairs * T * T * d, s * (2 * N * d + pairs * T * T))


def route_counts(
    shape: dict, m: int, T: int, *, bytes_per_element: int = 4, readings: str = "shares", sparse_embedding: bool = True
) -> dict[str, Cost]:
    """MACs and bytes per route for ``m`` rows of ``T`` positions (see the module docstring)."""
    if readings not in ("shares", "all"):
        raise ValueError(f"`readings` must be 'shares' or 'all', got {readings!r}.")
    s, gram = bytes_per_element, readings == "all"
    V, d, L = shape["vocab"], shape["hidden"], shape["layers"]
    N, P = m * T, n_params(shape)
    lin = linears(shape)
    lin_macs = sum(a * b for a, b in lin)
    attn = L * 2 * m * T * T * d  # scores and the weighted sum, eager
    head = N * V * d
    fwd = Cost(N * lin_macs + attn + head, s * (P + N * (V * 2 + d * 12 * L)))
    # backward: input gradients (as the forward) and weight gradients (as the forward's weight products)
    bwd_inputs = Cost(N * lin_macs + 2 * attn + head, fwd.bytes)
    bwd_weights = Cost(N * lin_macs + head, s * P)
    adam = Cost(0, s * 7 * P)
    step = fwd + bwd_inputs + bwd_weights + adam
    red = Cost(0, 0)
    for a, b in lin:
        red = red + _linear_reduce(a, b, m, T, s, gram)[1]
    red = red + _linear_reduce(d, V, m, T, s, gram)[1]  # the LM-head use
    red = red + _embedding(V, d, m, T, s, sparse_embedding, gram)
    if shape["tied"]:  # the cross term of the two uses of one parameter, row by row
        red = red + Cost(m * T * T * d, s * 2 * m * T * T)
    red = red + Cost(N * d * (2 * L + 1) * 2, s * N * d * (2 * L + 1))  # norms: d-sized per-row pieces
    per_row = Cost(m * P * (1 + (m if gram else 0)), s * 3 * m * P)  # m × |θ| written, read for dots (and Gram)
    opacus_emb = Cost(0, s * 2 * m * V * d)  # its embedding grad samples are dense [m, V, d]
    return {
        "step": step,
        "ride": red,
        "separate": fwd + bwd_inputs + bwd_weights + red,
        "trainer": fwd + bwd_inputs + red,
        "vmap": fwd + bwd_inputs + bwd_weights + per_row,
        "opacus": fwd + bwd_inputs + bwd_weights + per_row + opacus_emb,
    }


def counts_table(
    name: str, shape: dict, m: int, T: int, *, bytes_per_element: int = 4, sparse_embedding: Optional[bool] = None
) -> str:
    """A markdown table of the counts and their ratios to a step, for the embedding's dense and sparse rules."""
    rows = []
    variants = [sparse_embedding] if sparse_embedding is not None else [False, True]
    for sp in variants:
        for readings in ("shares", "all"):
            c = route_counts(shape, m, T, bytes_per_element=bytes_per_element, readings=readings, sparse_embedding=sp)
            st = c["step"]
            for route in ("ride", "separate", "trainer", "vmap", "opacus"):
                if readings == "all" and route in ("trainer",):
                    continue
                x = c[route]
                rows.append(
                    f"| {'sparse' if sp else 'dense per row'} | {readings} | {route} | {x.macs:.3g} | {x.bytes:.3g} | "
                    f"{x.macs / st.macs:.2f} | {x.bytes / st.bytes:.2f} |"
                )
    st = route_counts(shape, m, T, bytes_per_element=bytes_per_element)["step"]
    head = [
        f"{name}: vocabulary {shape['vocab']:,}, width {shape['hidden']}, {shape['layers']} layers, MLP "
        f"{shape['intermediate']}, {'tied' if shape['tied'] else 'untied'} head, {n_params(shape) / 1e9:.2f} B "
        f"parameters; m = {m} rows of T = {T}; {bytes_per_element} bytes per element. A plain step: "
        f"{st.macs:.3g} multiply-adds, {st.bytes:.3g} bytes. `ride` is the extra over a step; the others are "
        "whole passes (ratio to a step).",
        "",
        "| embedding rule | readings | route | multiply-adds | bytes | MACs / step | bytes / step |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    return "\n".join(head + rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--bytes", type=int, default=2, help="bytes per element (2: bf16, 4: float32)")
    args = ap.parse_args(argv)
    print(counts_table(args.shape, SHAPES[args.shape], args.rows, args.tokens, bytes_per_element=args.bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
