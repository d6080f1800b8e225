"""The offline gate: replay of saved checkpoints, in-process and through the console script."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lens_callbacks.anchor import load_checkpoints, replay

ROOT = Path(__file__).resolve().parents[2]


def _save_run(tmp_path, n=121, every=10, seed=0):
    """A drifting two-tensor 'model' saved every `every` steps, half Lightning-style, half plain."""
    g = torch.Generator().manual_seed(seed)
    v = {"layer.0.weight": torch.randn(8, 4, generator=g), "layer.0.bias": torch.randn(8, generator=g)}
    x0 = {k: torch.randn(t.shape, generator=g) for k, t in v.items()}
    saved = {}
    for t in range(0, n, every):
        sd = {k: x0[k] + 0.02 * t * v[k] + 0.005 * torch.randn(v[k].shape, generator=g) for k in v}
        sd["step_count"] = torch.tensor(t)  # integer tensors are ignored
        saved[t] = sd
        if (t // every) % 2:
            torch.save({"state_dict": sd, "global_step": t}, tmp_path / f"epoch=0-step={t}.ckpt")
        else:
            torch.save(sd, tmp_path / f"policy_step_{t:06d}.pt")
    return saved


def test_load_checkpoints_reads_both_layouts(tmp_path):
    saved = _save_run(tmp_path)
    got = load_checkpoints(tmp_path)
    assert sorted(got) == sorted(saved)
    for t in saved:
        assert set(got[t]) == {"layer.0.weight", "layer.0.bias"}
        assert torch.equal(got[t]["layer.0.weight"], saved[t]["layer.0.weight"])


def test_cli_prints_the_table_of_the_replay(tmp_path):
    saved = _save_run(tmp_path)
    out_json = tmp_path / "gate.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lens_callbacks",
            "anchor-gate",
            str(tmp_path),
            "--cadence",
            "10",
            "--delay-K",
            "20",
            "--pool",
            "global",
            "--json",
            str(out_json),
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "ratio_gated" in r.stdout and "decision: project" in r.stdout
    rep = replay(
        {t: {k: x for k, x in sd.items() if x.is_floating_point()} for t, sd in saved.items()}, 10, 20, pool="global"
    )
    payload = json.loads(out_json.read_text())
    assert payload["summary"]["median_ratio"] == pytest.approx(rep.median_ratio, rel=1e-12)
    assert len(payload["fires"]) == len(rep.readings) == 11  # snapshots 0..100 fire at 20..120
    # the projection beats the stale snapshot on a drift by a wide margin
    assert rep.median_ratio < 0.5 and np.isfinite(rep.median_vel_ratio)


def test_cli_errors_are_clear(tmp_path, capsys):
    from lens_callbacks.commands.anchor_gate import main

    assert main([str(tmp_path / "nope"), "--cadence", "10", "--delay-K", "0"]) == 2
    assert "must be a directory" in capsys.readouterr().err
    _save_run(tmp_path)
    assert main([str(tmp_path), "--cadence", "0", "--delay-K", "0", "--no-progress"]) == 2
    assert "`cadence` must be a positive int" in capsys.readouterr().err
    assert main([str(tmp_path), "--cadence", "10", "--delay-K", "0", "--n0", "8", "--w-cap", "5"]) == 2
    assert "`w_cap` must be" in capsys.readouterr().err


def test_replays_checkpoints_that_lightning_wrote(tmp_path):
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    sys.path.insert(0, str(ROOT / "tests" / "callbacks"))
    from test_anchor_callback import Tiny

    seed_everything(0, verbose=False)
    model = Tiny()
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_weights_only=False)
    live = {}

    from lightning.pytorch import Callback

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            live[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    Trainer(
        max_steps=24,
        callbacks=[Record(), ck],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    ).fit(model)
    got = load_checkpoints(tmp_path)
    assert sorted(got) == list(range(2, 25, 2))
    for t, sd in got.items():  # the step read back is the number of optimizer steps the weights carry
        assert all(torch.equal(sd[k], live[t][k]) for k in sd)
    rep = replay(got, cadence=2, delay_K=4, pool="global")
    assert len(rep.readings) == len(range(2, 21, 2)) and any(r.projected for r in rep.readings)
