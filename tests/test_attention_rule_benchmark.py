"""The attention rule's benchmark runs at a small size and its readings are honest."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def test_benchmark_runs_small_and_its_value_matches_torch(tmp_path, bench_script):
    bench = bench_script("attention_rule_cost")
    out = tmp_path / "attention.txt"
    assert bench.main(["--tokens", "128", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("python benchmarks/attention_rule_cost.py --tokens 128") and "| 1 × 2 × 128 × 16 |" in text
    row = bench.measure(128, 2, 16, 1, "cpu", torch.float32)
    # its value check against an independent reference: math attention written out
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(16)).masked_fill(
        ~torch.ones(128, 128, dtype=torch.bool).tril(), -math.inf
    )
    ref = torch.softmax(scores, -1) @ v
    assert float((F.scaled_dot_product_attention(q, k, v, is_causal=True) - ref).abs().max()) < 1e-5
    assert row["value_max_abs_diff"] < 1e-5
    assert 0 < row["products_share"] <= 1 and row["rule_s"] > 0 and row["fused_forward_backward_s"] > 0


def test_grouped_heads_and_a_fixed_block_beside_the_default(tmp_path, bench_script):
    bench = bench_script("attention_rule_cost")
    out = tmp_path / "attention.txt"
    args = ["--tokens", "64", "--heads", "4", "--kv-heads", "2", "--rows", "2", "--head-dim", "8", "--repeats", "1"]
    assert bench.main([*args, "--compare-chunk", "8", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 2 × 4 on 2 × 64 × 8 |" in text and "the rule at 8 queries a block / fused fwd+bwd:" in text
    row = bench.measure(64, 4, 8, 1, "cpu", torch.float32, kv_heads=2, rows=2, compare_chunk=8)
    assert row["shape"] == [2, 4, 64, 8] and row["kv_heads"] == 2
    assert row["value_max_abs_diff"] < 1e-5  # the rule's value against torch's grouped attention
    assert row["rule_at_chunk_over_fused_forward_backward"] > 0
