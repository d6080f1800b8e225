"""Cost of one probe-credit reading against the plain training step it reads.

A GRPO-shaped objective (``terms[k, t] = −A_k · log π(x_{k,t+1}) / (B·T)``, parts by rollout) on a causal
LM, Adam, and one probe batch of ``P`` held-out sequences. Measured in one run, as ratios of medians to
the plain step (forward + backward + ``optimizer.step()``), each piece of the reading by its own name:

- ``update_map``: reading the optimizer's update ``Δθ = −D ⊙ g + carried`` from its state
  (:func:`optimizer_update_map`; ``D`` and the carried term are formed in the readings' pass);
- ``probe_forward_backward``: ``L_probe`` and ``g_probe`` at θ_before (:func:`probe_value_and_grad`);
- ``parts_dots``: every part's ``⟨g_S, D ⊙ g_probe⟩`` — the engine's pass (the step's ``.grad`` is ``g_full``:
  ``ghost+grad`` is a forward and a backward to the layers' outputs, ``jvp+grad`` the tangent pass alone);
- ``readings``: the rest of :func:`probe_credit` (``D``, the carried term and ``v = D ⊙ g_probe`` a block at a
  time with every dot of the reading, ``from_grad``, the norms and splits, in float64 sums of blocks);
- ``theta_copy``: the copy of θ_before; ``probe_forward_after``: ``L_probe(θ_after)``; ``applied_dot``:
  ``⟨θ_after − θ_before, g_probe⟩`` (:func:`update_dot`, a block at a time).

``--capture training_step`` reads the parts riding on the step (``ProbeCreditCallback(capture=
"training_step")``): the training step's forward and backward run with the one-pass engine's hooks, which
hold the covered layers' inputs and output gradients until the reading, and ``parts_dots`` is the reduction
of those captures against ``D ⊙ g_probe`` alone. The reading's cost is then the riding step less the plain
step, and ``capture`` (the riding step's forward, backward and optimizer step less the plain step's) is
listed as its own piece. The table's last columns give the reading less the probe's own passes (its forward
and backward at θ_before; and with its forward after the step too).

``--every-step`` reads consecutive steps, as ``ProbeCreditCallback(every_n_steps=1)`` does by default
(``reuse_probe_pass``): the probe's pass after a read step takes ``g_probe`` too and is the next reading's
probe pass, so each reading holds one probe forward and backward (``probe_forward_backward``, clocked after
the step) and no forward of its own after it. The read steps run back to back (the first, whose probe pass
is its own, untimed) between two blocks of plain steps.

Policies: ``toy`` (GPT-2, 2 layers, width 64, vocabulary 64) and ``llama`` (a LlamaConfig of vocabulary
32000, width 512, 2 layers, sdpa attention: a real vocabulary and head at a small depth).

    python benchmarks/probe_cost.py [--policy toy|llama|both --engine auto|jvp --capture separate|training_step
                                     --B 8 --T 64 --P 8 --repeats 5 --memory --every-step]

``--memory`` adds the peak memory (CPU allocator events under the profiler) of a plain step and of a step
read by probe credit, in parameter sizes.

The table and the per-piece line are written to ``benchmarks/results/probe_cost-<date>.txt``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lens_callbacks.credit import CreditTerms  # noqa: E402
from lens_callbacks.credit.engines.ghost import RideAlong  # noqa: E402
from lens_callbacks.credit.readings.probe import (  # noqa: E402
    copy_into,
    optimizer_update_map,
    probe_credit,
    probe_value_and_grad,
    scratch_like,
    update_dot,
    with_actual,
)


class Policy(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def _logp(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=x).logits[:, :-1]  # [B, T-1, V]
        return torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)  # [B, T-1]

    def credit_terms(self, batch) -> CreditTerms:
        x, adv = batch
        lp = F.pad(self._logp(x), (1, 0))  # [B, T]
        trained = torch.ones_like(x, dtype=torch.bool)
        trained[:, 0] = False
        terms = torch.where(trained, -adv[:, None] * lp / x.numel(), torch.zeros_like(lp))  # [B, T]
        n = x.shape[0]
        return CreditTerms(terms, trained, torch.arange(n), torch.arange(n) // 2, advantages=adv)

    def probe_loss(self, x: torch.Tensor) -> torch.Tensor:
        return -self._logp(x).mean()


def build(kind: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    if kind == "toy":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=64,
            n_positions=256,
            n_embd=64,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cfg._attn_implementation = "eager"
        return GPT2LMHeadModel(cfg), 64
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg), 32000


def run(
    kind: str,
    B: int,
    T: int,
    P: int,
    repeats: int,
    engine: str = "auto",
    capture: str = "separate",
    memory: bool = False,
    every_step: bool = False,
) -> dict:
    import lens_callbacks.credit.readings.probe as probe_mod

    lm, V = build(kind)
    m = Policy(lm).train()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g))
    probe = torch.randint(0, V, (P, T), generator=g)

    def step() -> None:
        opt.zero_grad()
        m.credit_terms(batch).terms.sum().backward()
        opt.step()

    names = (
        "capture",
        "update_map",
        "probe_forward_backward",
        "parts_dots",
        "readings",
        "theta_copy",
        "probe_forward_after",
        "applied_dot",
    )
    parts: dict[str, list[float]] = {k: [] for k in names}

    def clock(key, fn, *a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        parts[key].append(time.perf_counter() - t0)
        return out

    real = probe_mod.disintegrate

    def timed_disintegrate(*a, **k):  # the engine's pass inside probe_credit, by its own name
        return clock("parts_dots", real, *a, **k)

    ahead: dict[str, object] = {}  # --every-step: the probe's pass after the previous read step
    kept: dict[str, list] = {}  # --every-step: the last reading's buffer (v, then θ_before), kept as the callback does

    def reading_before(ride=None):
        update = clock("update_map", optimizer_update_map, opt, params)
        if ahead:  # taken at these parameters after the previous step, and clocked there
            loss, gp = ahead.pop("loss"), ahead.pop("grad")
        else:
            loss, gp = clock("probe_forward_backward", probe_value_and_grad, m, m.probe_loss, probe)
        probe_mod.disintegrate = timed_disintegrate
        if ride is not None:
            own = ride.report
            ride.report = lambda *a, **k: clock("parts_dots", own, *a, **k)  # the reduction, by its own name
        try:
            t0 = time.perf_counter()
            scratch = scratch_like(params, torch.float32, kept.pop("scratch", None))
            rep = probe_credit(
                m,
                batch,
                "by_rollout",
                update,
                gp,
                loss_before=loss,
                split_by=("by_advantage_sign",),
                engine=engine,
                ride=ride,
                onto_out=scratch,
            )
            parts["readings"].append(time.perf_counter() - t0 - parts["parts_dots"][-1])
        finally:
            probe_mod.disintegrate = real
        return rep, gp, clock("theta_copy", copy_into, scratch, params)

    def reading_after(rep, gp, before):
        if every_step:  # the forward after the step is the next reading's probe pass
            after, ahead["grad"] = clock("probe_forward_backward", probe_value_and_grad, m, m.probe_loss, probe)
            ahead["loss"] = after
            parts["probe_forward_after"].append(0.0)
        else:
            after, _ = clock("probe_forward_after", probe_value_and_grad, m, m.probe_loss, probe, grad=False)
        out = clock("applied_dot", lambda: with_actual(rep, after, applied=update_dot(before, params, gp)))
        if every_step:
            kept["scratch"] = before
        return out

    def read_step():
        """One training step read by probe credit, its reading included; the reading's share of the time is
        appended to ``extra`` (riding: the whole step, to ``riding``)."""
        if capture == "training_step":
            t0 = time.perf_counter()
            opt.zero_grad()
            ride = RideAlong(m).start()
            loss = m.credit_terms(batch).terms.sum()
            ride.on_loss(loss)
            loss.backward()
            ride.stop()
            t1 = time.perf_counter()
            got = reading_before(ride)
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            rep = reading_after(*got)
            ride.clear()
            riding.append(time.perf_counter() - t0)
            extra.append((t2 - t1) + (time.perf_counter() - t3))
            parts["capture"].append((t1 - t0) + (t3 - t2))  # less the plain step below
            return rep
        opt.zero_grad()
        m.credit_terms(batch).terms.sum().backward()
        t0 = time.perf_counter()
        got = reading_before()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        rep = reading_after(*got)
        extra.append((t1 - t0) + (time.perf_counter() - t2))
        return rep

    step()  # warm-up: Adam's state exists from here on
    plain, extra, riding = [], [], []
    rep = None

    def plain_step() -> None:
        t0 = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t0)

    if every_step:
        for _ in range(repeats):
            plain_step()
        read_step()  # its probe pass is its own: not timed
        for v in (*parts.values(), extra, riding):
            v.clear()
        for _ in range(repeats):
            rep = read_step()
        for _ in range(repeats):
            plain_step()
    else:
        for _ in range(repeats):
            plain_step()
            rep = read_step()
    mem = None
    if memory:  # peak bytes alive at once, over the plain step and over the read step (in parameter sizes)
        from credit_cost import peak_alloc_bytes

        n_timed = {k: len(v) for k, v in parts.items()}
        size = 4 * sum(p.numel() for p in params)
        # --every-step: what the previous reading left for this one (its g_probe and buffer) is allocated before
        # the profiled call and counted here
        held = sum(t.numel() * t.element_size() for t in [*kept.get("scratch", ()), *ahead.get("grad", ())])
        mem = (peak_alloc_bytes(step) / size, (peak_alloc_bytes(read_step) + held) / size)
        for k, n in n_timed.items():  # the profiled run's timings are not the measured ones
            del parts[k][n:]
        del extra[repeats:], riding[repeats:]
    base = statistics.median(plain)
    if riding:
        extra = [r - base for r in riding]
        parts["capture"] = [c - base for c in parts["capture"]]
    else:
        del parts["capture"]
    br = {k: statistics.median(v) / base for k, v in parts.items()}
    return {
        "policy": kind,
        "params": sum(p.numel() for p in params),
        "B": B,
        "T": T,
        "P": P,
        "engine": rep.engine,
        "step_s": base,
        "reading_s": statistics.median(extra),
        "ratio": statistics.median(extra) / base,
        "less_probe": statistics.median(extra) / base - br["probe_forward_backward"],
        "less_probe_after": statistics.median(extra) / base - br["probe_forward_backward"] - br["probe_forward_after"],
        "update_match": rep.update_match,
        "parts_gap": rep.parts_gap,
        "breakdown": br,
        "memory": mem,
    }


def main() -> None:
    import datetime

    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="both", choices=["toy", "llama", "both"])
    ap.add_argument("--engine", default="auto", choices=["auto", "ghost", "jvp"])
    ap.add_argument("--capture", default="separate", choices=["separate", "training_step"])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory", action="store_true", help="peak memory of the plain step and of the read step")
    ap.add_argument("--every-step", action="store_true", help="consecutive read steps, the probe pass reused")
    args = ap.parse_args()
    for name in ("B", "T", "P", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    kinds = ["toy", "llama"] if args.policy == "both" else [args.policy]
    lines = [
        "| policy | parameters | B × T | probe P | engine | plain step (s) | one probe reading (s) | reading / step "
        "| less probe fwd+bwd | less probe's passes | update_match | parts_gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    rows = []
    for kind in kinds:
        r = run(kind, args.B, args.T, args.P, args.repeats, args.engine, args.capture, args.memory, args.every_step)
        lines.append(
            f"| {r['policy']} | {r['params']:,} | {r['B']} × {r['T']} | {r['P']} | {r['engine']} | {r['step_s']:.3f} | "
            f"{r['reading_s']:.3f} | {r['ratio']:.2f} | {r['less_probe']:+.2f} | {r['less_probe_after']:+.2f} | "
            f"{r['update_match']:.1e} | {r['parts_gap']:.1e} |"
        )
        print(lines[-1], flush=True)
        rows.append((r["policy"], r["breakdown"]))
        if r["memory"] is not None:
            lines.append(
                f"peak memory ({r['policy']}, in parameter sizes): plain step {r['memory'][0]:.2f}, step read by "
                f"probe credit {r['memory'][1]:.2f} (+{r['memory'][1] - r['memory'][0]:.2f})"
            )
            print(lines[-1], flush=True)
    lines.append("")
    lines.append(
        "per piece, / plain step: "
        + "; ".join(f"{kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()) for kind, b in rows)
    )
    print(lines[-1])
    out = Path(__file__).resolve().parent / "results" / f"probe_cost-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python benchmarks/probe_cost.py"] + sys.argv[1:])
    with out.open("a") as fh:
        fh.write(f"{cmd}\n\n" + "\n".join(lines) + "\n\n")
    print(f"appended: {out}")


if __name__ == "__main__":
    main()
