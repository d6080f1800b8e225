"""The worked example of docs/probe_credit.md: the GRPO demo with two probes of reference answers.

Trains the demo of cli_configs/grpo_probe.yaml (tiny GPT-2 learning ``a+b=``, 4 prompts × 8 rollouts per
step, Adam, dropout 0.1) for ``--steps`` steps with ``ProbeCreditCallback(every_n_steps=--every)`` and
prints each reading's table and, at the end, ``(step, probe, predicted, actual)`` of every reading.

    python scripts/probe_demo.py [--steps 101 --every 20]      # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=101)
    ap.add_argument("--every", type=int, default=20)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl

    from lens_callbacks import ProbeCreditCallback
    from lens_callbacks.examples.grpo import AdditionDataModule
    from lens_callbacks.examples.grpo.probe import GRPOProbeModule

    class Show(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (trainer.global_step - 1) % args.every == 0:
                for _, r in sorted(probe.last_reports.items()):
                    print(r.render(top_k=3), flush=True)

    pl.seed_everything(0, verbose=False)
    module = GRPOProbeModule(
        n_probe=16,
        probe_seed=12345,
        n_layer=2,
        n_embd=32,
        n_head=2,
        group_size=8,
        max_new_tokens=3,
        dropout=0.1,
        optimizer="adam",
        lr=1e-3,
        seed=0,
    )
    probe = ProbeCreditCallback(every_n_steps=args.every, log_table_every_n_steps=0)
    pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, Show()],
    ).fit(module, AdditionDataModule(batch_size=4, num_prompts=256, data_seed=0))
    for step, name, predicted, actual in probe.history:
        print(f"step {step:4d}  {name:<9} predicted {predicted:+.4e}  actual {actual:+.4e}")


if __name__ == "__main__":
    main()
