"""One small data-parallel fit on 2 CPU ranks (gloo), run as a script: ``ddp``, ``ddp_spawn`` or FSDP2.

``python tests/callbacks/_distributed_worker.py STRATEGY DTYPE OUT_DIR [anchor]`` trains a tiny policy for
``STEPS`` steps with a :class:`CreditAuditCallback` (global scope) and a :class:`ConservationCheckCallback`,
each rank on its own batches (:func:`make_batch`). After the audit of each step every rank records the
global reading, the whole parameters and the whole averaged ``.grad``; at the end each rank writes
``OUT_DIR/rank{r}.pt`` (readings, parameters, conservation readings, logged scalars). The test that runs
it recomputes every reading in one process from those parameters and batches. With ``anchor`` the run has
an :class:`AnchorProjectionCallback` (``"projected"``) alone for ``ANCHOR_STEPS`` steps instead, and each
rank records the merged ``.grad`` of every step, the anchor's readings and the final parameters. With
``extras`` the audit also reads ``EXTRAS`` (extra partitions), and each rank records every warning raised
during the fit.

``ddp`` and FSDP2 (Lightning's ``ModelParallelStrategy``) re-launch this script for rank 1, so it must be
a script rather than a test function.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402

from lens_callbacks.callbacks.conservation import ConservationCheckCallback  # noqa: E402
from lens_callbacks.callbacks.credit_audit import CreditAuditCallback, ExtraReadings  # noqa: E402
from lens_callbacks.credit import CreditTerms  # noqa: E402

VOCAB, D, T, B, STEPS, W = 11, 8, 5, 3, 2, 2
ANCHOR_STEPS = 6
ANCHOR_KW = dict(mode="projected", cadence=1, delay_K=1, n0=3, w_cap=3, log_readings=False)
EXTRAS = ["by_advantage_sign", "by_group"]


def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: tokens ``[B, T+1]``, trained mask ``[B, T]``, advantages ``[B]``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return tokens, mask, adv


class Policy(pl.LightningModule):
    """Embedding → tanh → logits; GRPO-style terms ``-A_k · logπ · mask / n_trained``."""

    def __init__(self, dtype: torch.dtype = torch.float64, fsdp: bool = False, steps: int = STEPS) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.hid = nn.Linear(D, D)
        self.out = nn.Linear(D, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.to(dtype)
        self.fsdp, self.steps = fsdp, steps

    def configure_model(self) -> None:
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.hid, mesh=mesh)
        fully_shard(self.out, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, batch) -> CreditTerms:
        tokens, mask, adv = batch  # [B, T+1], [B, T], [B]
        h = torch.tanh(self.hid(self.emb(tokens[:, :-1])))  # [B, T, D]
        lp = torch.log_softmax(self.out(h), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T]
        m = mask.to(lp.dtype)
        terms = -adv[:, None].to(lp.dtype) * lp * m / m.sum()  # [B, T]
        n = tokens.shape[0]
        return CreditTerms(terms, mask, torch.arange(n), torch.arange(n), advantages=adv.to(lp.dtype))

    def credit_terms(self, batch) -> CreditTerms:
        return self(batch)  # through __call__: FSDP2 gathers the root's shards in its forward hook

    def training_step(self, batch, batch_idx):
        return self(batch).terms.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        batches = [make_batch(self.global_rank, s) for s in range(self.steps)]
        return torch.utils.data.DataLoader(batches, batch_size=None)


class Recorder(pl.Callback):
    """After the audit: the global reading, the whole θ and the whole averaged .grad of every step."""

    def __init__(self, audit: CreditAuditCallback, check: ConservationCheckCallback, out_dir: str, caught=None) -> None:
        self.audit, self.check, self.out_dir = audit, check, out_dir
        self.caught = caught if caught is not None else []  # warnings raised during the fit, when recorded
        self.rows: list[dict] = []
        self.conservation: list = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lens_callbacks.callbacks._distributed import full_grads, full_params

        r = self.audit.last_report
        assert r is not None, self.audit.last_refusal
        self.rows.append(
            {
                "step": trainer.global_step,
                "part_names": r.part_names,
                "projected_share": r.projected_share,
                "norm_share": r.norm_share,
                "cancellation": r.cancellation,
                "conservation_error": r.conservation_error,
                "grad_match": r.grad_match,
                "full_grad_norm": r.full_grad_norm,
                "loss": r.loss,
                "logged": dict(self.audit.last_values),
                "params": {k: v.clone() for k, v in full_params(pl_module).items()},
                "grad": [g.clone() for g in full_grads(pl_module)],
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.conservation.append(self.check.last_reading)

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {
                "rows": self.rows,
                "conservation": [
                    None
                    if c is None
                    else {
                        "source": getattr(c, "source", None),
                        "error": getattr(c, "relative_error", None),
                        "floor": getattr(c, "update_precision_floor", None),
                        "holds": bool(getattr(c, "holds", False)),
                        "text": c.render(),
                    }
                    for c in self.conservation
                ],
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                "warnings": [(w.category.__name__, str(w.message), w.filename) for w in self.caught],
                "readings_text": self.audit.step_readings.render(),
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


class AnchorRecorder(pl.Callback):
    """After the anchor's merge: the whole merged .grad and the reading of every step; the final θ."""

    def __init__(self, anchor, check, out_dir: str) -> None:
        self.anchor, self.check, self.out_dir, self.rows, self.conservation = anchor, check, out_dir, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lens_callbacks.callbacks._distributed import full_grads

        r = self.anchor.last_reading
        self.rows.append(
            {
                "grad": [g.clone() for g in full_grads(pl_module)],
                "reading": None if r is None else r.to_dict("anchor/"),
                "refusal": None if self.anchor.last_refusal is None else self.anchor.last_refusal.reason,
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        c = self.check.last_reading
        self.conservation.append(
            {
                "kind": type(c).__name__,
                "source": getattr(c, "source", None),
                "error": getattr(c, "relative_error", None),
                "holds": bool(getattr(c, "holds", False)),
                "text": c.render(),
            }
        )

    def on_train_end(self, trainer, pl_module):
        from lens_callbacks.callbacks._distributed import full_params

        torch.save(
            {
                "rows": self.rows,
                "params": full_params(pl_module),
                "strategy": type(trainer.strategy).__name__,
                "conservation": self.conservation,
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def main(strategy_name: str, dtype_name: str, out_dir: str, what: str = "audit") -> None:
    dtype = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    fsdp = strategy_name == "fsdp"
    if fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=1)
    else:
        strategy = strategy_name
    if what == "anchor":
        from lens_callbacks.callbacks.anchor import AnchorProjectionCallback

        anchor = AnchorProjectionCallback(**ANCHOR_KW)
        # No audit: the check holds each step against the (merged, sharded) .grad it gathers.
        check = ConservationCheckCallback(tolerance=1e-4, log_figure=False)
        pl.Trainer(
            max_steps=ANCHOR_STEPS,
            accelerator="cpu",
            devices=W,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[anchor, check, AnchorRecorder(anchor, check, out_dir)],
            default_root_dir=out_dir,
        ).fit(Policy(dtype, fsdp=fsdp, steps=ANCHOR_STEPS))
        return
    extras = EXTRAS if what == "extras" else None
    audit = CreditAuditCallback(
        dtype=dtype_name, log_table_every_n_steps=0, log_figure=False, extras=ExtraReadings(partitions=extras)
    )
    check = ConservationCheckCallback(tolerance=1e-4, log_figure=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always" if extras else "ignore")
        trainer = pl.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=W,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[audit, check, Recorder(audit, check, out_dir, caught)],
            default_root_dir=out_dir,
        )
        trainer.fit(Policy(dtype, fsdp=fsdp))


if __name__ == "__main__":
    from tests._spawn_exit import leave_rank

    main(*sys.argv[1:5])
    leave_rank()  # every rank has written its file at `on_train_end`
