"""Cost of per-turn credit (the forward-mode engine) and of packed rollouts (the one-pass engine's spans).

Toy rows (default): a batch of ``B`` episodes of ``--turns`` turns each (``user → (assistant → tool)* →
assistant``, the tool example's vocabulary, every assistant turn trained), two policies built in memory —
the examples' GPT-2 (``tiny_gpt2``, eager attention, dropout 0.1) and a Llama-style policy (transformers
``LlamaForCausalLM`` with its default ``sdpa`` attention) — and two partitions: ``by_turn`` (one part per
turn of each episode, ``B × turns`` parts) and ``by_segment`` over ``turn_index`` (turn ``j`` of every
episode pooled, ``turns`` parts). Timed in one process, interleaved, ``torch.set_num_threads(1)``, ratios
of medians to the plain training step (forward + backward + Adam step on the same batch):

- the forward-mode pass alone (``terms_jvp`` along one direction);
- ``disintegrate_jvp(readings="projected")``: one forward + backward for ``g_full``, one forward-mode pass;
- ``disintegrate_jvp(readings="all")``: the same plus one backward per part (exact norms);
- the reference ``disintegrate``: one forward, ``m + 1`` backward passes; and the same ``m`` backward
  passes batched by ``torch.autograd.grad(..., is_grads_batched=True)``;
- ``update_shares`` (what ``ExtraReadings(update_shares=True)`` adds per audited step).

Real rows (``--real``): episodes of 40 turns on the Llama shape (vocabulary 32,000, width 512, 4 layers) at
``T = 1024`` (8 episodes) and ``T = 8192`` (1 episode), and the Qwen2 shape (tied 151,936 vocabulary, width
896, 2 layers) at ``T = 1024``, random tokens, each turn ``T / 40`` positions, assistant turns trained, parts
``by_turn``. The denominator is the user's step with the model's default attention (``sdpa``). Modes: riding
on the step (the tangent pass alone along the step's ``.grad``, reported as the extra over a step), the
separate pass (its own forward and backward, then the tangent pass), each one's peak memory over the plain
step's, ``Σ shares − 1`` and ``conservation_error``. Then packed rollouts (4 rollouts of ``T/4`` per row,
position ids restarting, ``by_rollout`` read as spans, ``readings="shares"``), riding along and separate;
with ``--kinds ... uneven``, rows packing 4 rollouts of unequal lengths (3/16, 5/16, 1/4 and 3/16 of ``T``) and
``T/16`` of padding, which the engine regroups by one copy instead of a view.

Usage: ``python benchmarks/credit_jvp_cost.py [--turns 40] [--rows 4] [--repeats 5] [--embd 32]`` (toys);
``python benchmarks/credit_jvp_cost.py --real [--real-rows llama:8:1024 llama:1:8192 qwen2:8:1024]
[--repeats 3] [--kinds turns packed uneven]``. Real rows are appended to ``benchmarks/results/credit_jvp_cost-<date>.txt``.
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

from lens_callbacks.credit import CreditTerms, batch_from_trajectories, disintegrate, turn_segments  # noqa: E402
from lens_callbacks.credit.engines.jvp import disintegrate_jvp, terms_jvp  # noqa: E402
from lens_callbacks.credit.inputs.partition import packed_rollouts, resolve_partition  # noqa: E402
from lens_callbacks.credit.inputs.trajectories import Trajectory, Turn  # noqa: E402
from lens_callbacks.credit.readings.update_share import update_shares  # noqa: E402
from lens_callbacks.examples.grpo_tools.env import build_tokenizer  # noqa: E402
from lens_callbacks.examples.tiny_policy import tiny_gpt2  # noqa: E402

SECTION = "## Forward-mode engine on turns (`benchmarks/credit_jvp_cost.py`)"


class EpisodePolicy(nn.Module):
    """GRPO terms ``−A_k · log π(y_{k,t}) · trained / N`` over a multi-turn batch, segments by turn."""

    def __init__(self, policy: nn.Module, segment_by: str) -> None:
        super().__init__()
        self.policy = policy
        self.segment_by = segment_by

    def credit_terms(self, batch) -> CreditTerms:
        b, segments, adv = batch
        logits = self.policy(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
        ).logits  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        logp = F.pad(logp, (1, 0))  # [B, T]
        terms = (
            -(adv.to(logp.dtype)[:, None] * logp) * b.trained.to(logp.dtype) / b.trained.sum().clamp(min=1)
        )  # [B, T]
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
        return tiny_gpt2(
            vocab_size=vocab,
            n_positions=512,
            n_layer=2,
            n_embd=embd,
            n_head=2,
            dropout=0.1,
            eos_id=eos,
            pad_id=pad,
            seed=0,
            dtype="float32",
        )

    def llama() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=embd,
            intermediate_size=2 * embd,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=pad,
        )
        assert cfg._attn_implementation in (None, "sdpa")  # transformers' default; forward mode takes its rule
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

    def batched():  # the reference's m backward passes as one vmapped backward (is_grads_batched)
        t = module.credit_terms(batch)
        part = resolve_partition(partition)(t.detached())
        onehot = torch.stack([(part.ids == i).to(t.terms.dtype) for i in range(part.n_parts)])  # [m, B, T]
        leaves = [p for p in module.parameters() if p.requires_grad]
        return torch.autograd.grad(t.terms, leaves, grad_outputs=onehot, is_grads_batched=True, allow_unused=True)

    direction = {n: torch.randn_like(p) for n, p in module.named_parameters()}

    def tangent_pass():  # the engine's forward-mode pass alone
        return terms_jvp(module, batch, direction)

    before = {n: p.detach() + 1e-3 * direction[n] for n, p in module.named_parameters()}

    def update_share():  # what ExtraReadings(update_shares=True) adds after an audited step
        return update_shares(module, batch, partition, before)

    def clock(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    fns = {
        "train": train_step,
        "tangent": tangent_pass,
        "jvp": jvp,
        "jvp_all": jvp_all,
        "reference": ref,
        "batched": batched,
        "update": update_share,
    }
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
        "batched": med["batched"] / med["train"],
        "speedup": med["reference"] / med["jvp"],
        "share_diff": max(abs(a - b) for a, b in zip(r_jvp.projected_share, r_ref.projected_share)),
        "conservation_error": r_jvp.conservation_error,
    }


def table(rows: list[dict]) -> str:
    head = (
        "| policy | partition | m parts | B × T | trained | plain step | tangent pass / step | JVP (projected) / step | JVP (all) / step | "
        "reference / step | its backwards batched / step | reference / JVP | update shares / step | max share diff vs reference | "
        "JVP conservation_error |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['policy']} ({r['n_params']:,} params) | {r['partition']} | {r['m']} | {r['B']} × {r['T']} | {r['n_trained']} | "
            f"{r['train_ms']:.1f} ms | {r['tangent']:.2f} | {r['jvp']:.2f} | {r['jvp_all']:.1f} | {r['reference']:.1f} | {r['batched']:.1f} | "
            f"{r['speedup']:.1f} | {r['update']:.2f} | "
            f"{r['share_diff']:.1e} | {r['conservation_error']:.1e} |"
        )
    return "\n".join(lines)


# ---- real shapes: 40-turn episodes and packed rollouts, against the user's sdpa step --------------------

REAL_ROWS = ("llama:8:1024", "llama:1:8192", "qwen2:8:1024")


def real_model(kind: str, T: int) -> nn.Module:
    """A random-weight transformers causal LM of a real shape, with its default (sdpa) attention."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=T,
        )
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=True,
    )
    return tf.Qwen2ForCausalLM(cfg)


