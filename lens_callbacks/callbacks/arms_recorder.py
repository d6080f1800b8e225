"""ArmsRecorder: what one run of ``lens-callbacks anchor-arms`` hands back to the harness.

Read-only: it takes norms and hashes under ``torch.no_grad``, draws no random number and writes nothing into
the module, its ``.grad`` or the optimizer. At the end of the fit it writes one JSON file that the harness
(:mod:`lens_callbacks.anchor.arms`) reads.

Under DDP every rank runs it: the score is averaged over ranks after each validation (each rank validates its
shard), the gradient traffic that :class:`~lens_callbacks.callbacks.PowerSGDStrategy` counted is gathered from
every rank at the end, and rank 0 writes the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ._distributed import strategy_collectives

__all__ = ["ArmsRecorder", "parameter_hash"]


def parameter_hash(module: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes, in ``named_parameters`` order."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ArmsRecorder(Callback):
    """Record the score, the gradient norm and the anchor's readings of one run, and write them as JSON.

    Put it after ``AnchorProjectionCallback`` in ``trainer.callbacks``: its ``on_before_optimizer_step``
    then sees the gradient the merger handed the optimizer.

    Args:
        out: path of the JSON file written at the end of the fit.
        score: the logged metric the arms are compared on (read from ``trainer.callback_metrics`` after each
            validation; the sanity check is skipped).
    """

    def __init__(self, out: str, score: str = "val/accuracy") -> None:
        super().__init__()
        if not isinstance(out, str) or not out:
            raise ValueError(f"`out` must be a non-empty path, got {out!r}.")
        if not isinstance(score, str) or not score:
            raise ValueError(f"`score` must be a metric name such as 'val/accuracy', got {score!r}.")
        self.out = out
        self.score = score
        self.scores: list[tuple[int, float]] = []
        self.grad_norms: list[tuple[int, float]] = []
        self.grad_comm_steps: list[tuple[int, int]] = []
        self._last_step = -1
        self._grad_bytes_seen = 0

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        with torch.no_grad():
            sq = 0.0
            for p in pl_module.parameters():
                if p.grad is not None:
                    sq += float(p.grad.detach().double().pow(2).sum())
        self.grad_norms.append((step, math.sqrt(sq) if math.isfinite(sq) else float("nan")))
        counter = getattr(trainer.strategy, "grad_comm_counter", None)
        if counter is not None:
            # the gradients were synchronised before this hook: the hook calls of this step are all counted
            self.grad_comm_steps.append((step, counter.bytes_total - self._grad_bytes_seen))
            self._grad_bytes_seen = counter.bytes_total

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        v = trainer.callback_metrics.get(self.score)
        x = float("nan") if v is None else float(v)
        if trainer.world_size > 1:
            # every rank calls this (no rank may skip a collective); NaN where a rank did not log the score
            x = float(trainer.strategy.reduce(torch.tensor(x, dtype=torch.float64), reduce_op="mean"))
        if math.isfinite(x):
            self.scores.append((trainer.global_step, x))

    def _grad_comm(self, trainer: Trainer) -> dict[str, Any]:
        """This run's gradient traffic; collective under DDP, so every rank calls it."""
        strategy = trainer.strategy
        counter = getattr(strategy, "grad_comm_counter", None)
        info: dict[str, Any] = {"world_size": trainer.world_size, "strategy": type(strategy).__name__}
        if trainer.world_size == 1:
            return {**info, "bytes": 0, "per_rank": [0], "per_step": [], "note": "no gradient traffic (single process)"}
        if counter is None:
            return {
                **info,
                "bytes": None,
                "per_rank": [],
                "per_step": [],
                "note": f"not counted: {type(strategy).__name__} has no byte counter "
                "(lens_callbacks.callbacks.PowerSGDStrategy counts it)",
            }
        mine = torch.tensor([float(counter.bytes_total)], dtype=torch.float64)
        per_rank = [int(b) for b in strategy_collectives(trainer).all_gather(mine).reshape(-1).tolist()]
        return {
            **info,
            "bytes": sum(per_rank),
            "per_rank": per_rank,
            "per_step": self.grad_comm_steps,
            "note": "",
            **strategy.grad_comm_info(),
        }

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        grad_comm = self._grad_comm(trainer)
        if getattr(trainer, "global_rank", 0) != 0:
            return
        from .anchor import AnchorProjectionCallback

        anchors = [c for c in trainer.callbacks if isinstance(c, AnchorProjectionCallback)]
        fires = []
        mode = None
        if anchors:
            mode = anchors[0].mode
            for r in anchors[0].readings:
                fires.append(
                    {
                        k: getattr(r, k)
                        for k in (
                            "t_fast",
                            "t_W",
                            "W",
                            "projected",
                            "evr1",
                            "evr1_null",
                            "r2",
                            "coef_pred_error",
                            "gated_on_fraction",
                            "tau_mean",
                            "weight_err_ratio",
                            "weight_err_ratio_gated",
                            "comm_bytes",
                        )
                    }
                )
        last = anchors[0].last_refusal if anchors else None
        payload = {
            "score_tag": self.score,
            "scores": self.scores,
            "logged_tags": sorted(trainer.callback_metrics),
            "grad_norms": self.grad_norms,
            "grad_comm": grad_comm,
            "anchor_mode": mode,
            "n_anchor_callbacks": len(anchors),
            "fires": fires,
            "refusal": None if last is None else f"{last.condition}: {last.reason}",
            "global_step": trainer.global_step,
            "param_hash": parameter_hash(pl_module),
        }
        path = Path(self.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        # NaN readings are written as null: JSON has no NaN.
        tmp.write_text(json.dumps(_finite(payload), indent=1))
        os.replace(tmp, path)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
