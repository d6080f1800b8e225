"""Probe credit on 2 CPU ranks (gloo, ``ddp``), run as a script: ``python _probe_distributed_worker.py OUT_DIR``.

The policy and the per-rank training batches are those of ``_distributed_worker.py``; each rank holds a
probe batch of its own (:func:`probe_batch`), so the global probe is the rank mean. Every rank records,
per step, θ before and after the step and the :class:`ProbeCreditCallback` reading, and writes
``OUT_DIR/rank{r}.pt``. The test recomputes the readings in one process.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
torch.set_num_threads(1)
warnings.filterwarnings("ignore")

import _distributed_worker as base  # noqa: E402
import lightning.pytorch as pl  # noqa: E402

from lens_callbacks.callbacks.probe import ProbeCreditCallback  # noqa: E402

STEPS, W = 2, base.W


def probe_batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s probe tokens ``[4, T+1]``."""
    return torch.randint(0, base.VOCAB, (4, base.T + 1), generator=torch.Generator().manual_seed(777 + rank))


class ProbePolicy(base.Policy):
    def probe_batches(self):
        return {"heldout": probe_batch(self.global_rank)}

    def probe_loss(self, tokens):
        h = torch.tanh(self.hid(self.emb(tokens[:, :-1])))  # [n, T, D]
        lp = torch.log_softmax(self.out(h), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [n, T]
        return -lp.mean()


class Recorder(pl.Callback):
    def __init__(self, probe: ProbeCreditCallback, out_dir: str) -> None:
        self.probe, self.out_dir, self.rows = probe, out_dir, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        r = self.probe.last_reports["heldout"]
        self.rows.append(
            {
                "step": trainer.global_step - 1,
                "before": self.before,
                "after": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                "part_names": r.part_names,
                "contribution": r.contribution,
                "carried": r.carried,
                "loss_before": r.loss_before,
                "loss_after": r.loss_after,
                "alignment": r.alignment,
                "update_match": r.update_match,
                "splits": r.splits,
                "logged": dict(self.probe.last_values),
            }
        )

    def on_train_end(self, trainer, pl_module):
        torch.save({"rows": self.rows}, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main(out_dir: str) -> None:
    probe = ProbeCreditCallback(dtype="float64", log_table_every_n_steps=0, split_by=[])
    pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=W,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[probe, Recorder(probe, out_dir)],
        default_root_dir=out_dir,
    ).fit(ProbePolicy(torch.float64, steps=STEPS))


if __name__ == "__main__":
    from tests._spawn_exit import leave_rank

    main(sys.argv[1])
    leave_rank()  # every rank has written its file at `on_train_end`
