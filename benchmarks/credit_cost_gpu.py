"""Credit audit cost on a GPU: a random-initialised policy of Qwen2-0.5B's shape, bf16, m = 64, T = 512.

Prepared for a machine with one CUDA GPU (not run by the test suite). It builds ``Qwen2ForCausalLM``
with Qwen2-0.5B's configuration (24 layers, width 896, 14 heads / 2 KV heads, MLP 4864, vocabulary
151,936, tied embeddings) from random weights in bfloat16 — nothing is downloaded — and times, with
CUDA events and interleaved repeats:

- the plain training step (forward, backward, AdamW step) on ``m`` rows of ``T`` tokens;
- the one-pass engine as a separate pass (``engine="ghost"``, ``dtype="native"``), readings
  ``"projected"`` and ``"all"`` (the Gram of the parts needs the tied 151,936 × 896 head's per-part
  pieces in chunks, so it costs more there);
- the training step with the engine riding along (``RideAlong``), readings ``"projected"``;

and reports ratios of medians and peak memory (``torch.cuda.max_memory_allocated``) against the plain
step. The reference engine (``m + 1`` backward passes) is timed once at most, with ``--reference``.

Usage: ``python benchmarks/credit_cost_gpu.py [--parts 64] [--tokens 512] [--repeats 3] [--reference]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lens_callbacks.credit import CreditTerms, by_rollout, disintegrate  # noqa: E402
from lens_callbacks.credit.engines.ghost import RideAlong  # noqa: E402


def qwen2_05b(device: str, dtype: torch.dtype, layers: int) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype)


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
        return CreditTerms(terms, trained, torch.arange(ids.shape[0], device=ids.device), torch.arange(ids.shape[0], device=ids.device))


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median milliseconds and peak extra bytes of ``fn()`` over ``repeats`` calls."""
    times = []
    peak = 0
    for _ in range(repeats):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return statistics.median(times), peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time the reference engine once")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("credit_cost_gpu.py needs a CUDA device; none is available.")
        return 2
    dev = "cuda"
    policy = Policy(qwen2_05b(dev, torch.bfloat16, args.layers))
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    m, T = args.parts, args.tokens
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, 151936, (m, T), generator=g).to(dev)  # [m, T]
    adv = torch.randn(m, generator=g).to(dev)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool, device=dev)  # [m, T]
    trained[:, T // 4 :] = True
    batch = (ids, adv, trained)
    n_params = sum(p.numel() for p in policy.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        policy.credit_terms(batch).terms.sum().backward()
        opt.step()

    def ride(readings="projected"):
        r = RideAlong(policy).start()
        try:
            opt.zero_grad(set_to_none=True)
            loss = policy.credit_terms(batch).terms.sum()
            r.on_loss(loss, by_rollout, readings=readings)
            loss.backward()
            out = r.report(by_rollout, partition_name="by_rollout", readings=readings)
            opt.step()
        finally:
            r.clear()
        if not hasattr(out, "projected_share"):
            raise RuntimeError(f"ride-along fell back: {out}")

    def ghost(readings):
        return lambda: disintegrate(policy, batch, "by_rollout", engine="ghost", dtype="native", readings=readings)

    step(), ride()  # warm-up
    rows = {}
    t_step, m_step = timed(step, args.repeats)
    rows["plain step"] = (t_step, m_step)
    rows["ride-along step, projected"] = timed(ride, args.repeats)
    rows["ghost separate, projected"] = timed(ghost("projected"), args.repeats)
    rows["ghost separate, all (Gram)"] = timed(ghost("all"), 1)
    if args.reference:
        rows["reference separate"] = timed(lambda: disintegrate(policy, batch, "by_rollout", engine="reference", dtype="native"), 1)
    out = {"params": n_params, "m": m, "T": T, "dtype": "bfloat16", "device": torch.cuda.get_device_name()}
    for k, (t, mem) in rows.items():
        out[k] = {"ms": round(t, 1), "over_plain_step": round(t / t_step, 3), "peak_extra_GiB": round(mem / 2**30, 2)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
