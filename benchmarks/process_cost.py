"""Cost of the process-reward instrument, as ratios measured in one run.

1. ProcessRewardCallback on the GRPO example: training time with the callback / without it.
2. The instrument alone on the spec's reference shape (400 groups x 8 rollouts x 40 tokens): audit time
   / the time of one plain GRPO-example training step.

    python benchmarks/process_cost.py [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def _fit(steps: int, callbacks) -> float:
    from lightning.pytorch import Trainer, seed_everything

    from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

    seed_everything(0)
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model, data = GRPOModule(seed=0), AdditionDataModule(batch_size=4, data_seed=0)
    t = time.perf_counter()
    trainer.fit(model, data)
    return time.perf_counter() - t


def main() -> None:
    import logging

    import torch

    from lens_callbacks.callbacks.process import ProcessRewardCallback
    from lens_callbacks.process import audit_groups

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)

    plain, with_cb = [], []
    for _ in range(args.repeats):  # interleaved, best of n
        plain.append(_fit(args.steps, []))
        with_cb.append(_fit(args.steps, [ProcessRewardCallback(log_text_every_n_steps=0)]))
    step = min(plain) / args.steps
    print(
        f"ProcessRewardCallback on the GRPO example ({args.steps} steps, best of {args.repeats}): "
        f"time with / without = {min(with_cb) / min(plain):.3f}"
    )

    rng = random.Random(0)
    groups = [
        ([[rng.randrange(1000) for _ in range(40)] for _ in range(8)], [float(rng.random() < 0.5) for _ in range(8)])
        for _ in range(400)
    ]
    t = time.perf_counter()
    audit = audit_groups(groups)
    dt = time.perf_counter() - t
    print(
        f"audit of 400 groups x 8 rollouts x 40 tokens: {dt / step:.2f} GRPO-example training steps "
        f"(kill fires on {audit.n_killed} of {audit.n_groups})"
    )


if __name__ == "__main__":
    main()
