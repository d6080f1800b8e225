"""One training run of a ``cli_configs`` YAML, shrunk, checkpointing every step; resumes from ``last.ckpt``.

Run as a script by ``test_resume.py`` (``python tests/examples/resume_run.py CONFIG OUT``). Writes, per
optimizer step, one JSON line of every reading the lens callbacks made (floats as ``float.hex``, so
equality is bitwise) to ``OUT/readings.jsonl``, flushed and synced before the next step starts, and the
final parameters to ``OUT/params.pt``. When ``OUT/ckpt/last.ckpt`` exists the run resumes from it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

# Small enough for a test, large enough that the anchor projects and an epoch ends mid-run.
MAX_STEPS = 10
MODEL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4)
# Per module class: the tool example's warm start is shortened (it runs once, before step 0).
MODEL_EXTRA = {"GRPOToolsModule": dict(warm_start_steps=8)}
# Per datamodule class, 4 steps per epoch.
DATA = {
    "AdditionDataModule": dict(batch_size=2, num_prompts=8),
    "ToolsAdditionDataModule": dict(prompts_per_step=2, n_prompts=8),
}
CALLBACKS = {
    "AnchorProjectionCallback": dict(cadence=1, delay_K=1, w_cap=4, figure_every_n_fires=0),
    "CreditAuditCallback": dict(print_last_report=False),
}


def _name(spec: dict) -> str:
    return spec["class_path"].rpartition(".")[2]


def _build(spec: dict, **override):
    mod, _, name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    return cls(**{**spec.get("init_args", {}), **override})


def _plain(v):
    """JSON-ready, bitwise: floats as hex, tensors as lists of hex."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v.hex() if math.isfinite(v) else repr(v)
    if isinstance(v, torch.Tensor):
        return [_plain(float(x)) for x in v.detach().double().reshape(-1)]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in sorted(v.items())}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if dataclasses.is_dataclass(v):
        return {
            "type": type(v).__name__,
            **{f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v) if f.name != "grads"},
        }
    return repr(v)


class Record(pl.Callback):
    """Listed last: what every lens callback read at this step, and the epoch readings at each epoch end."""

    def __init__(self, path: Path):
        self.path = path
        self.written: set = set()

    def _write(self, row: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _readings(self, trainer) -> dict:
        out = {}
        for cb in trainer.callbacks:
            name = type(cb).__name__
            if name == "CreditAuditCallback":
                out[name] = {"values": _plain(cb.last_values), "report": _plain(cb.last_report)}
            elif name == "ConservationCheckCallback":
                out[name] = _plain(cb.last_reading)
            elif name == "AnchorProjectionCallback":
                out[name] = {
                    "reading": _plain(cb.last_reading),
                    "merged": cb.merged_step,
                    "m_anchor": None
                    if cb.m_anchor is None
                    else _plain({k: v.double().sum() for k, v in cb.m_anchor.items()}),
                }
        return out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._write({"step": trainer.global_step - 1, "loss": _plain(float(loss)), "readings": self._readings(trainer)})

    def _write_epoch(self, trainer) -> None:
        # Keyed by the step the callbacks logged their epoch readings at: a resumed run may close an epoch
        # at the start of the next one (Lightning skips the end of an epoch whose last batch was checkpointed).
        cbs = [cb for cb in trainer.callbacks if getattr(cb, "last_epoch_step", None) is not None]
        steps = {cb.last_epoch_step for cb in cbs}
        if not cbs or steps == self.written:
            return
        self.written = steps
        epoch = {type(cb).__name__: _plain(cb.last_epoch_values) for cb in cbs}
        self._write({"epoch_end_step": sorted(steps), "epoch": epoch})

    def on_train_epoch_start(self, trainer, pl_module):
        self._write_epoch(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._write_epoch(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._write_epoch(trainer)


def main(config: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(config).read_text())
    pl.seed_everything(int(cfg.get("seed_everything", 0)), verbose=False)
    torch.set_num_threads(1)
    callbacks = [_build(c, **CALLBACKS.get(_name(c), {})) for c in cfg["trainer"].get("callbacks", [])]
    ckpt_dir = out_dir / "ckpt"
    callbacks += [
        Record(out_dir / "readings.jsonl"),
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=0, save_last=True),
    ]
    model = _build(cfg["model"], **MODEL, **MODEL_EXTRA.get(_name(cfg["model"]), {}))
    data = _build(cfg["data"], **DATA[_name(cfg["data"])])
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    last = ckpt_dir / "last.ckpt"
    trainer.fit(model, data, ckpt_path=str(last) if last.exists() else None)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out_dir / "params.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
