"""ArmsRecorder: what one run of ``lens-callbacks anchor-arms`` hands back to the harness.

Read-only: it takes norms and hashes under ``torch.no_grad``, draws no random number and writes nothing into
the module, its ``.grad`` or the optimizer. At the end of the fit it writes one JSON file that the harness
(:mod:`lens_callbacks.anchor.arms`) reads.
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
        self._last_step = -1

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

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        v = trainer.callback_metrics.get(self.score)
        if v is not None:
            self.scores.append((trainer.global_step, float(v)))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if getattr(trainer, "global_rank", 0) != 0:
            return
        from .anchor import AnchorProjectionCallback

        anchors = [c for c in trainer.callbacks if isinstance(c, AnchorProjectionCallback)]
        fires = []
        mode = None
        if anchors:
            mode = anchors[0].mode
            for r in anchors[0].readings:
                fires.append({k: getattr(r, k) for k in (
                    "t_fast", "t_W", "W", "projected", "evr1", "evr1_null", "r2", "coef_pred_error",
                    "gated_on_fraction", "tau_mean", "weight_err_ratio", "weight_err_ratio_gated", "comm_bytes")})
        last = anchors[0].last_refusal if anchors else None
        payload = {
            "score_tag": self.score,
            "scores": self.scores,
            "logged_tags": sorted(trainer.callback_metrics),
            "grad_norms": self.grad_norms,
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
