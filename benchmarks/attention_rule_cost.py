"""The forward-mode attention rule against torch's fused attention, one call, where its time goes.

One ``scaled_dot_product_attention`` call of a causal layer (default: the Llama shape's, 8 heads of 64, one
row of T = 8192 queries and keys, float32; ``--kv-heads`` groups the query heads onto fewer KV heads, as
Qwen2's 14 on 2, ``--rows`` sets the batch): the rule (:func:`~lens_callbacks.credit.engines.attention.
attention_jvp`, the value and its tangent along random tangents of Q, K and V) against torch's fused
kernel forward and forward + backward, medians of ``--repeats`` interleaved calls, one thread on a CPU.
Then one profiled call of the rule: the self time of its products (``bmm``, ``baddbmm``) against the
rest; the products' rate in floating-point operations a second beside the fused forward's (multiply-adds
counted over the causal half of the scores, ``H·T²/2·E`` a product: six for the rule, two for the fused
forward); and the rule's value against torch's (max abs difference). ``--compare-chunk N`` also times the
rule with ``N`` queries per block, interleaved with the rest (the default block against a fixed one).

Usage: ``python benchmarks/attention_rule_cost.py [--tokens 8192] [--heads 8] [--kv-heads 8] [--rows 1]
[--head-dim 64] [--repeats 3] [--compare-chunk 128] [--device cpu|cuda] [--dtype float32|bfloat16]``; written to
``benchmarks/results/attention_rule_cost-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lens_callbacks.credit.engines.attention import attention_jvp  # noqa: E402

PRODUCTS = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def measure(
    tokens: int,
    heads: int,
    head_dim: int,
    repeats: int,
    device: str,
    dtype: torch.dtype,
    kv_heads: Optional[int] = None,
    rows: int = 1,
    compare_chunk: Optional[int] = None,
) -> dict:
    """Times, the profiled split and the value check of one causal call at ``[rows, heads, tokens, head_dim]``
    (keys and values ``[rows, kv_heads, tokens, head_dim]``)."""
    kv = heads if kv_heads is None else kv_heads
    gqa = kv != heads
    g = torch.Generator().manual_seed(0)
    q, dq = (torch.randn(rows, heads, tokens, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    k, v, dk, dv = (
        torch.randn(rows, kv, tokens, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(4)
    )

    def rule(chunk: Optional[int] = None) -> Any:
        return attention_jvp(q, dq, k, dk, v, dv, is_causal=True, enable_gqa=gqa, chunk=chunk)

    def fused() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def fused_fb() -> Any:
        qg.grad = kg.grad = vg.grad = None  # as a training step's zero_grad: no accumulation timed
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=gqa).backward(dq)

    calls = {"rule": rule, "fused_forward": fused, "fused_forward_backward": fused_fb}
    if compare_chunk is not None:
        calls["rule_at_chunk"] = lambda: rule(compare_chunk)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_timed(fn, device))
    med = {k: statistics.median(v) for k, v in times.items()}

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        out, _ = rule()
        _sync(device)
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in prof.key_averages())
    prod = sum(getattr(e, attr) for e in prof.key_averages() if e.key in PRODUCTS)
    # multiply-adds under the causal mask (half the score matrix): the rule's six products are QKᵀ, Q̇Kᵀ,
    # QK̇ᵀ, PV, PV̇ and (P ∘ Ṡ)V; the fused forward's two are QKᵀ and PV
    half = rows * heads * tokens * tokens / 2 * head_dim
    rule_flops = 2 * 6 * half / (med["rule"] * prod / total) if total else float("nan")
    fused_flops = 2 * 2 * half / med["fused_forward"]
    ref = fused()
    return {
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": [rows, heads, tokens, head_dim],
        "kv_heads": kv,
        "repeats": repeats,
        "rule_s": med["rule"],
        "fused_forward_s": med["fused_forward"],
        "fused_forward_backward_s": med["fused_forward_backward"],
        "rule_over_fused_forward_backward": med["rule"] / med["fused_forward_backward"],
        "compare_chunk": compare_chunk,
        "rule_at_chunk_over_fused_forward_backward": (
            med["rule_at_chunk"] / med["fused_forward_backward"] if compare_chunk is not None else None
        ),
        "products_share": prod / total if total else float("nan"),
        "rule_products_flops": rule_flops,
        "fused_forward_flops": fused_flops,
        "value_max_abs_diff": float((out - ref).abs().max()),
    }


def render(row: dict) -> str:
    b, h, t, e = row["shape"]
    heads = f"{h} on {row['kv_heads']}" if row["kv_heads"] != h else f"{h}"
    at = row["compare_chunk"]
    lines = [
        "| shape (rows × heads × T × head dim, causal) | device, dtype | rule (value + tangent) | fused forward | "
        "fused forward + backward | rule / fused fwd+bwd | products' share of the rule | products' rate "
        "(rule / fused forward) | rule − fused value |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| {b} × {heads} × {t} × {e} | {row['device']}, {row['dtype']} | {row['rule_s']:.3f} s | "
        f"{row['fused_forward_s']:.3f} s | {row['fused_forward_backward_s']:.3f} s | "
        f"{row['rule_over_fused_forward_backward']:.2f} | {row['products_share']:.0%} | "
        f"{row['rule_products_flops'] / 1e9:.0f} / {row['fused_forward_flops'] / 1e9:.0f} GFLOP/s | "
        f"{row['value_max_abs_diff']:.1e} |",
    ]
    if at is not None:
        lines.append(
            f"\nthe rule at {at} queries a block / fused fwd+bwd: {row['rule_at_chunk_over_fused_forward_backward']:.2f} "
            f"(the default block: {row['rule_over_fused_forward_backward']:.2f})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--compare-chunk", type=int, default=None, help="also time the rule at this block of queries")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--out", default=None, help="results file (default benchmarks/results/attention_rule_cost-<date>.txt)"
    )
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    kv = args.heads if args.kv_heads is None else args.kv_heads
    if kv < 1 or args.heads % kv:
        ap.error(f"--kv-heads must divide --heads ({args.heads}), got {kv}")
    for name in ("rows", "tokens", "repeats", "compare_chunk"):
        val = getattr(args, name)
        if val is not None and val < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {val}")
    row = measure(
        args.tokens,
        args.heads,
        args.head_dim,
        args.repeats,
        args.device,
        getattr(torch, args.dtype),
        kv_heads=kv,
        rows=args.rows,
        compare_chunk=args.compare_chunk,
    )
    print(json.dumps(row), flush=True)
    table = render(row)
    print(table)
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"attention_rule_cost-{datetime.date.today().isoformat()}.txt"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/attention_rule_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with out.open("a") as f:
        f.write(f"{cmd.strip()}\n\n{table}\n\n")
    print(f"appended: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
