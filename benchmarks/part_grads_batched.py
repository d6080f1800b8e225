"""Per-part gradients for ``readings="all"`` inside rows: one backward per part, or batched (``is_grads_batched``)?

The forward-mode engine gives projected shares of parts inside rows (turns, segments) in one pass; norm
shares and cancellation need each part's own gradient ``g_S``, which it takes by one backward per part over
the retained graph. ``torch.autograd.grad(..., is_grads_batched=True)`` runs ``k`` of those backward passes
as one vmapped backward (``k × |θ|`` memory). This times both on a transformers Llama (width 256, 2 layers,
vocabulary 8,000, ``sdpa``), 2 episodes of ``--turns`` turns over T = 256, one thread, and checks that they
give the same squared norms.

Usage: ``python benchmarks/part_grads_batched.py [--turns 20] [--repeats 3]``; written to
``benchmarks/results/part_grads_batched-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16], help="parts per batched backward")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.repeats < 1 or any(k < 1 for k in args.batch):
        ap.error("--turns, --repeats and --batch must be positive")
    import transformers as tf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    lm = tf.LlamaForCausalLM(cfg)
    B, T = 2, 256
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    seg = (torch.arange(T) * args.turns // T)[None].expand(B, T) + args.turns * torch.arange(B)[:, None]  # [B, T]
    m = B * args.turns
    params = [p for p in lm.parameters() if p.requires_grad]

    def terms() -> torch.Tensor:
        logits = lm(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        return torch.nn.functional.pad(lp, (1, 0))  # [B, T]

    def one_by_one() -> list[float]:
        t, out = terms(), []
        for i in range(m):
            g = torch.autograd.grad(t.masked_select(seg == i).sum(), params, retain_graph=i < m - 1)
            out.append(sum(float(x.double().pow(2).sum()) for x in g))
        return out

    def batched(k: int) -> list[float]:
        t, out = terms(), []
        for a in range(0, m, k):
            idx = torch.arange(a, min(m, a + k))
            masks = (seg[None] == idx[:, None, None]).to(t.dtype)  # [k, B, T]
            g = torch.autograd.grad(t, params, grad_outputs=masks, retain_graph=a + k < m, is_grads_batched=True)
            out += [float(s) for s in sum(x.double().pow(2).flatten(1).sum(1) for x in g)]
        return out

    modes = {
        "one backward per part": one_by_one,
        **{f"batched, {k} parts": (lambda k=k: batched(k)) for k in args.batch},
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    values: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, fn in modes.items():  # interleaved, so machine load hits every mode alike
            t0 = time.perf_counter()
            values[name] = fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["one backward per part"])
    ref = values["one backward per part"]
    lines = [
        f"python benchmarks/part_grads_batched.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "",
        f"{m} parts (2 episodes x {args.turns} turns, T = {T}), Llama width 256, 2 layers, vocabulary 8000, 1 thread",
        "",
        "| mode | seconds (median) | / one backward per part | max relative gap of ‖g_S‖² |",
        "|---|---:|---:|---:|",
    ]
    for name in modes:
        med = statistics.median(times[name])
        gap = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(values[name], ref))
        lines.append(f"| {name} | {med:.3f} | {med / base:.2f} | {gap:.1e} |")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "benchmarks" / "results" / f"part_grads_batched-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write(text + "\n\n")
    return text


if __name__ == "__main__":
    main()
