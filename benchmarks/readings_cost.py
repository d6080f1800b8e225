"""Cost of the readings beyond the primary report, relative to the audit itself.

    OMP_NUM_THREADS=1 python benchmarks/readings_cost.py

On the demo's policy and batch (tiny GPT-2, 2 layers, n_embd 32; 4 prompts × 8 rollouts), times in one
process: the by_rollout audit (the default engine, one pass; and the reference engine's m + 1 backward
passes), StepReadings.read with three derived extra partitions (by_advantage_sign, by_reward, by_source:
sums, concentration, noise scale, ledger), and the engine run for by_advantage_sign on its own (what an
extra partition costs when it is read by an engine rather than summed from the primary parts). Medians
over repeats; the ratios cancel the shared machine's speed.
"""

from __future__ import annotations

import statistics
import time

import torch

from lens_callbacks.credit import disintegrate
from lens_callbacks.credit.inputs.partition import PARTITIONS
from lens_callbacks.credit.readings.step_readings import RecordingPartition, StepReadings
from lens_callbacks.examples.grpo import GRPOModule


def median_time(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    torch.manual_seed(0)
    m = GRPOModule(n_layer=2, n_embd=32, n_head=2, group_size=8, max_new_tokens=3)
    rb, _ = m.sample_rollouts(torch.tensor([[3, 4], [7, 8], [1, 9], [5, 2]]))
    rec = RecordingPartition(PARTITIONS["by_rollout"], "by_rollout")
    names = ["by_advantage_sign", "by_reward", "by_source"]
    readings = StepReadings("by_rollout", [(n, PARTITIONS[n]) for n in names])
    report = disintegrate(m, rb, rec)
    terms, part = rec.take()
    audit = median_time(lambda: disintegrate(m, rb, "by_rollout"), 15)
    reference = median_time(lambda: disintegrate(m, rb, "by_rollout", engine="reference"), 7)
    extra = median_time(lambda: readings.read(report, part, terms, 0), 50)
    eng = disintegrate(m, rb, "by_advantage_sign").engine
    engine = median_time(lambda: disintegrate(m, rb, "by_advantage_sign"), 15)
    print(f"by_rollout audit ({report.n_parts} parts, engine {report.engine}): {1e3 * audit:.1f} ms")
    print(f"by_rollout audit, reference engine: {1e3 * reference:.1f} ms = {reference / audit:.1f} x the audit")
    print(
        f"three derived extra partitions + concentration + noise + ledger: {1e3 * extra:.2f} ms "
        f"= {extra / audit:.3f} x the audit"
    )
    print(
        f"by_advantage_sign through the engine ({eng}) instead: {1e3 * engine:.1f} ms = {engine / audit:.3f} x the audit"
    )


if __name__ == "__main__":
    main()
