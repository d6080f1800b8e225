"""Cost of the global (DDP) credit reading on 2 CPU ranks (gloo), against what a rank does anyway.

Tiny GPT-2 policy (transformers, built in memory), each rank a batch of B sequences of length T,
``by_rollout`` (m = B parts per rank), float32. Per repeat, on both ranks, timed on rank 0:

- ``train``: forward + backward + the all-reduce of the gradient that DDP does (``all_reduce`` of |θ|);
- ``ddp_allreduce``: that all-reduce alone;
- ``local``: ``disintegrate(..., project_onto=ḡ)`` on the rank's batch (``--engine``: ``auto``, the default,
  takes the one-pass engine for ``by_rollout``; ``reference`` takes m + 1 backward passes);
- ``global``: :func:`global_report` on top of it (3 small all-gathers + one all-reduce of 2·|θ|).

Reported: medians over interleaved repeats, as ratios (``global/local``, ``global/ddp_allreduce``,
``(local+global)/train``), so the shared machine's noise cancels.

    python benchmarks/distributed_cost.py [--layers 2 --embd 64 --T 24 --B 8 --repeats 7 --engine auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lens_callbacks.credit import CreditTerms, disintegrate  # noqa: E402
from lens_callbacks.credit.readings.distributed import Collectives, global_report  # noqa: E402


def _collectives(rank: int, world: int) -> Collectives:
    def gather(x):
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x.contiguous())
        return torch.stack(out)

    def reduce_sum(x):
        dist.all_reduce(x)
        return x

    return Collectives(rank, world, gather, reduce_sum)


def _worker(rank: int, world: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=64,
            n_embd=args.embd,
            n_layer=args.layers,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
    )
    model.eval()
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 64, (args.B, args.T + 1), generator=g)
    adv = torch.randn(args.B, generator=g)

    def credit_terms(_batch):
        logits = model(tokens[:, :-1]).logits  # [B, T, V]
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T]
        terms = -adv[:, None] * lp / lp.numel()  # [B, T]
        return CreditTerms(terms, torch.ones_like(terms, dtype=torch.bool), torch.arange(args.B), torch.arange(args.B))

    params = [p for p in model.parameters() if p.requires_grad]
    coll = _collectives(rank, world)
    times: dict[str, list[float]] = {k: [] for k in ("train", "ddp_allreduce", "local", "global")}
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        grads = torch.autograd.grad(credit_terms(None).terms.sum(), params)
        flat = torch.cat([x.reshape(-1) for x in grads])  # [|θ|]
        dist.all_reduce(flat)
        times["train"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat.clone())
        times["ddp_allreduce"].append(time.perf_counter() - t0)
        applied, i = [], 0
        for p in params:
            applied.append(flat[i : i + p.numel()].view(p.shape) / world)
            i += p.numel()
        dist.barrier()
        t0 = time.perf_counter()
        local = disintegrate(
            model,
            None,
            dtype="float32",
            terms_fn=credit_terms,
            keep_grads=True,
            project_onto=applied,
            engine=args.engine,
        )
        times["local"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        rep = global_report(local, applied, coll)
        times["global"].append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        queue.put((med, sum(p.numel() for p in params), rep.share_sum, rep.grad_match, local.engine))
    # Both ranks reach the teardown together, and leave without the interpreter's exit: gloo was seen to abort
    # a worker there ("terminate called without an active exception", SIGABRT) even after the group was
    # destroyed, in about one run in five. The queue's message is written already.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--T", type=int, default=24)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--engine", default="auto", choices=("auto", "ghost", "reference"), help="the local audit's engine")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(2, args, args.port, queue), nprocs=2, join=True)
    med, n, share_sum, grad_match, engine = queue.get()
    print(
        f"params {n}, B={args.B} rows × T={args.T} per rank, m = {args.B} parts per rank, 2 ranks, float32, engine {engine}"
    )
    print(f"share_sum {share_sum:.9f}  grad_match {grad_match:.2e}")
    print(
        f"global/local {med['global'] / med['local']:.3f}  global/ddp_allreduce {med['global'] / med['ddp_allreduce']:.2f}  "
        f"(local+global)/train {(med['local'] + med['global']) / med['train']:.2f}"
    )


if __name__ == "__main__":
    main()
