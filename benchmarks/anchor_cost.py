"""Cost of the anchor projection on the GRPO example, as ratios to one plain training step.

    python benchmarks/anchor_cost.py [--steps 12] [--threads 1]

Measured in one run (one process, one thread by default):

- the plain training step (sampling + forward + backward + Adam) of ``lens_callbacks.examples.grpo.GRPOModule``;
- one fire, split into ``observe`` (fp32 delta, Gram row, eigh, OLS: Gram only) and ``project``
  (streamed reconstruction of ``θ̂`` with the readings) for window sizes W = 4, 8, 16;
- the anchor's per-step gradient (one forward + backward through ``credit_terms`` at the anchor's weights);
- end to end: a Trainer step with the callback in ``projected`` mode against ``off``;
- memory: ring bytes and Gram bytes against the parameter bytes.

Prints a markdown table (pasted into docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SIZE = {"n_layer": 2, "n_embd": 32}


def _model():
    from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

    return GRPOModule(
        n_layer=SIZE["n_layer"],
        n_embd=SIZE["n_embd"],
        n_head=2,
        group_size=4,
        max_new_tokens=3,
        optimizer="adam",
        lr=3e-3,
        dropout=0.1,
        seed=0,
    ), AdditionDataModule(batch_size=4)


def _step_times(steps: int, callbacks) -> list[float]:
    from lightning.pytorch import Callback, Trainer, seed_everything

    class Clock(Callback):
        def __init__(self):
            self.t: list[float] = []

        def on_train_batch_start(self, *a):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *a):
            self.t.append(time.perf_counter() - self._t0)

    seed_everything(0, verbose=False)
    model, data = _model()
    clock = Clock()
    Trainer(
        max_steps=steps,
        callbacks=[*callbacks, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    ).fit(model, data)
    return clock.t[2:]  # the first steps pay one-off costs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=32)
    ap.add_argument("--cadence", type=int, default=20, help="for the amortised column: one fire every `cadence` steps")
    args = ap.parse_args(argv)
    SIZE.update(n_layer=args.n_layer, n_embd=args.n_embd)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("PYTHONHASHSEED", "0")

    from lens_callbacks.anchor import Rank1TrajProjector
    from lens_callbacks.callbacks.anchor import AnchorProjectionCallback
    from lens_callbacks.credit.engine import evaluate_terms

    plain = _step_times(args.steps, [])
    step = statistics.median(plain)
    anch = _step_times(args.steps, [AnchorProjectionCallback(mode="projected", cadence=2, delay_K=2, w_cap=8)])
    step_anchor = statistics.median(anch)

    # A trained-once module for the component timings.
    from lightning.pytorch import seed_everything

    seed_everything(0, verbose=False)
    model, data = _model()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model.train()
    model.training_step(batch, 0)  # builds and caches the rollout batch
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    n_params = sum(p.numel() for p in params.values())
    g = torch.Generator().manual_seed(0)
    drift = {n: 1e-3 * torch.randn(p.shape, generator=g) for n, p in params.items()}

    def snap(t):
        return {n: p + t * drift[n] + 1e-4 * torch.randn(p.shape, generator=g) for n, p in params.items()}

    rows = []
    for W in (4, 8, 16):
        obs, prj = [], []
        for _ in range(args.repeats):
            pr = Rank1TrajProjector(n0=4, w_cap=W, pool="layer")
            for t in range(W - 1):
                pr.observe(snap(t), t)
            s_new = snap(W - 1)
            # The random-walk null is cached per (tick gaps, d): the first repeat pays it, the median does not.
            t0 = time.perf_counter()
            pr.observe(s_new, W - 1)
            t1 = time.perf_counter()
            pr.project(W, truth=params)
            t2 = time.perf_counter()
            obs.append(t1 - t0)
            prj.append(t2 - t1)
        o, p_ = statistics.median(obs), statistics.median(prj)
        ring_bytes = sum(x.numel() * 4 for x in pr.ring.base.values()) * (pr.ring.W + 1)
        gram_bytes = sum(D.numel() * 8 for D in pr.ring.D.values())
        rows.append((W, o, p_, ring_bytes, gram_bytes))

    times = []
    anchor_w = {n: p + 3 * drift[n] for n, p in params.items()}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.random.fork_rng():
            terms, names, leaves, _ = evaluate_terms(model, None, "native", params=anchor_w)
            torch.autograd.grad(terms.terms.sum(), leaves, allow_unused=True)
        times.append(time.perf_counter() - t0)
    grad_t = statistics.median(times)

    print(
        f"GRPO example (n_layer={args.n_layer}, n_embd={args.n_embd}): {n_params} trainable parameters, "
        f"{torch.get_num_threads()} thread(s); plain step {1e3 * step:.1f} ms (median of {len(plain)})\n"
    )
    print(
        "| W | observe (Gram row + eigh + OLS) / step | project (θ̂ + readings) / step | fire / step "
        f"| fire / (cadence {args.cadence} × step) | ring bytes / params | Gram bytes / params |"
    )
    print("|---|---|---|---|---|---|---|")
    pbytes = n_params * 4
    for W, o, p_, rb, gb in rows:
        print(
            f"| {W} | {o / step:.3f} | {p_ / step:.3f} | {(o + p_) / step:.3f} | {(o + p_) / step / args.cadence:.4f} "
            f"| {rb / pbytes:.1f} | {gb / pbytes:.2e} |"
        )
    print()
    print(f"| per-step anchor gradient (forward + backward at θ̂) / step | {grad_t / step:.3f} |")
    print(f"| Trainer step with projected mode (cadence 2, delay 2, w_cap 8) / plain step | {step_anchor / step:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
