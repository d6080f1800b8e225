"""Cost of the step-conservation check against the plain training step it reads.

Tiny GPT-2 policy (transformers, built in memory), a batch of B sequences of length T, plain SGD.
Measured in one run, as ratios to the plain step (forward + backward + optimizer.step):

- ``record``: what ``on_before_optimizer_step`` adds: copy θ_before (+ copy .grad when no audit is at hand);
- ``read``: what reading θ_after adds: ``step_conservation`` (float64 reductions per tensor);
- extra memory in parameter-sized buffers.

    python benchmarks/conservation_cost.py [--layers 2 --embd 64 --T 48 --B 8 --repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lens_callbacks.credit.readings.conservation import step_conservation  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--T", type=int, default=48)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=args.T, n_embd=args.embd, n_layer=args.layers, n_head=2)
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.SGD(params, lr=1e-2)
    x = torch.randint(0, 64, (args.B, args.T))  # [B, T]

    def train_step() -> None:
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    plain, record, record_grad, read = [], [], [], []
    train_step()  # warm-up
    for _ in range(args.repeats):
        plain.append(timed(train_step))
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        before: list = []
        grads: list = []
        record.append(timed(lambda: before.extend(p.detach().clone() for p in params)))
        record_grad.append(timed(lambda: grads.extend(p.grad.detach().clone() for p in params)))
        opt.step()
        out: list = []
        read.append(timed(lambda: out.append(step_conservation(before, [p.detach() for p in params], 1e-2, grads))))
    base = statistics.median(plain)
    r = out[0]
    print(
        f"GPT-2 {args.layers} layers, n_embd {args.embd}, {n_params} params, B={args.B}, T={args.T}, {args.dtype}, 1 thread"
    )
    print(f"plain step (median of {args.repeats}): {base * 1e3:.2f} ms")
    print(f"record θ_before        / plain step: {statistics.median(record) / base:.4f}")
    print(f"record .grad copy      / plain step: {statistics.median(record_grad) / base:.4f}")
    print(f"read (step_conservation) / plain step: {statistics.median(read) / base:.4f}")
    print("extra memory: 1 parameter-sized buffer with the audit's parts at hand, 2 with the .grad copy")
    print(
        f"last reading: error {r.relative_error:.3e}, floor {r.update_precision_floor:.3e}, limited {r.update_precision_limited}"
    )


if __name__ == "__main__":
    main()
