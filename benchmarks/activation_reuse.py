"""What the riding tangent pass would save by reusing the step's activations instead of recomputing them.

Riding on the step, the per-turn audit is one forward-mode pass along the step's ``.grad``. That pass
recomputes the primal forward beside the tangent: every ``linear`` forms ``XWᵀ`` again next to ``ẊWᵀ + XẆᵀ``.
The step's forward has already formed each of those products once. This script measures how much of the
pass that recomputation is, with a prototype that keeps the step's linear outputs and hands them back in
place of the products:

1. during the step's forward a ``TorchFunctionMode`` keeps every ``linear`` output, detached (it shares
   storage with the step's own tensors, with no copy), in call order;
2. the tangent pass (:func:`~lens_callbacks.credit.engines.jvp.terms_jvp` with the project's forward-mode
   rules) runs with the ``linear`` rule swapped for one that takes the kept output as its primal and forms
   the tangent only.

Variants: ``recompute`` (the project's pass as it is), ``reuse-body`` (every linear except the LM head
reused) and ``reuse-all`` (the head's logits as well). Each reports the tangent pass's median time as a
fraction of the plain step (forward + backward + Adam, the model's default ``sdpa`` attention), the bytes
kept from the step in parameter sizes, the peak of step + pass over the step's own, and the largest
difference of the tangent from the recomputing pass's, relative to its largest entry (float32 rounding: the
step's primal comes from the fused attention kernel, the pass's from the attention rule).
Random-weight Llama shape (vocabulary 32,000, width 512, 4 layers), one episode of 40 turns, one thread.

Usage: ``python benchmarks/activation_reuse.py [--tokens 8192] [--rows 1] [--repeats 2] [--no-memory]``;
appended to ``benchmarks/results/activation_reuse-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch.autograd.forward_ad as fwAD  # noqa: E402

from lens_callbacks.credit.engines import forward_rules as fr  # noqa: E402
from lens_callbacks.credit.engines.jvp import terms_jvp  # noqa: E402

LINEAR = torch._C._nn.linear
VARIANTS = ("recompute", "reuse-body", "reuse-all")


class KeepLinearOutputs(TorchFunctionMode):
    """Keeps each ``linear`` output of the forward it is entered around, detached, in call order."""

    def __init__(self, head_rows: Optional[int]) -> None:
        super().__init__()
        self.head_rows = head_rows  # the head's out features: its outputs are kept only when None
        self.kept: list[Optional[torch.Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is LINEAR:
            head = self.head_rows is not None and args[1].shape[0] == self.head_rows
            self.kept.append(None if head else out.detach())
        return out


def replaying_linear(kept: list[Optional[torch.Tensor]]):
    """The ``linear`` rule with the primal product taken from ``kept`` (``None`` there, or a bias: computed as usual)."""
    order = iter(kept)

    def rule(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Any:
        xp, dx = fwAD.unpack_dual(input)
        wp, dw = fwAD.unpack_dual(weight)
        y = next(order)  # the step's output of this same call
        if y is not None and y.shape != xp.shape[:-1] + wp.shape[:1]:
            raise RuntimeError(f"kept output {tuple(y.shape)} does not match this linear's {tuple(xp.shape)}")
        if dx is None and dw is None:
            return NotImplemented
        if y is None or bias is not None:
            return fr.linear_jvp(input, weight, bias)
        t = torch.nn.functional.linear(dx, wp) if dx is not None else None  # ẊWᵀ
        if dw is not None:
            if t is not None:
                t.view(-1, t.shape[-1]).addmm_(xp.reshape(-1, xp.shape[-1]), dw.t())  # + XẆᵀ
            else:
                t = torch.nn.functional.linear(xp, dw)
        return fwAD.make_dual(y, t)

    return rule


def measure(T: int, B: int, repeats: int, memory: bool) -> dict:
    from credit_cost import peak_alloc_bytes
    from credit_jvp_cost import TurnBatch, real_model

    module = TurnBatch(real_model("llama", T).train(), B, T)
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(params.values(), lr=1e-5)
    vocab = module.lm.config.vocab_size
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())

    def step(keep: Optional[KeepLinearOutputs] = None) -> None:
        opt.zero_grad(set_to_none=True)
        if keep is None:
            module.credit_terms().terms.sum().backward()
        else:
            with keep:
                loss = module.credit_terms().terms.sum()
            loss.backward()

    def tangent_pass(variant: str, keep: Optional[KeepLinearOutputs]) -> torch.Tensor:
        direction = {n: p.grad for n, p in params.items()}
        saved = fr.RULES[LINEAR]
        if variant != "recompute":
            fr.RULES[LINEAR] = ("linear", replaying_linear(keep.kept))
        try:
            return terms_jvp(module, None, direction)[1]
        finally:
            fr.RULES[LINEAR] = saved

    def keeper(variant: str) -> Optional[KeepLinearOutputs]:
        return None if variant == "recompute" else KeepLinearOutputs(vocab if variant == "reuse-body" else None)

    step()
    opt.step()  # Adam's state, and a warm allocator
    times: dict[str, list[float]] = {"step": [], **{v: [] for v in VARIANTS}}
    tangents: dict[str, torch.Tensor] = {}
    kept_bytes: dict[str, int] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        opt.step()
        times["step"].append(time.perf_counter() - t0)
        for v in VARIANTS:
            keep = keeper(v)
            step(keep)  # the step's forward and backward, keeping its linear outputs
            if keep is not None:
                kept_bytes[v] = sum(t.numel() * t.element_size() for t in keep.kept if t is not None)
            t0 = time.perf_counter()
            tangents[v] = tangent_pass(v, keep)
            times[v].append(time.perf_counter() - t0)
            del keep
        opt.zero_grad(set_to_none=True)
    med = {k: statistics.median(x) for k, x in times.items()}
    row: dict[str, Any] = {"T": T, "B": B, "step_s": med["step"], "param_bytes": param_bytes, "variants": {}}
    peak_step = peak_alloc_bytes(lambda: (step(), opt.step())) if memory else None
    for v in VARIANTS:
        r = {
            "pass_s": med[v],
            "pass_steps": med[v] / med["step"],
            "saved": 1.0 - med[v] / med["recompute"],
            "kept_params": kept_bytes.get(v, 0) / param_bytes,
            "max_diff": float((tangents[v] - tangents["recompute"]).abs().max() / tangents["recompute"].abs().max()),
        }
        if memory:

            def ride(v: str = v) -> None:
                keep = keeper(v)
                step(keep)
                tangent_pass(v, keep)
                opt.step()

            r["peak_extra_params"] = (peak_alloc_bytes(ride) - peak_step) / param_bytes
        row["variants"][v] = r
    return row


def render(row: dict) -> str:
    lines = [
        f"Llama shape, B = {row['B']}, T = {row['T']}, one thread; plain step (fwd + bwd + Adam, sdpa) "
        f"{row['step_s']:.1f} s; parameter size {row['param_bytes'] / 2**20:.0f} MiB",
        "",
        "| variant | tangent pass (steps) | saved vs recompute | kept from the step (param sizes) "
        "| peak of step + pass over step (param sizes) | max tangent diff (relative) |",
        "|---|---|---|---|---|---|",
    ]
    for v, r in row["variants"].items():
        peak = f"{r['peak_extra_params']:+.1f}" if "peak_extra_params" in r else "—"
        lines.append(
            f"| {v} | {r['pass_steps']:.2f} | {r['saved'] * 100:.1f} % | {r['kept_params']:.1f} | {peak} "
            f"| {r['max_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/activation_reuse-<date>.txt)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    row = measure(args.tokens, args.rows, args.repeats, not args.no_memory)
    print(json.dumps(row), flush=True)
    table = render(row)
    print(table)
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"activation_reuse-{datetime.date.today().isoformat()}.txt"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/activation_reuse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with out.open("a") as f:
        f.write(f"{cmd.strip()}\n\n{table}\n\n")
    print(f"appended: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
