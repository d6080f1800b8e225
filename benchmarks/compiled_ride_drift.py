"""What riding along does to a ``torch.compile``'d training step: graph breaks and parameter drift.

The one-pass engine's hooks (forward hooks on every covered layer, tensor hooks on their outputs) inside a
compiled training step break its graph and change the kernels it runs. This script trains the 2-layer Llama
of ``tests/callbacks/test_training_modes.py`` (sdpa attention, Adam) for ``--steps`` optimizer steps, once
without any callback and once riding along (the callback's compile block lifted), for each backend, and
prints dynamo's graph-break count and how far the trained parameters moved apart. ``CreditAuditCallback``
quotes the result when it declines to ride along on a compiled module.

Usage: ``python benchmarks/compiled_ride_drift.py [--steps 6]``; written to
``benchmarks/results/compiled_ride_drift-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(backend: str, audited: bool, steps: int):
    import lightning.pytorch as pl

    from lens_callbacks.callbacks import CreditAuditCallback
    from tests.callbacks.test_training_modes import Mode, Policy, micro_batches

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mode = Mode("drift", compile=backend, capture="training_step")
    pl.seed_everything(0, verbose=False)
    module = Policy(mode)
    callbacks = []
    if audited:
        cb = CreditAuditCallback(capture="training_step", log_figure=False, log_table_every_n_steps=0)
        cb._note_compiled = lambda pl_module: setattr(cb, "_compiled", [])  # lift the block: ride along anyway
        callbacks = [cb]
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(micro_batches(mode, steps), batch_size=None))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    rides = callbacks[0].n_ride_along if callbacks else None
    return {n: p.detach().clone() for n, p in module.named_parameters()}, breaks, rides


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    lines = []
    for backend in ("inductor", "aot_eager"):
        plain, b0, _ = run(backend, False, args.steps)
        rode, b1, rides = run(backend, True, args.steps)
        drift = max(float((plain[n] - rode[n]).abs().max()) for n in plain)
        rel = max(float((plain[n] - rode[n]).norm() / plain[n].norm()) for n in plain)
        lines.append(
            f"{backend}: graph breaks {b0} unaudited, {b1} riding along ({rides}/{args.steps} steps rode); "
            f"parameters after {args.steps} steps: max |Δθ| {drift:.2g}, largest relative change {rel:.2g}"
        )
        print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / f"compiled_ride_drift-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"python benchmarks/compiled_ride_drift.py --steps {args.steps}\n\n" + "\n".join(lines) + "\n")
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
