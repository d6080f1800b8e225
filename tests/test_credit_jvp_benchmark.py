"""The forward-mode engine's benchmark runs on one small size and its rows are honest readings."""

from __future__ import annotations

import pytest


def test_benchmark_runs_small_and_agrees_with_the_reference(bench_script):
    pytest.importorskip("transformers")
    bench = bench_script("credit_jvp_cost")
    rows = bench.main(["--turns", "4", "--rows", "2", "--repeats", "1", "--policy", "gpt2"])
    assert [r["partition"] for r in rows] == ["by_turn (turn)", "by_segment (turn_index)"]
    by_turn = rows[0]
    assert by_turn["m"] == 2 * 4  # one part per turn of each episode
    for r in rows:
        assert r["share_diff"] < 1e-5 and r["conservation_error"] < 1e-5  # float32 audit
        assert r["jvp"] > 0 and r["reference"] > 0
    assert "| policy |" in bench.table(rows)
