"""Credit audit cost on a GPU: a random-initialised policy of Qwen2.5-0.5B's shape, bf16, m = 64, T = 512.

Prepared for a machine with one CUDA GPU. It builds ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's configuration
(24 layers, width 896, 14 heads / 2 KV heads, MLP 4864, vocabulary 151,936, tied embedding / LM head) from
random weights in bfloat16 — nothing is downloaded — and times, with CUDA events, each mode interleaved
with the others over ``--repeats`` rounds:

- ``step``: the plain training step (forward, backward, AdamW step) on ``m`` rows of ``T`` tokens;
- ``ride_shares``: the same step with the one-pass engine riding along (``RideAlong``, ``readings="shares"``),
  reported as the extra over the plain step;
- ``sep_shares`` / ``sep_all``: the one-pass engine as a separate pass (``engine="ghost"``,
  ``dtype="native"``), ``readings="shares"`` and ``"all"``;
- ``trainer``: the separate pass with ``full_grad`` = the step's ``.grad`` (``full_grad="trainer"``);

and reports ratios of medians and the peak memory of each mode above the memory held before it
(``torch.cuda.max_memory_allocated``), in GiB and in parameter-sizes. The reference engine (``m + 1``
backward passes) is timed once with ``--reference``.

``python benchmarks/credit_cost_gpu.py [--parts 64] [--tokens 512] [--repeats 3] [--reference]``. The shape
flags (``--vocab``, ``--hidden``, ``--layers``, ...) and ``--device cpu --dtype float32`` exist so the script
can be smoke-tested on a CPU at a tiny size (``tests/test_credit_cost_benchmark.py`` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lens_callbacks.credit import CreditTerms, by_rollout, disintegrate  # noqa: E402
from lens_callbacks.credit.engines.ghost import RideAlong  # noqa: E402

#: Qwen2.5-0.5B's configuration (the shape only; the weights are random).
QWEN25_05B = dict(vocab=151936, hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, tied=True)
MODES = ("step", "ride_shares", "sep_shares", "sep_all", "trainer")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=64, help="m: rows = parts (by_rollout)")
    ap.add_argument("--tokens", type=int, default=512, help="T: positions per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time the reference engine once")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test at a tiny shape)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    for k, v in QWEN25_05B.items():
        if k != "tied":
            ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v, help=f"shape override (default {v})")
    args = ap.parse_args(argv)
    for k in ("parts", "tokens", "repeats", "vocab", "hidden", "layers", "intermediate", "heads", "kv_heads"):
        if getattr(args, k) < 1:
            ap.error(f"`--{k.replace('_', '-')}` must be a positive integer, got {getattr(args, k)!r}.")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error(
            f"`--hidden` ({args.hidden}) must be a multiple of `--heads` ({args.heads}), and `--heads` of `--kv-heads` ({args.kv_heads})."
        )
    return args


def qwen2(args: argparse.Namespace) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.tokens, 64),
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(args.device):
            model = Qwen2ForCausalLM(cfg)
    return model.to(DTYPES[args.dtype])


class Policy(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def credit_terms(self, batch) -> CreditTerms:
        ids, adv, trained = batch
        logits = self.model(input_ids=ids).logits  # [B, T, V]
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))  # [B, T]
        rows = torch.arange(ids.shape[0], device=ids.device)  # [B]
        return CreditTerms(terms, trained, rows, rows)


def build(args: argparse.Namespace) -> tuple[Policy, tuple, torch.optim.Optimizer]:
    """The policy, one batch of ``m`` rows of ``T`` tokens (the first quarter untrained), and AdamW."""
    policy = Policy(qwen2(args))
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    m, T, dev = args.parts, args.tokens, args.device
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, args.vocab, (m, T), generator=g).to(dev)  # [m, T]
    adv = torch.randn(m, generator=g).to(dev)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool, device=dev)  # [m, T]
    trained[:, T // 4 :] = True
    return policy, (ids, adv, trained), opt


def modes(policy: Policy, batch: tuple, opt: torch.optim.Optimizer) -> dict[str, Callable[[], Any]]:
    params = [p for p in policy.parameters() if p.requires_grad]

    def step():
        opt.zero_grad(set_to_none=True)
        policy.credit_terms(batch).terms.sum().backward()
        opt.step()

    def ride_shares():
        r = RideAlong(policy).start()
        try:
            opt.zero_grad(set_to_none=True)
            loss = policy.credit_terms(batch).terms.sum()
            r.on_loss(loss, by_rollout, readings="shares")
            loss.backward()
            out = r.report(by_rollout, partition_name="by_rollout", readings="shares")
            opt.step()
        finally:
            r.clear()
        if not hasattr(out, "projected_share"):
            raise RuntimeError(f"ride-along fell back: {out}")

    def separate(readings: str, trainer: bool = False) -> Callable[[], Any]:
        def fn():
            kw = dict(full_grad=[p.grad for p in params]) if trainer else dict(reference_grads="grad")
            return disintegrate(policy, batch, "by_rollout", engine="ghost", dtype="native", readings=readings, **kw)

        return fn

    return {
        "step": step,
        "ride_shares": ride_shares,
        "sep_shares": separate("shares"),
        "sep_all": separate("all"),
        "trainer": separate("shares", trainer=True),
    }


def timed(fn: Callable[[], Any], device: str) -> tuple[float, int]:
    """Milliseconds and peak bytes above the memory held before the call, for one call of ``fn``."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, 0  # CPU smoke runs: no allocator peak to read


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "credit_cost_gpu.py needs a CUDA device; none is available (use --device cpu at a tiny shape to smoke-test)."
        )
        return 2
    policy, batch, opt = build(args)
    fns = modes(policy, batch, opt)
    params = [p for p in policy.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)

    def fwd_bwd():
        policy.zero_grad(set_to_none=True)
        policy.credit_terms(batch).terms.sum().backward()

    for k in MODES:  # warm-up, and .grad for the separate passes
        fns[k]()
        if k == "ride_shares":
            fwd_bwd()
    times: dict[str, list[float]] = {k: [] for k in MODES}
    peaks: dict[str, int] = {k: 0 for k in MODES}
    for _ in range(args.repeats):
        for k in MODES:
            t, mem = timed(fns[k], args.device)
            times[k].append(t)
            peaks[k] = max(peaks[k], mem)
            if k == "ride_shares":
                fwd_bwd()  # .grad of this batch at the current weights, as at on_before_optimizer_step
    if args.reference:
        t, mem = timed(
            lambda: disintegrate(policy, batch, "by_rollout", engine="reference", dtype="native"), args.device
        )
        times["reference"], peaks["reference"] = [t], mem
    t_step = statistics.median(times["step"])
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in params),
        "m": args.parts,
        "T": args.tokens,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "shape": {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "intermediate", "heads", "kv_heads")},
    }
    for k, ts in times.items():
        med = statistics.median(ts)
        ratio = (med - t_step) / t_step if k == "ride_shares" else med / t_step
        out[k] = {
            "ms": round(med, 2),
            "over_plain_step": round(ratio, 3),
            "reads_as": "extra over the plain step" if k == "ride_shares" else "times the plain step",
            "peak_GiB": round(peaks[k] / 2**30, 3),
            "peak_over_step_in_params": round((peaks[k] - peaks["step"]) / param_bytes, 2),
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
