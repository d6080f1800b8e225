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
    assert text.startswith("python benchmarks/attention_rule_cost.py --tokens 128") and "| 2 × 128 × 16 |" in text
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
