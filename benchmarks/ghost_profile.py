"""Where the one-pass engine's time goes at a real shape: a training step with the audit riding on it,
against the plain step, on a random-initialised transformers policy.

Default: a Qwen2-shaped policy (vocabulary 151,936, tied embedding / LM head, width 896, 2 layers, a small
MLP), ``by_rollout`` over m = 8 rows of T = 128 positions, float32, one thread. Plain step = forward +
backward + Adam; ride step = the same with :class:`RideAlong` reducing inside the backward
(``readings="shares"`` by default). Both are timed interleaved in one process by the process's CPU time (one
thread: on a shared machine CPU time is steadier than wall time); the ratio is of medians.
``--profile`` prints the ride step's top operators (torch.profiler, self CPU time); ``--separate`` also
times the separate one-pass audit (:func:`disintegrate_ghost`) after a plain forward + backward.

    OMP_NUM_THREADS=1 python benchmarks/ghost_profile.py --repeats 3 --profile
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lens_callbacks.credit import CreditTerms, by_rollout  # noqa: E402
from lens_callbacks.credit.engines.ghost import RideAlong, disintegrate_ghost  # noqa: E402


class Policy(nn.Module):
    """GRPO terms over a causal LM: ``terms[k, t] = -A_k log π(y_kt) / n_trained`` on trained positions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def credit_terms(self, batch: Any) -> CreditTerms:
        ids, adv, trained = batch
        logits = self.model(input_ids=ids).logits  # [B, T, V]
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))  # [B, T]
        return CreditTerms(terms, trained, torch.arange(ids.shape[0]), torch.arange(ids.shape[0]))


def make_policy(kind: str, layers: int, seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=1024,
            num_hidden_layers=layers,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=512,
        )
        model = Qwen2ForCausalLM(cfg)
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            max_position_embeddings=1024,
        )
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"`--model` must be 'qwen2' or 'llama', got {kind!r}.")
    cfg._attn_implementation = "eager"
    return Policy(model).train()


def make_batch(vocab: int, m: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (m, T), generator=g)  # [m, T]
    adv = torch.randn(m, generator=g)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool)  # [m, T]
    trained[:, T // 4 :] = True
    return ids, adv, trained


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2", choices=["qwen2", "llama"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--readings", default="shares", choices=["all", "shares", "projected"])
    ap.add_argument("--profile", action="store_true", help="print the ride step's top operators")
    ap.add_argument("--separate", action="store_true", help="also time the separate one-pass audit")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    policy = make_policy(args.model, args.layers)
    vocab = policy.model.config.vocab_size
    batch = make_batch(vocab, args.m, args.T)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-5)

    def plain():
        opt.zero_grad(set_to_none=True)
        policy.credit_terms(batch).terms.sum().backward()
        opt.step()

    def ride():
        r = RideAlong(policy).start()
        try:
            opt.zero_grad(set_to_none=True)
            loss = policy.credit_terms(batch).terms.sum()
            r.on_loss(loss, by_rollout, readings=args.readings)
            loss.backward()
            out = r.report(by_rollout, partition_name="by_rollout", readings=args.readings)
            opt.step()
        finally:
            r.clear()
        if isinstance(out, str):
            raise RuntimeError(f"the ride-along audit fell back: {out}")
        return out

    def separate():
        opt.zero_grad(set_to_none=True)
        policy.credit_terms(batch).terms.sum().backward()
        disintegrate_ghost(policy, batch, "by_rollout", dtype="native", readings=args.readings)
        opt.step()

    modes = {"plain": plain, "ride": ride}
    if args.separate:
        modes["separate"] = separate
    for fn in modes.values():  # warm-up (and Adam's state allocated)
        fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(args.repeats):
        for k, fn in modes.items():
            t0 = time.process_time()
            fn()
            times[k].append(time.process_time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in policy.parameters())
    print(
        f"{args.model} layers={args.layers} params={n_params / 1e6:.1f}M m={args.m} T={args.T} readings={args.readings} "
        f"threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    for k, v in med.items():
        print(
            f"  {k:9s} median {v:7.3f} s CPU  ratio to plain {v / med['plain']:.3f}  ({', '.join(f'{x:.2f}' for x in times[k])})"
        )
    print(f"  peak RSS {rss_gib():.2f} GiB")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ride()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
