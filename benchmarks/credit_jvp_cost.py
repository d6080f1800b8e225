"""Cost of the forward-mode (JVP) engine on within-row partitions of long multi-turn episodes.

A batch of ``B`` episodes of ``--turns`` turns each (``user → (assistant → tool)* → assistant``, the
tool example's vocabulary, every assistant turn trained), two policies built in memory — the examples'
GPT-2 (``tiny_gpt2``, eager attention, dropout 0.1) and a Llama-style policy (transformers
``LlamaForCausalLM``: RMSNorm, rotary, grouped KV heads, eager attention) — and two partitions:
``by_turn`` (one part per turn of each episode, ``B × turns`` parts) and ``by_segment`` over
``turn_index`` (turn ``j`` of every episode pooled, ``turns`` parts).

Timed in one process, interleaved, ``torch.set_num_threads(1)``, ratios of medians to the plain
training step (forward + backward + Adam step on the same batch):

- the forward-mode pass alone (``terms_jvp`` along one direction);
- ``disintegrate_jvp(readings="projected")``: one forward + backward for ``g_full``, one forward-mode pass;
- ``disintegrate_jvp(readings="all")``: the same plus one backward per part (exact norms);
- the reference ``disintegrate``: one forward, ``m + 1`` backward passes;
- ``update_shares`` (what ``CreditAuditCallback(update_shares=True)`` adds per audited step): one
  forward + backward at ``θ_before`` and one forward-mode pass along ``Δθ``.

Also printed: the largest share difference between the JVP and the reference engine, and the JVP
engine's own conservation error (float32 audit).

Usage: ``python benchmarks/credit_jvp_cost.py [--turns 40] [--rows 4] [--repeats 5] [--embd 32]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lens_callbacks.examples.grpo_tools.env import build_tokenizer  # noqa: E402
from lens_callbacks.examples.tiny_policy import tiny_gpt2  # noqa: E402
from lens_callbacks.credit import CreditTerms, batch_from_trajectories, disintegrate, turn_segments  # noqa: E402
from lens_callbacks.credit.engines.jvp import disintegrate_jvp, terms_jvp  # noqa: E402
from lens_callbacks.credit.inputs.trajectories import Trajectory, Turn  # noqa: E402
from lens_callbacks.credit.readings.update_share import update_shares  # noqa: E402

SECTION = "## Forward-mode engine on turns (`benchmarks/credit_jvp_cost.py`)"


class EpisodePolicy(nn.Module):
    """GRPO terms ``−A_k · log π(y_{k,t}) · trained / N`` over a multi-turn batch, segments by turn."""

    def __init__(self, policy: nn.Module, segment_by: str) -> None:
        super().__init__()
        self.policy = policy
        self.segment_by = segment_by

    def credit_terms(self, batch) -> CreditTerms:
        b, segments, adv = batch
        logits = self.policy(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        logp = F.pad(logp, (1, 0))  # [B, T]
        terms = -(adv.to(logp.dtype)[:, None] * logp) * b.trained.to(logp.dtype) / b.trained.sum().clamp(min=1)  # [B, T]
        segment, names = turn_segments(segments, self.segment_by, rollout=b.rollout)
        return CreditTerms(terms, b.trained, b.rollout, b.group, segment, names)


def episodes(rows: int, turns: int, seed: int = 0) -> list[Trajectory]:
    """``rows`` episodes of exactly ``turns`` turns: a user prompt, then assistant/tool turns."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(rows):
        ts = [Turn("user", "{} + {} =".format(*(int(x) for x in torch.randint(0, 9, (2,), generator=g))))]
        while len(ts) < turns:
            a, b = (int(x) for x in torch.randint(0, 9, (2,), generator=g))
            if ts[-1].role == "assistant":
                ts.append(Turn("tool", str(a + b)))
            else:
                ts.append(Turn("assistant", f"calc {a} + {b} <eot>"))
        out.append(Trajectory(tuple(ts), reward=float(k % 2), group=k // 2, rollout=k))
    return out


def policies(vocab: int, pad: int, eos: int, embd: int = 32) -> dict[str, Callable[[], nn.Module]]:
    """The example's GPT-2 (width 32 by default) and a Llama-style policy of the same width."""
    def gpt2() -> nn.Module:
        return tiny_gpt2(vocab_size=vocab, n_positions=512, n_layer=2, n_embd=embd, n_head=2, dropout=0.1,
                         eos_id=eos, pad_id=pad, seed=0, dtype="float32")

    def llama() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=embd, intermediate_size=2 * embd, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, pad_token_id=pad)
        cfg._attn_implementation = "eager"  # forward mode needs math attention
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return LlamaForCausalLM(cfg)

    return {"GPT-2 (example)": gpt2, "Llama-style": llama}


def measure(name: str, build: Callable[[], nn.Module], batch, segment_by: str, partition: str, repeats: int) -> dict:
    module = EpisodePolicy(build().train(), segment_by)
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)

    def train_step():
        opt.zero_grad()
        module.credit_terms(batch).terms.sum().backward()
        opt.step()

    def jvp():
        return disintegrate_jvp(module, batch, partition)

    def jvp_all():
        return disintegrate_jvp(module, batch, partition, readings="all")

    def ref():
        return disintegrate(module, batch, partition)

    direction = {n: torch.randn_like(p) for n, p in module.named_parameters()}

    def tangent_pass():  # the engine's forward-mode pass alone
        return terms_jvp(module, batch, direction)

    before = {n: p.detach() + 1e-3 * direction[n] for n, p in module.named_parameters()}

    def update_share():  # what CreditAuditCallback(update_shares=True) adds after an audited step
        return update_shares(module, batch, partition, before)

    def clock(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    fns = {"train": train_step, "tangent": tangent_pass, "jvp": jvp, "jvp_all": jvp_all, "reference": ref, "update": update_share}
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(clock(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    torch.manual_seed(1)
    r_ref = ref()
    torch.manual_seed(1)
    r_jvp = jvp()
    return {
        "policy": f"{name}, width {module.policy.config.hidden_size}",
        "partition": f"{partition} ({segment_by})",
        "m": r_ref.n_parts,
        "n_params": sum(p.numel() for p in module.parameters()),
        "B": int(batch[0].shape[0]),
        "T": int(batch[0].shape[1]),
        "n_trained": r_ref.n_trained,
        "train_ms": 1e3 * med["train"],
        "tangent": med["tangent"] / med["train"],
        "jvp": med["jvp"] / med["train"],
        "jvp_all": med["jvp_all"] / med["train"],
        "update": med["update"] / med["train"],
        "reference": med["reference"] / med["train"],
        "speedup": med["reference"] / med["jvp"],
        "share_diff": max(abs(a - b) for a, b in zip(r_jvp.projected_share, r_ref.projected_share)),
        "conservation_error": r_jvp.conservation_error,
    }


def table(rows: list[dict]) -> str:
    head = (
        "| policy | partition | m parts | B × T | trained | plain step | tangent pass / step | JVP (projected) / step | JVP (all) / step | "
        "reference / step | reference / JVP | update shares / step | max share diff vs reference | JVP conservation_error |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['policy']} ({r['n_params']:,} params) | {r['partition']} | {r['m']} | {r['B']} × {r['T']} | {r['n_trained']} | "
            f"{r['train_ms']:.1f} ms | {r['tangent']:.2f} | {r['jvp']:.2f} | {r['jvp_all']:.1f} | {r['reference']:.1f} | {r['speedup']:.1f} | {r['update']:.2f} | "
            f"{r['share_diff']:.1e} | {r['conservation_error']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", choices=["all", "gpt2", "llama"], default="all")
    ap.add_argument("--embd", type=int, default=32, help="width of both policies (the example's GPT-2: 32)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = build_tokenizer()
    b, seg = batch_from_trajectories(tok, episodes(args.rows, args.turns))
    adv = torch.linspace(-1.0, 1.0, args.rows)  # [B]
    batch = (b, seg, adv)
    rows = []
    for name, build in policies(len(tok), tok.pad_token_id, tok.eos_token_id, args.embd).items():
        if args.policy != "all" and args.policy not in name.lower().replace("-", ""):
            continue
        for segment_by, partition in (("turn", "by_turn"), ("turn_index", "by_segment")):
            rows.append(measure(name, build, batch, segment_by, partition, args.repeats))
            print(rows[-1], flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
