"""docs/readings.md quotes what the demo (cli_configs/grpo_credit.yaml) logs, its printout opens
with a defined reading, and its policy learns the task.

One run of the demo as a user starts it (the console script, the shipped config); every number the
narrative of docs/readings.md quotes is recomputed here from that run's TensorBoard event files, read
back with tensorboard's own EventAccumulator, and compared with the text to the digits it shows.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "readings.md"


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


class DemoRun:
    """The scalars of one demo run, and the window means and final values the docs quote."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        acc = _events(run_dir)
        self.tags = set(acc.Tags()["scalars"])
        self.series = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in self.tags}
        self.n_steps = max(s for s, _ in self.series["train/accuracy"]) + 1

    def mean(self, tag: str, first: int, last: int) -> float:
        """Mean of ``tag`` over steps ``first..last`` (inclusive; negative: counted from the end), NaN steps left out."""
        lo = first if first >= 0 else self.n_steps + first
        hi = last if last >= 0 else self.n_steps + last
        vals = [v for s, v in self.series[tag] if lo <= s <= hi and not math.isnan(v)]
        assert vals, (tag, lo, hi)
        return math.fsum(vals) / len(vals)

    def final(self, tag: str) -> float:
        return self.series[tag][-1][1]

    def count_defined(self) -> int:
        return sum(1 for _, v in self.series["credit/undefined_fraction"] if v == 0.0)


def _quoted(doc: str) -> list[tuple[str, float, int]]:
    """Every number the docs quote under a ``<!-- demo:KEY -->`` mark: (key, value, digits after the point)."""
    return [
        (m.group(1), float(m.group(2)), len(m.group(3) or ""))
        for m in re.finditer(r"<!-- demo:([a-z0-9_]+) -->\s*(-?[0-9]+(?:\.([0-9]+))?)", doc)
    ]


def _carry_prompts_pct() -> float:
    """Percent of the demo's prompts whose sum has two digits, from the datamodule its config builds."""
    import yaml

    from lens_callbacks.examples.grpo import AdditionDataModule

    cfg = yaml.safe_load((ROOT / "cli_configs" / "grpo_credit.yaml").read_text())
    pairs = AdditionDataModule(**cfg["data"]["init_args"]).pairs  # [N, 2]
    return 100 * float((pairs.sum(dim=1) >= 10).double().mean())


