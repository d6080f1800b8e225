"""Cost of the run record and of the offline audit, as ratios to a plain training step (one run).

    python benchmarks/record_cost.py [--steps 20]

Measures, on the tool-using example (tiny GPT-2, 8 episodes a step, single thread):
- the training step with RunRecordCallback (checkpoint at step 0 only) / without it;
- one replayed step of the offline audit / one training step (the replay skips sampling);
- one by_turn audit / one by_rollout audit of the same step (by the default engines: the reference engine's
  backward pass per turn, the one-pass engine for whole rollouts);
- the supervised warm start (once, before RL) / one training step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch import Trainer  # noqa: E402

from lens_callbacks.callbacks.records import RunRecordCallback  # noqa: E402
from lens_callbacks.commands.audit import replay_to  # noqa: E402
from lens_callbacks.credit.engine import disintegrate  # noqa: E402
from lens_callbacks.credit.inputs.trajectories import by_turn  # noqa: E402
from lens_callbacks.examples.grpo_tools import GRPOToolsModule, ToolsAdditionDataModule  # noqa: E402
from lens_callbacks.io.records import RunRecord  # noqa: E402


def _fit(steps: int, callbacks: list) -> float:
    m = GRPOToolsModule(seed=0)
    m.warm_start()  # a one-off stage before RL (fit then skips it): not part of a training step
    trainer = Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(m, ToolsAdditionDataModule(prompts_per_step=2))
    return (time.perf_counter() - t0) / steps


def _warm_start_time() -> float:
    m = GRPOToolsModule(seed=0)
    t0 = time.perf_counter()
    m.warm_start()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    _fit(2, [])  # warm-up (imports, allocator)
    plain = _fit(a.steps, [])
    d = Path(tempfile.mkdtemp())
    recorded = _fit(a.steps, [RunRecordCallback(str(d / "rec"))])
    rec = RunRecord(d / "rec")
    t0 = time.perf_counter()
    m = replay_to(rec, a.steps - 1, progress=False)
    replay = (time.perf_counter() - t0) / (a.steps - 1)
    batch = m.make_rollout_batch(rec.trajectories(a.steps - 1))
    t0 = time.perf_counter()
    r_roll = disintegrate(m, batch, "by_rollout")
    t_roll = time.perf_counter() - t0
    t0 = time.perf_counter()
    r_turn = disintegrate(m, batch, by_turn)
    t_turn = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (d / "rec" / "trajectories").iterdir()) / a.steps
    print(f"steps {a.steps}; plain training step {plain * 1e3:.1f} ms")
    print(f"training step with RunRecordCallback / without: {recorded / plain:.3f}")
    print(f"replayed step / training step:                 {replay / plain:.3f}")
    print(
        f"by_turn audit ({r_turn.n_parts} parts, {r_turn.engine}) / by_rollout audit ({r_roll.n_parts} parts, {r_roll.engine}): {t_turn / t_roll:.2f}"
    )
    print(f"record size per step: {size / 1024:.1f} KiB of JSON Lines")
    n_ws = GRPOToolsModule().hparams.warm_start_steps
    print(f"warm start ({n_ws} steps, once before RL) / training step: {_warm_start_time() / plain:.2f}")


if __name__ == "__main__":
    main()