class TurnBatch(nn.Module):
    """``B`` episodes of ``turns`` turns over ``T`` random tokens (user, then assistant/tool alternating), or
    (``packed``) ``B`` rows of 4 rollouts each, position ids restarting (``packed="uneven"``: of unequal
    lengths, each row ending in ``T/16`` positions of padding that belong to no rollout)."""

    def __init__(
        self, lm: nn.Module, B: int, T: int, turns: int = 40, packed: "bool | str" = False, seed: int = 1
    ) -> None:
        super().__init__()
        self.lm = lm
        g = torch.Generator().manual_seed(seed)
        V = lm.config.vocab_size
        self.ids = torch.randint(0, V, (B, T), generator=g)  # [B, T]
        pos = torch.arange(T)[None].expand(B, T)
        if packed == "uneven":
            lens = [3 * T // 16, 5 * T // 16, T // 4, 3 * T // 16]
            valid = torch.arange(T) < sum(lens)  # [T]: the rest is padding, each position at 0
            row = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(T - sum(lens), dtype=torch.long)])
            self.pos = row[None].expand(B, T)
            self.rollout = packed_rollouts(self.pos, valid[None].expand(B, T))  # [B, T], -1 on the padding
            self.trained = (self.pos >= 8) & valid
            self.adv = torch.randn(4 * B, generator=g)[self.rollout.clamp(min=0)]  # [B, T]
            self.segment, self.names = None, None
        elif packed:
            self.pos = pos % (T // 4)
            self.rollout = packed_rollouts(self.pos)  # [B, T]
            self.trained = self.pos >= 8  # each rollout's first 8 tokens are its prompt
            self.adv = torch.randn(4 * B, generator=g)[self.rollout]  # [B, T]
            self.segment, self.names = None, None
        else:
            self.pos = pos
            turn = (torch.arange(T) * turns // T)[None].expand(B, T)  # [B, T]
            self.trained = (turn % 2 == 1) & (torch.arange(T)[None] > 0)  # assistant turns (odd), not position 0
            self.rollout = torch.arange(B)
            self.adv = torch.randn(B, generator=g)[:, None].expand(B, T)
            self.segment = turn + turns * torch.arange(B)[:, None]
            self.names = tuple(f"episode_{k}/turn_{j}" for k in range(B) for j in range(turns))

    def credit_terms(self, batch=None) -> CreditTerms:
        out = self.lm(input_ids=self.ids, position_ids=self.pos, use_cache=False).logits[:, :-1]  # [B, T-1, V]
        lp = F.pad(torch.log_softmax(out, -1).gather(-1, self.ids[:, 1:, None])[..., 0], (1, 0))  # [B, T]
        terms = torch.where(self.trained, -self.adv * lp / self.trained.sum(), torch.zeros_like(lp))
        B = self.ids.shape[0]
        return CreditTerms(
            terms,
            self.trained,
            self.rollout,
            torch.zeros(B, dtype=torch.long),
            segment=self.segment,
            segment_names=self.names,
        )


def _peak(fn: Callable[[], object]) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from credit_cost import peak_alloc_bytes

    return peak_alloc_bytes(fn)


def measure_real(kind: str, B: int, T: int, repeats: int, packed: "bool | str" = False, memory: bool = True) -> dict:
    from lens_callbacks.credit.engines.ghost import RideAlong

    module = TurnBatch(real_model(kind, T).train(), B, T, packed=packed)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-5)
    partition = "by_rollout" if packed else "by_turn"
    kw = dict(readings="shares") if packed else dict(readings="projected")

    def step():
        opt.zero_grad(set_to_none=True)
        module.credit_terms().terms.sum().backward()
        opt.step()

    def ride_step():  # the training step, then the audit riding on it
        opt.zero_grad(set_to_none=True)
        if packed:
            from lens_callbacks.credit.inputs.partition import by_rollout

            r = RideAlong(module).start()
            loss = module.credit_terms().terms.sum()
            r.on_loss(loss, by_rollout, readings="shares")
            loss.backward()
            rep = r.report(by_rollout, readings="shares")
            r.clear()
        else:
            loss = module.credit_terms().terms.sum()
            loss.backward()
            rep = disintegrate(
                module, None, partition, full_grad=[p.grad for p in params], **kw
            )  # the tangent pass alone
        opt.step()
        return rep

    def separate():
        return disintegrate(module, None, partition, **kw)

    step()  # Adam's state, and a warm allocator
    times = {"step": [], "ride_step": [], "separate": []}
    rep_ride = rep_sep = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times["step"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rep_ride = ride_step()
        times["ride_step"].append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        module.credit_terms().terms.sum().backward()  # as at on_before_optimizer_step: .grad in place
        t0 = time.perf_counter()
        rep_sep = separate()
        times["separate"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "policy": kind,
        "B": B,
        "T": T,
        "packed": packed,
        "m": rep_sep.n_parts,
        "step_s": med["step"],
        "ride_extra": (med["ride_step"] - med["step"]) / med["step"],
        "separate": med["separate"] / med["step"],
        "engine_ride": rep_ride.engine,
        "engine_sep": rep_sep.engine,
        "share_sum_err": abs(rep_sep.share_sum - 1.0),
        "conservation": rep_sep.conservation_error,
        "conservation_ride": rep_ride.conservation_error,
        "mem_step": None,
        "mem_ride": None,
        "mem_sep": None,
    }
    if memory:
        row["mem_step"] = _peak(step)
        row["mem_ride"] = _peak(ride_step)
        opt.zero_grad(set_to_none=True)
        module.credit_terms().terms.sum().backward()
        row["mem_sep"] = _peak(separate)
        row["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    return row


def real_table(rows: list[dict]) -> str:
    lines = [
        "| policy | rows × T | parts | plain sdpa step | riding on the step (extra) | separate / step | engines | "
        "extra peak over the step (riding / separate, in parameter sizes) | Σ shares − 1 | conservation_error |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        kind = f"{r['policy']}, 40-turn episodes"
        if r["packed"]:
            kind = f"{r['policy']}, packed 4 per row" + (", unequal lengths" if r["packed"] == "uneven" else "")
        mem = "not measured"
        if r.get("mem_step"):
            ps = r["param_bytes"]
            mem = f"{(r['mem_ride'] - r['mem_step']) / ps:+.2f} / {(r['mem_sep'] - r['mem_step']) / ps:+.2f}"
        lines.append(
            f"| {kind} | {r['B']} × {r['T']} | {r['m']} | {r['step_s']:.2f} s | {r['ride_extra']:+.2f} | {r['separate']:.2f} | "
            f"{r['engine_ride']} / {r['engine_sep']} | {mem} | {r['share_sum_err']:.1e} | {r['conservation']:.1e} |"
        )
    return "\n".join(lines)


def main_real(args) -> list[dict]:
    import datetime

    rows = []
    for spec in args.real_rows:
        kind, B, T = spec.split(":")
        for kind_, packed in (("turns", False), ("packed", True), ("uneven", "uneven")):
            if kind_ not in args.kinds:
                continue
            try:
                rows.append(measure_real(kind, int(B), int(T), args.repeats, packed=packed, memory=args.memory))
            except RuntimeError as err:  # out of memory on this machine: said, not hidden
                print(f"{spec}{' packed' if packed else ''}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            print(rows[-1], flush=True)
    text = real_table(rows)
    print(text)
    out = ROOT / "benchmarks" / "results" / f"credit_jvp_cost-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write("python benchmarks/credit_jvp_cost.py " + " ".join(sys.argv[1:]) + "\n\n" + text + "\n\n")
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", choices=["all", "gpt2", "llama"], default="all")
    ap.add_argument("--embd", type=int, default=32, help="width of both policies (the example's GPT-2: 32)")
    ap.add_argument("--real", action="store_true", help="the real-shape rows (40-turn episodes, packed rollouts)")
    ap.add_argument("--real-rows", nargs="+", default=list(REAL_ROWS), metavar="POLICY:ROWS:T")
    ap.add_argument(
        "--kinds",
        nargs="+",
        choices=["turns", "packed", "uneven"],
        default=["turns", "packed"],
        help="real rows: 40-turn episodes, packed rollouts of one length, packed rollouts of unequal lengths",
    )
    ap.add_argument(
        "--memory", action=argparse.BooleanOptionalAction, default=True, help="real rows: peak memory per mode"
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(1)
    if args.real:
        for spec in args.real_rows:
            parts = spec.split(":")
            if (
                len(parts) != 3
                or parts[0] not in ("llama", "qwen2")
                or not all(x.isdigit() and int(x) > 0 for x in parts[1:])
            ):
                ap.error(f"--real-rows entries must be POLICY:ROWS:T with POLICY llama or qwen2, got {spec!r}")
        return main_real(args)
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