# What each marked number in docs/readings.md is, as a function of the run. Percentages are quoted ×100.
QUOTES = {
    "accuracy_first20": lambda r: r.mean("train/accuracy", 0, 19),
    "accuracy_last20": lambda r: r.mean("train/accuracy", -20, -1),
    "reward_first20": lambda r: r.mean("train/reward", 0, 19),
    "reward_last20": lambda r: r.mean("train/reward", -20, -1),
    "steps": lambda r: r.n_steps,
    "eff_norm_first50": lambda r: r.mean("credit/concentration/effective_parts_norm", 0, 49),
    "eff_norm_last50": lambda r: r.mean("credit/concentration/effective_parts_norm", -50, -1),
    "eff_pos_first50": lambda r: r.mean("credit/concentration/effective_parts_positive", 0, 49),
    "eff_pos_last50": lambda r: r.mean("credit/concentration/effective_parts_positive", -50, -1),
    "top1_last50_pct": lambda r: 100 * r.mean("credit/concentration/top1_share", -50, -1),
    "gini_first50": lambda r: r.mean("credit/concentration/gini_norm", 0, 49),
    "gini_last50": lambda r: r.mean("credit/concentration/gini_norm", -50, -1),
    "negative_fraction_pct": lambda r: 100 * r.mean("credit/concentration/negative_fraction", 0, -1),
    "negative_mass": lambda r: r.mean("credit/concentration/negative_mass", 0, -1),
    "positive_first50": lambda r: r.mean("credit/by_advantage_sign/projected_share/positive", 0, 49),
    "negative_last50": lambda r: r.mean("credit/by_advantage_sign/projected_share/negative", -50, -1),
    "ledger_negative": lambda r: r.final("credit/ledger/gradient/by_advantage_sign/negative"),
    "ledger_positive": lambda r: r.final("credit/ledger/gradient/by_advantage_sign/positive"),
    "defined_steps": lambda r: r.count_defined(),
    "bsimple_first50": lambda r: r.mean("credit/noise/b_simple_ema", 0, 49),
    "bsimple_last50": lambda r: r.mean("credit/noise/b_simple_ema", -50, -1),
    "ledger_no_carry": lambda r: r.final("credit/ledger/gradient/by_source/no_carry"),
    "ledger_carry": lambda r: r.final("credit/ledger/gradient/by_source/carry"),
    "carry_prompts_pct": lambda r: _carry_prompts_pct(),
    "ledger_reward_0": lambda r: r.final("credit/ledger/gradient/by_reward/reward=0"),
    "ledger_reward_01": lambda r: r.final("credit/ledger/gradient/by_reward/reward=0.1"),
    "ledger_reward_11": lambda r: r.final("credit/ledger/gradient/by_reward/reward=1.1"),
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lens_callbacks",
            "fit",
            "--config",
            str(ROOT / "cli_configs" / "grpo_credit.yaml"),
            f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.enable_progress_bar=false",
            # The trained policy, for the demo-learns test's greedy answers; saving draws no random number.
            "--trainer.enable_checkpointing=true",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return DemoRun(out / "grpo_credit" / "version_0"), r.stdout


# Readings that are counts (or sums of per-step shares that add up to 1 exactly): quoted exactly.
EXACT = {"steps", "defined_steps", "carry_prompts_pct", "ledger_no_carry", "ledger_carry"}

# The demo's arithmetic takes ATen's vectorised kernels for the CPU it runs on, and the x86 machines
# this suite runs on differ in them: over 200 steps of training, sums and means of readings move.
# Measured with `python scripts/demo_spread.py` (the demo under ATEN_CPU_CAPABILITY=default, avx2 and
# avx512 on one AMD EPYC with AVX-512, relative spread (max - min) / |max|): the largest spread of any
# reading but the noise scale is 2.0e-3 (effective_parts_norm over the last 50 steps: 1.9705-1.9744),
# top1_share 2.4e-4, the ledgers up to 9.1e-4; on an AVX2 machine the default and scalar kernels had put
# top1_share 7e-4 apart. A quoted figure is the run's, rounded, give or take three times the largest
# spread seen (6e-3 of it).
CPU_SPREAD = 6e-3
# The noise scale's last-50-step mean is a ratio of two small moving averages and moves percents between
# kernel sets: 123.66 / 123.82 / 124.44 under avx512 / default / avx2 here (6.3e-3), and 122.0 on an
# Intel Xeon with AVX-512 (1.6e-2 below the quote of 124 it then had). It is quoted to two digits and
# held to three times the largest spread seen.
SPREAD = {"bsimple_last50": 0.05}


@pytest.mark.slow
def test_readings_doc_quotes_the_numbers_the_demo_logs(demo):
    run, _ = demo
    doc = DOC.read_text()
    quoted = _quoted(doc)
    marked = set(re.findall(r"<!-- demo:([a-z0-9_]+) -->", doc))
    assert marked == {k for k, _, _ in quoted}, "a mark with no number after it"
    assert marked == set(QUOTES), (sorted(marked - set(QUOTES)), sorted(set(QUOTES) - marked))
    assert EXACT <= set(QUOTES)
    wrong = []
    for key, got, digits in quoted:
        want = QUOTES[key](run)
        spread = 0.0 if key in EXACT else SPREAD.get(key, CPU_SPREAD) * abs(want)
        if abs(got - want) > 0.5 * 10**-digits + spread + 1e-9:
            wrong.append(f"demo:{key}: docs say {got}, the run logs {want:.6g}")
    assert not wrong, wrong


@pytest.mark.slow
def test_demo_printout_opens_with_a_defined_reading(demo):
    _, stdout = demo
    body = stdout[stdout.index("credit audit, step ") :]
    head = body.split("\n", 2)[:2]
    assert "UNDEFINED" not in "\n".join(body.split("\n")[:4]) and head[1].startswith("credit by by_rollout"), head
    assert "nan" not in body.split("cancellation")[0]


# Accuracy the demo must gain from its first 20 steps to its last 20 (it logs about 0.6).
LEARNS_BY = 0.3


@pytest.mark.slow
def test_demo_policy_learns_the_sums_not_one_answer(demo):
    run, _ = demo
    first, last = run.mean("train/accuracy", 0, 19), run.mean("train/accuracy", -20, -1)
    assert last - first >= LEARNS_BY, (first, last)

    # The trained policy's greedy answer to every prompt of the task: more than one answer (no collapse
    # onto the most frequent sum), and right on more prompts than any single answer could be.
    import torch
    import yaml

    from lens_callbacks.examples.grpo import GRPOModule

    (ckpt,) = sorted((run.run_dir / "checkpoints").glob("*.ckpt"))
    module = GRPOModule.load_from_checkpoint(ckpt, map_location="cpu")
    m = yaml.safe_load((ROOT / "cli_configs" / "grpo_credit.yaml").read_text())["data"]["init_args"]["max_operand"]
    pairs = torch.cartesian_prod(torch.arange(m + 1), torch.arange(m + 1))  # [(m+1)², 2]
    answers = module.greedy_answers(pairs)
    sums = [str(a + b) for a, b in pairs.tolist()]
    right = sum(x == s for x, s in zip(answers, sums))
    best_constant = max(sums.count(s) for s in set(sums))
    assert len(set(answers)) >= 2, answers
    assert right > best_constant, (right, best_constant, list(zip(sums, answers)))
