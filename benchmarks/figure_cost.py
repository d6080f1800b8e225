"""What drawing the credit audit's figures costs: the demo's step with a table every step, with and without figures.

``python benchmarks/figure_cost.py --steps 12 --repeats 3``: ``cli_configs/grpo_credit.yaml`` (the demo: tiny
GPT-2, the audit by rollout with three extra partitions) trained for ``--steps`` steps with a text table every step
(``log_table_every_n_steps: 1``) and the figures drawn every step (``log_figure_every_n_steps: 1``), on
their default cadence (every 100 steps: not within the run) and never (``log_figure: false``), against
only the last table (``log_table_every_n_steps: 0``). Runs alternate so the machine's load falls on all three; the median wall time
of a step (batch start to the next batch start, the first two steps left out) is printed, with ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "cli_configs" / "grpo_credit.yaml"


class StepClock(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())


def step_time(steps: int, table_every: int, figures: bool, figure_every: int) -> float:
    from lens_callbacks.cli import cli_main

    out = tempfile.mkdtemp()
    sys.argv = ["lens-callbacks"]
    cli = cli_main(
        [
            "--config",
            str(CONFIG),
            f"--trainer.max_steps={steps}",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={out}",
            f"--trainer.callbacks.init_args.log_table_every_n_steps={table_every}",
            f"--trainer.callbacks.init_args.log_figure={str(figures).lower()}",
            f"--trainer.callbacks.init_args.log_figure_every_n_steps={figure_every}",
            "--trainer.callbacks.init_args.print_last_report=false",
        ],
        run=False,
    )
    clock = StepClock()
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # The last interval holds fit end (the last table and figures, whatever the cadence): left out too.
    gaps = [b - a for a, b in zip(clock.starts[2:-2], clock.starts[3:-1])]
    return statistics.median(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    arms = {
        "table and figures every step": (1, True, 1),
        "table every step, figures every 100": (1, True, 100),
        "table every step, no figures": (1, False, 100),
        "last table only": (0, True, 100),
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.repeats):
        for name, (every, figs, fig_every) in arms.items():
            times[name].append(step_time(args.steps, every, figs, fig_every))
    base = statistics.median(times["last table only"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<36} median step {m * 1e3:8.1f} ms   x{m / base:6.2f} of 'last table only'")


if __name__ == "__main__":
    main()
