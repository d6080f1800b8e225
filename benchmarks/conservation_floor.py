"""How large a healthy reading's ``conservation_error`` gets, per engine and dtype: the data behind the floor.

Every engine (reference, one-pass with each readings set, riding along, forward mode) audits healthy steps of
tiny policies built in memory — transformers Llama (sdpa; eager for the forward-mode engine), Qwen2 with a
tied head, GPT-2 (tied, eager), an ``nn.MultiheadAttention`` policy and an embedding-heavy policy — in
float64, float32, bfloat16 and float32 under bf16 autocast, over several seeds. Each reading's error is
divided by what its floor scales with (``u · max(1, scale)``,
:func:`lens_callbacks.credit.precision.conservation_floor`), so the printed ``units`` are the rounding
units a healthy reading used; ``FLOOR_UNITS`` (times ``PROJECTED_FACTOR`` for projected shares alone) are
set well above the largest seen, per coarsest dtype (float32/float64 and half precision).

Usage: ``python benchmarks/conservation_floor.py [--seeds 5]``; the full table is written to
``benchmarks/results/conservation_floor-<date>.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lens_callbacks.credit import CreditTerms, disintegrate  # noqa: E402
from lens_callbacks.credit.engines.ghost import RideAlong  # noqa: E402
from lens_callbacks.credit.inputs.partition import by_rollout  # noqa: E402
from lens_callbacks.credit.precision import FLOOR_UNITS, PROJECTED_FACTOR, floor_units  # noqa: E402

V, T, B = 96, 24, 8
# A Llama at a real vocabulary, wider and deeper: longer reductions, the rounding that real shapes add.
LARGE = dict(vocab=32000, width=256, layers=4, T=128, B=4)


def hf(kind: str, attn: str, seed: int) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        cls = tf.LlamaForCausalLM
    elif kind == "llama-32k":
        cfg = tf.LlamaConfig(
            vocab_size=LARGE["vocab"],
            hidden_size=LARGE["width"],
            intermediate_size=4 * LARGE["width"],
            num_hidden_layers=LARGE["layers"],
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=LARGE["T"],
            tie_word_embeddings=True,
        )
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        cls = tf.Qwen2ForCausalLM
    else:
        cfg = tf.GPT2Config(
            vocab_size=V,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cls = tf.GPT2LMHeadModel
    cfg._attn_implementation = attn
    return cls(cfg)


class MHA(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, V)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(self.norm(x + h))


class Policy(nn.Module):
    """GRPO terms of a causal LM: ``-A_k · log π(y_kt) / n``; turns of 6 positions as segments."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def credit_terms(self, batch) -> CreditTerms:
        ids, adv = batch
        B, T = ids.shape
        out = self.net(input_ids=ids)
        logits = out.logits if hasattr(out, "logits") else out
        lp = torch.log_softmax(logits[:, :-1].float() if logits.dtype == torch.bfloat16 else logits[:, :-1], -1)
        lp = lp.gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        terms = nn.functional.pad(-adv[:, None].to(lp.dtype) * lp / lp.numel(), (1, 0))  # [B, T]
        trained = torch.ones_like(terms, dtype=torch.bool)
        trained[:, 0] = False
        seg = torch.where(trained, torch.arange(T)[None].expand(B, T) // 6, -1)
        return CreditTerms(terms, trained, torch.arange(B), torch.arange(B) // 2, segment=seg)


def batch(seed: int, vocab: int = V, rows: int = B, length: int = T):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g), torch.randn(rows, generator=g)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def ride(module: Policy, b, context) -> object:
    r = RideAlong(module).start()
    with context():
        loss = module.credit_terms(b).terms.sum()
    r.on_loss(loss, by_rollout, readings="shares")
    loss.backward()
    try:
        return r.report(by_rollout, partition_name="by_rollout", readings="shares")
    finally:
        r.clear()
        module.zero_grad(set_to_none=True)


def rows(seeds: int):
    models = {
        "llama": lambda s, attn="sdpa": hf("llama", attn, s),
        "qwen2-tied": lambda s, attn="sdpa": hf("qwen2", attn, s),
        "gpt2-tied": lambda s, attn="eager": hf("gpt2", "eager", s),
        "mha": lambda s, attn=None: MHA(s),
        "llama-32k": lambda s, attn="sdpa": hf("llama-32k", attn, s),
    }
    audits = [  # (engine, partition, readings)
        ("reference", "by_segment", "all"),
        ("ghost", "by_rollout", "all"),
        ("ghost", "by_rollout", "shares"),
        ("ghost", "by_rollout", "projected"),
        ("jvp", "by_segment", "projected"),
        ("jvp", "by_segment", "all"),
    ]
    modes = [("float64", None), ("float32", None), ("bfloat16", None), ("float32", "bf16-autocast")]
    for name, build in models.items():
        for dtype, amp in modes:
            for engine, part, readings in audits + [("ride", "by_rollout", "shares")]:
                large = name == "llama-32k"
                if (large and (dtype in ("float64", "bfloat16") or readings == "all" and engine == "jvp")) or (
                    name == "mha" and engine == "jvp"  # until sdpa has a forward-mode rule
                ):
                    continue
                worst, last = 0.0, None
                for s in range(1 if large else seeds):
                    kw = {} if engine != "jvp" or name == "mha" else {"attn": "eager"}
                    net = build(s, **kw)
                    if dtype == "float64":
                        net = net.double()
                    module = Policy(net)
                    b = batch(100 + s, LARGE["vocab"], LARGE["B"], LARGE["T"]) if large else batch(100 + s)
                    ctx = autocast if amp else contextlib.nullcontext
                    if engine == "ride":
                        if dtype != "float32":
                            continue
                        r = ride(module, b, ctx)
                        if isinstance(r, str):
                            print(f"  ride refused on {name} {dtype} {amp}: {r}", file=sys.stderr)
                            continue
                    else:
                        r = disintegrate(
                            module,
                            b,
                            part,
                            dtype=dtype,
                            engine=engine,
                            readings=readings,
                            forward_context=ctx if amp else None,
                        )
                    projected = r.floor_scale is None and r.readings == "projected"
                    units = floor_units(r.dtype, r.compute_dtype, projected)
                    used = r.conservation_error / r.conservation_floor * units
                    worst, last = max(worst, used), r
                if last is None:
                    continue
                r = last
                yield dict(
                    model=name,
                    dtype=dtype,
                    autocast=amp or "-",
                    engine=r.engine,
                    readings=readings,
                    partition=part,
                    units=worst,
                    floor_units=units,
                    projected=projected,
                    coarsest=str(r.compute_dtype or r.dtype),
                )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {args.seeds}")
    torch.set_num_threads(1)
    lines = [
        f"{'model':11s} {'dtype':9s} {'autocast':13s} {'engine':20s} {'readings':9s} {'units used':>10s} {'of':>6s}"
    ]
    worst: dict[str, float] = {}
    for row in rows(args.seeds):
        lines.append(
            f"{row['model']:11s} {row['dtype']:9s} {row['autocast']:13s} {row['engine']:20s} {row['readings']:9s} "
            f"{row['units']:10.3g} {row['floor_units']:6.0f}"
        )
        key = ("projected " if row["projected"] else "norms ") + ("half" if "bfloat16" in row["coarsest"] else "full")
        worst[key] = max(worst.get(key, 0.0), row["units"])
        print(lines[-1], flush=True)
    lines.append("")
    units = {str(k).replace("torch.", ""): v for k, v in FLOOR_UNITS.items()}
    lines.append(
        f"largest rounding units used: {worst}  (FLOOR_UNITS = {units}, PROJECTED_FACTOR = {PROJECTED_FACTOR:g})"
    )
    print(lines[-1])
    out = ROOT / "benchmarks" / "results" / f"conservation_floor-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"python benchmarks/conservation_floor.py --seeds {args.seeds}\n\n" + "\n".join(lines) + "\n")
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
