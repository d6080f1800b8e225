"""The benchmark's memory probe reads known allocations, and the benchmark runs on one small size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("credit_cost", ROOT / "benchmarks" / "credit_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peak_probe_sees_a_known_peak_and_ignores_older_frees():
    bench = _bench()
    old = [torch.empty(500_000) for _ in range(4)]  # allocated before: freeing them must not offset the peak

    def fn():
        old.clear()  # 8 MB freed first: a plain running sum would never climb above zero
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(250_000)  # 1 MB, alive with a: peak 5 MB
        del a, b
        c = torch.empty(750_000)  # 3 MB after the peak
        del c

    peak = bench.peak_alloc_bytes(fn)
    assert 5_000_000 <= peak < 5_000_000 + 64 * 1024


def test_measure_and_section_writer(tmp_path):
    pytest.importorskip("transformers")
    bench = _bench()
    torch.set_num_threads(1)
    row = bench.measure(8, repeats=1, engines=("reference", "ghost", "ride"))
    assert row["m"] == 8 and row["B"] == 8 and row["audited_over_plain_train"] > 1.0
    assert row["reference_over_train"] > 0 and row["ride_over_train"] > -1.0
    assert row["conservation_error"] < 1e-5 and row["mem_audit"] > 0 and row["mem_ride"] > 0
    assert row["max_share_gap"] < 1e-5  # the ghost engine's shares against the reference engine's (float32)
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\n" + bench.SECTION + "\n\nold\n\n## Other\n\nkept\n")
    bench.write_section(doc, bench.table([row], 1))
    text = doc.read_text()
    assert "old" not in text and "## Other\n\nkept" in text and "| gpt2 | 8 | " in text
