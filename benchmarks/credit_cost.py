"""Cost of the credit audit, every engine side by side with its peers: audit / plain step, and peak memory.

Policies (built offline, random weights, float32): a transformers GPT-2 (2 layers, width 128, tied
embeddings, eager attention) and a Llama-style LlamaForCausalLM (2 layers, width 128, RMSNorm,
rotary). One rollout per row, ``T = 48`` positions (8 prompt + 40 trained), ``m`` rows = ``m`` parts
(``by_rollout``), random advantages. For ``m`` = 8, 32, 64 it times, in one process and interleaved
so that machine load hits every candidate alike:

- the plain training step (forward, backward, Adam step);
- ``reference``: :func:`disintegrate` with ``engine="reference"`` (one forward, ``m + 1`` backward passes);
- ``ghost``: ``engine="ghost"``, a separate pass (one forward, one backward, per-layer reductions);
  ``_shares``: ``readings="shares"`` (no interference matrix), ``_projected``: projected shares only;
  ``ghost_grad``: ``readings="shares"`` with ``full_grad=.grad`` (``g_full`` is the step's ``.grad``, so the
  pass's backward forms no weight gradient);
- ``ride``: the training step with the ghost hooks riding on it (:class:`RideAlong`, each parameter
  reduced inside the training backward), reported as (audited step − plain step) / plain step;
- ``vmap``: torch.func ``vmap(grad)`` per-row gradients, then the same readings (dots with g_full,
  norms, Gram) from the ``m × |θ|`` matrix;
- ``opacus``: Opacus ``GradSampleModule`` per-sample gradients (its functorch path covers GPT-2's
  ``Conv1D``), then the same readings; needs the optional ``bench`` extra.

Every figure is a ratio of medians taken in the same run with ``torch.set_num_threads(1)``. Peak extra
memory is read from the profiler's allocation events (bytes allocated inside the call and alive at once,
matched by address), at the largest ``m``.

Real shapes (``--only real``): a Qwen2-shaped policy (vocabulary 151,936, tied embedding / LM head, width
896, 2 layers, MLP 4864) and a Llama-shaped one (vocabulary 32,000, untied, width 512, 4 layers), random
weights from their transformers configs with their default (sdpa) attention, float32, ``by_rollout`` at m rows of T
positions (``--real-rows``,
default ``llama:8:128 qwen2:8:128 llama:32:128 llama:8:512``; the other (m, T) of {8, 32} × {128, 512} are
listed with their estimated peak memory and work). Modes, interleaved in one process: the plain step,
riding along with ``readings="shares"``, separate ``shares`` and all readings, ``full_grad="trainer"`` (with
``shares`` and with all readings), and
the peers (torch.func, Opacus) where their ``m × |θ|`` per-row gradients fit ``--peer-budget-gib``; peak
memory per mode over the plain step; float32 against float64 shares; a profile of the separate pass and
of the ride-along step. Each separate pass runs right after a backward of the batch (as at
``on_before_optimizer_step``), and each mode's user and system CPU time and minor page faults are
reported beside its wall time: on a CPU the system time of mapping fresh memory moves a pass's wall
time with the allocator's state. The block ends with the Qwen2.5-7B shape on paper (:mod:`route_counts`).
``--apart`` makes a row's memory and drift readings instead, each in a Python process of its own (for rows
whose profiled passes do not fit in one process); ``--rows-from`` merges them into the row's timed run.

Usage::

    python benchmarks/credit_cost.py --write docs/performance.md              # toys and real shapes
    python benchmarks/credit_cost.py --only real --write docs/performance.md  # real shapes only
    python benchmarks/credit_cost.py --only toy --repeats 5 --write docs/performance.md
    python benchmarks/credit_cost.py --quick                                  # a smoke run, nothing written
    python benchmarks/credit_cost.py --only real --rows-from LOG --write docs/performance.md  # re-render
    python benchmarks/credit_cost.py --only real --real-rows qwen2:32:128 --apart >> LOG   # memory, drift apart
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

try:
    import resource  # POSIX: CPU time and page faults of a pass
except ImportError:  # pragma: no cover - Windows
    resource = None

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # route_counts

from lens_callbacks.credit import CreditTerms, by_rollout, disintegrate  # noqa: E402
from lens_callbacks.credit.engines.ghost import RideAlong, disintegrate_ghost  # noqa: E402

SECTION = "## Credit audit (`benchmarks/credit_cost.py`)"
GENERATED_END = "<!-- the tables above are written by benchmarks/credit_cost.py --write; the text below is not -->"
ENGINES = (
    "reference",
    "ghost",
    "ghost_shares",
    "ghost_projected",
    "ghost_grad",
    "ride",
    "ride_shares",
    "ride_projected",
    "vmap",
    "opacus",
)
RIDES = {"ride": "all", "ride_shares": "shares", "ride_projected": "projected"}
VOCAB, T, PROMPT = 64, 48, 8


def peak_alloc_bytes(fn) -> int:
    """Peak bytes allocated inside ``fn()`` and alive at once (CPU allocator events, matched by address)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]"), key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0))
    )
    live: dict[int, int] = {}
    cur = peak = 0
    for e in mem:
        a = e["args"]
        if a.get("Device Type", 0) != 0:
            continue
        b, addr = int(a["Bytes"]), int(a["Addr"])
        if b > 0:
            live[addr] = live.get(addr, 0) + b
            cur += b
        elif addr in live:
            cur -= live.pop(addr)
        peak = max(peak, cur)
    return peak


def make_model(kind: str, seed: int = 0, positions: int = 64) -> nn.Module:
    """A random-initialised transformers causal LM of the benchmark's shape (``"gpt2"`` or ``"llama"``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(
                vocab_size=VOCAB,
                n_positions=positions,
                n_embd=128,
                n_layer=2,
                n_head=4,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
            cfg._attn_implementation = "eager"
            return GPT2LMHeadModel(cfg)
        if kind == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=128,
                intermediate_size=344,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=positions,
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=0,
            )
            cfg._attn_implementation = "eager"
            return LlamaForCausalLM(cfg)
    raise ValueError(f"`kind` must be 'gpt2' or 'llama', got {kind!r}.")


class Policy(nn.Module):
    """GRPO terms over a causal LM: ``terms[k, t] = -A_k log π(y_kt) / (n_trained)`` on trained positions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def logp(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids).logits  # [B, T, V]
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        return nn.functional.pad(lp, (1, 0))  # [B, T]

    def credit_terms(self, batch: Any) -> CreditTerms:
        ids, adv, trained = batch[:3]
        lp = self.logp(ids)  # [B, T]
        terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))  # [B, T]
        segment = batch[3] if len(batch) > 3 else None  # [B, T] turn ids (the episode benchmark)
        return CreditTerms(terms, trained, torch.arange(ids.shape[0]), torch.arange(ids.shape[0]), segment)


def make_batch(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (m, T), generator=g)  # [m, T]
    adv = torch.randn(m, generator=g)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool)  # [m, T]
    trained[:, PROMPT:] = True
    return ids, adv, trained


def vmap_row_grads(
    policy: "Policy", named, ids: torch.Tensor, adv: torch.Tensor, trained: torch.Tensor, z
) -> dict[str, torch.Tensor]:
    """The peer torch.func offers: every row's gradient by ``vmap(grad)`` of the row's own loss, name → ``[m, *shape]``."""
    params = {n: p.detach() for n, p in named}

    def row_loss(p, row_ids, a, tr):
        logits = torch.func.functional_call(
            policy.model, {k[len("model.") :]: v for k, v in p.items()}, (), {"input_ids": row_ids[None]}
        ).logits
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, row_ids[1:, None])[..., 0]  # [T-1]
        return -(a * lp * tr[1:]).sum() / z

    with torch.random.fork_rng(devices=[]):
        return torch.func.vmap(torch.func.grad(row_loss), in_dims=(None, 0, 0, 0), randomness="different")(
            params, ids, adv, trained
        )


def readings_from_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dots with g_full and the Gram from an ``[m, |θ|]`` matrix of per-row gradients (what the peers give)."""
    g_full = rows.sum(0)  # [|θ|]
    return rows @ g_full, rows @ rows.T  # [m], [m, m]


def make_steps(policy: "Policy", opt: torch.optim.Optimizer, batch, readings: str = "all", route: str = "auto"):
    """The three steps every row times: ``(train_step, fwd_bwd, ride_step)``.

    ``train_step`` is the plain step (forward, backward, Adam); ``fwd_bwd`` leaves this batch's ``.grad``
    at the current weights, as at ``on_before_optimizer_step``; ``ride_step(readings)`` is the plain step
    with the audit riding on its backward (it raises if the audit fell back, so a fallback is never timed
    as a ride)."""

    def train_step():
        opt.zero_grad()
        policy.credit_terms(batch).terms.sum().backward()
        opt.step()

    def fwd_bwd():
        policy.zero_grad(set_to_none=True)
        policy.credit_terms(batch).terms.sum().backward()

    def ride_step(readings: str = readings):
        ride = RideAlong(policy).start()
        try:
            opt.zero_grad()
            loss = policy.credit_terms(batch).terms.sum()
            ride.on_loss(loss, by_rollout, readings=readings, route=route)
            loss.backward()
            out = ride.report(by_rollout, partition_name="by_rollout", readings=readings, route=route)
            opt.step()
        finally:
            ride.clear()
        if not hasattr(out, "projected_share"):
            raise RuntimeError(f"the ride-along audit fell back: {out}")
        return out

    return train_step, fwd_bwd, ride_step


def clock(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def clock_usage(fn: Callable[[], Any]) -> tuple[float, Optional[tuple[float, float, int]]]:
    """Wall seconds of one call of ``fn`` and, where the platform reports them, its process CPU time in the
    user and the system share and its minor page faults: on a CPU the kernel maps (and zeroes) every fresh
    allocation the allocator took from it, and that system time moves with the allocator's state, not with
    the work of the pass."""
    if resource is None:
        return clock(fn), None
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = clock(fn)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return t, (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt)


def measure(
    m: int, repeats: int, kind: str = "gpt2", engines=ENGINES, seed: int = 0, memory: bool = True, route: str = "auto"
) -> dict:
    policy = Policy(make_model(kind, seed))
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
    batch = make_batch(m, seed)
    ids, adv, trained = batch
    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    n_params = sum(p.numel() for _, p in named)
    param_bytes = sum(p.numel() * p.element_size() for _, p in named)
    z = trained.sum()

    train_step, fwd_bwd, ride_step = make_steps(policy, opt, batch, readings="all", route=route)

    def vmap_audit():
        per = vmap_row_grads(policy, named, ids, adv, trained, z)
        rows = torch.cat([per[n].reshape(m, -1) for n, _ in named], dim=1)  # [m, |θ|]
        return readings_from_rows(rows)

    if "opacus" in engines:
        try:
            from opacus import GradSampleModule
        except ImportError:
            engines = tuple(e for e in engines if e != "opacus")
        else:
            opacus_model = make_model(kind, seed)
            opacus_model.load_state_dict(policy.model.state_dict())
            opacus_model.train()
            GradSampleModule(opacus_model)  # its hooks live on opacus_model's layers
            opacus_policy = Policy(opacus_model)
            opacus_named = [p for p in opacus_model.parameters() if p.requires_grad]

    def opacus_audit():
        for p in opacus_named:
            p.grad_sample = None
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            opacus_policy.credit_terms(batch).terms.sum().backward()
        rows = torch.cat([p.grad_sample.reshape(m, -1) for p in opacus_named], dim=1)  # [m, |θ|]
        return readings_from_rows(rows)

    audits: dict[str, Callable[[], Any]] = {
        "reference": lambda: disintegrate(policy, batch, "by_rollout", engine="reference", reference_grads="grad"),
        "ghost": lambda: disintegrate_ghost(policy, batch, "by_rollout", reference_grads="grad", route=route),
        "ghost_shares": lambda: disintegrate_ghost(
            policy, batch, "by_rollout", reference_grads="grad", readings="shares", route=route
        ),
        "ghost_projected": lambda: disintegrate_ghost(
            policy, batch, "by_rollout", reference_grads="grad", readings="projected", route=route
        ),
        "ghost_grad": lambda: disintegrate_ghost(
            policy, batch, "by_rollout", readings="shares", route=route, full_grad=[p.grad for _, p in named]
        ),
        "vmap": vmap_audit,
        "opacus": opacus_audit,
    }
    audits = {k: v for k, v in audits.items() if k in engines}
    if memory and "ghost" in engines:
        # The memory goal's setting: chunks of per-part pieces held to |θ|/2 elements (budget = |θ|).
        for k, r in (
            ("ghost_lowmem", "all"),
            ("ghost_lowmem_shares", "shares"),
            ("ghost_lowmem_projected", "projected"),
        ):
            audits[k] = lambda r=r: disintegrate_ghost(
                policy, batch, "by_rollout", reference_grads="grad", readings=r, route=route, memory_budget=n_params
            )

    train_step(), fwd_bwd()  # warm-up (allocations, Adam state)
    for fn in audits.values():
        fn()
    rides = {k: (lambda r=r: ride_step(r)) for k, r in RIDES.items() if k in engines}
    for fn in rides.values():
        fn()
    t_train: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in list(audits) + list(rides)}
    for _ in range(repeats):
        t_train.append(clock(train_step))
        for k, fn in rides.items():
            times[k].append(clock(fn))
        fwd_bwd()  # .grad of this batch at the current weights, as at on_before_optimizer_step
        for k, fn in audits.items():
            times[k].append(clock(fn))
    tr = statistics.median(t_train)
    row: dict[str, Any] = {"kind": kind, "m": m, "B": m, "T": T, "n_params": n_params, "param_bytes": param_bytes}
    for k, ts in times.items():
        med = statistics.median(ts)
        row[f"{k}_over_train"] = (med - tr) / tr if k.startswith("ride") else med / tr
    fwd_bwd()
    ghost = disintegrate_ghost(policy, batch, "by_rollout", reference_grads="grad", route=route)
    row["conservation_error"] = ghost.conservation_error
    row["grad_match"] = ghost.grad_match
    row["n_trained"] = ghost.n_trained
    row["audited_over_plain_train"] = 1.0 + row.get("ghost_over_train", float("nan"))
    if "reference" in audits:
        ref = audits["reference"]()
        row["max_share_gap"] = max(abs(a - b) for a, b in zip(ref.projected_share, ghost.projected_share))
    if not memory:
        return row
    row["mem_plain"] = peak_alloc_bytes(fwd_bwd)
    for k in audits:
        if k in ("ghost_projected", "ghost_lowmem", "ghost_lowmem_projected", "ghost_grad"):
            continue
        fwd_bwd()
        row[f"mem_{k}"] = peak_alloc_bytes(audits[k])
    row["mem_audit"] = row.get("mem_ghost", 0)
    if "ride" in engines:
        # The ride-along step against the plain training step (both include forward, backward and Adam).
        def plain():
            train_step()

        row["mem_ride"] = peak_alloc_bytes(ride_step)
        if "ride_shares" in engines:
            row["mem_ride_shares"] = peak_alloc_bytes(lambda: ride_step("shares"))
        row["mem_train"] = peak_alloc_bytes(plain)
    return row


def measure_episode(repeats: int, kind: str = "gpt2", turns: int = 40, turn_len: int = 12, seed: int = 0) -> dict:
    """One 40-turn episode (one row, ``turns × turn_len`` positions), ``by_segment``: the within-row path.

    The one-pass engine does not apply (every part lies inside the one row); times the reference engine
    and, where installed, the forward-mode ``jvp`` engine (``readings="projected"``) against a plain step.
    """
    from lens_callbacks.credit.engines import available_engines

    L = turns * turn_len
    policy = Policy(make_model(kind, seed, positions=L))
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, L), generator=g)  # [1, L]
    trained = torch.ones(1, L, dtype=torch.bool)  # [1, L]
    trained[:, 0] = False
    segment = (torch.arange(L) // turn_len)[None].clone()  # [1, L]
    segment[~trained] = -1
    batch = (ids, torch.ones(1), trained, segment)

    def train_step():
        opt.zero_grad()
        policy.credit_terms(batch).terms.sum().backward()
        opt.step()

    audits = {"reference": lambda: disintegrate(policy, batch, "by_segment", engine="reference")}
    if "jvp" in available_engines():
        audits["jvp"] = lambda: disintegrate(policy, batch, "by_segment", engine="jvp", readings="projected")
    train_step()
    for fn in audits.values():
        fn()
    t_train: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in audits}
    for _ in range(repeats):
        t0 = time.perf_counter()
        train_step()
        t_train.append(time.perf_counter() - t0)
        for k, fn in audits.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    tr = statistics.median(t_train)
    row: dict[str, Any] = {"kind": kind, "turns": turns, "T": L}
    for k, ts in times.items():
        row[f"{k}_over_train"] = statistics.median(ts) / tr
    return row


def episode_table(rows: list[dict]) -> str:
    lines = [
        "",
        "Within-row parts: one 40-turn episode (one row, 40 × 12 positions, `by_segment`, 40 parts); audit time /",
        "step time. The one-pass engine does not apply here (all parts lie in one row); `jvp` is the forward-mode",
        'engine (`readings="projected"`), shown where installed.',
        "",
        "| policy | turns | T | reference | jvp |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        jvp = r.get("jvp_over_train")
        lines.append(
            f"| {r['kind']} | {r['turns']} | {r['T']} | {r['reference_over_train']:.2f} | {'not installed' if jvp is None else f'{jvp:.2f}'} |"
        )
    return "\n".join(lines)


def table(rows: list[dict], repeats: int) -> str:
    lines = [
        "Policies: transformers GPT-2 (2 layers, width 128, tied embeddings, eager attention) and Llama-style",
        "(LlamaForCausalLM, 2 layers, width 128, RMSNorm, rotary), random weights, float32; one rollout per row,",
        f"T = {T} (40 trained positions per row), `by_rollout` with m parts = m rows; {repeats} interleaved repeats",
        'in one process, ratios of medians, `torch.set_num_threads(1)`. "step" = forward + backward + Adam on the',
        "same batch. Columns: audit time / step time for a separate pass; for `ride`, the extra time of the",
        "audited step over the plain step, (audited − plain) / plain. `vmap` = torch.func `vmap(grad)` per-row",
        "gradients + the same readings; `opacus` = Opacus `GradSampleModule` per-sample gradients + the same",
        "readings. `reference`, `ghost`, `ride`, `vmap` and `opacus` make all readings (projected and norm shares,",
        "cancellation, the interference matrix); `shares` = the same without the interference matrix",
        '(`readings="shares"`); `projected` = projected shares only; `shares, g = .grad` = `shares` with',
        '`full_grad` = the step\'s `.grad` (`CreditAuditCallback(full_grad="trainer")`: no weight gradient in the pass).',
        "",
        "| policy | m | params | reference | ghost | ghost, shares | ghost, projected | ghost, shares, g = .grad | ride (extra) | ride, shares (extra) | ride, projected (extra) | vmap | opacus | ghost conservation_error | ghost vs reference, max share gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(r, k):
        v = r.get(f"{k}_over_train")
        return "—" if v is None else f"{v:.2f}"

    for r in rows:
        gap = r.get("max_share_gap")
        lines.append(
            f"| {r['kind']} | {r['m']} | {r['n_params']:,} | {f(r, 'reference')} | {f(r, 'ghost')} | {f(r, 'ghost_shares')} | "
            f"{f(r, 'ghost_projected')} | {f(r, 'ghost_grad')} | {f(r, 'ride')} | {f(r, 'ride_shares')} | {f(r, 'ride_projected')} | "
            f"{f(r, 'vmap')} | {f(r, 'opacus')} | {r['conservation_error']:.1e} | {'—' if gap is None else f'{gap:.1e}'} |"
        )
    mem_rows = [r for r in rows if "mem_plain" in r]
    if mem_rows:
        lines += [
            "",
            "Peak memory allocated inside the call and alive at once, in units of the parameters' bytes (float32):",
            "",
            "| policy | m | plain fwd+bwd | reference | ghost | ghost, shares | ghost, shares, budget \\|θ\\| | vmap | opacus | plain step | ride-along step | ride-along step, shares |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]

        def mm(r, k):
            v = r.get(f"mem_{k}")
            return "—" if v is None else f"{v / r['param_bytes']:.1f}"

        for r in mem_rows:
            lines.append(
                f"| {r['kind']} | {r['m']} | {mm(r, 'plain')} | {mm(r, 'reference')} | {mm(r, 'ghost')} | "
                f"{mm(r, 'ghost_shares')} | {mm(r, 'ghost_lowmem_shares')} | {mm(r, 'vmap')} | "
                f"{mm(r, 'opacus')} | {mm(r, 'train')} | {mm(r, 'ride')} | {mm(r, 'ride_shares')} |"
            )
        low = [r for r in mem_rows if "ghost_lowmem_over_train" in r]
        if low:
            lines += [
                "",
                "`ghost, budget |θ|`: `memory_budget=|θ|` (chunks of per-part pieces of at most |θ|/2 elements); its time:",
                "",
            ]
            lines += [
                f"- {r['kind']}, m = {r['m']}: {r['ghost_lowmem_over_train']:.2f}× a step with all readings, "
                f"{r['ghost_lowmem_shares_over_train']:.2f}× with `shares`, "
                f"{r['ghost_lowmem_projected_over_train']:.2f}× with projected shares only."
                for r in low
            ]
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The goal (issue: ≤ 1.3× a step as a separate pass, ≤ 0.5× riding along, flat in m) against the rows."""

    def span(key):
        vals = [r[key] for r in rows if key in r]
        return (min(vals), max(vals)) if vals else None

    lines = ["", "Against the goal (exact readings for `by_rollout` at m = 8, 32, 64):", ""]
    for key, goal, label in (
        ("ghost_over_train", 1.3, "separate pass, all readings with the interference matrix (`ghost`)"),
        (
            "ghost_shares_over_train",
            1.3,
            "separate pass, `shares` (the readings the goal was set on: projected and norm shares, cancellation, conservation)",
        ),
        ("ghost_projected_over_train", 1.3, "separate pass, projected shares only"),
        (
            "ghost_grad_over_train",
            1.3,
            'separate pass, `shares`, `g_full` = the step\'s `.grad` (`full_grad="trainer"`)',
        ),
        (
            "ride_over_train",
            0.5,
            "riding on the training step, all readings with the interference matrix (extra over the plain step)",
        ),
        ("ride_shares_over_train", 0.5, "riding on the training step, `shares` (extra)"),
        ("ride_projected_over_train", 0.5, "riding on the training step, projected shares only (extra)"),
    ):
        sp = span(key)
        if sp is None:
            continue
        met = "meets it" if sp[1] <= goal else ("meets it only in part" if sp[0] <= goal else "falls short")
        lines.append(f"- {label}: {sp[0]:.2f}–{sp[1]:.2f}× a step against ≤ {goal}× — {met}.")
    peers = [min(r.get("vmap_over_train", float("inf")), r.get("opacus_over_train", float("inf"))) for r in rows]
    ghost = [r.get("ghost_over_train", float("inf")) for r in rows]
    ahead = sum(g < p for g, p in zip(ghost, peers))
    lines.append(f"- ahead of the fastest peer (vmap or Opacus) as a separate pass in {ahead} of {len(rows)} rows.")
    return "\n".join(lines)


def write_section(path: Path, body: str, section: str = SECTION, end_marker: str = GENERATED_END) -> None:
    """Replace the generated part of ``section`` (up to ``end_marker``; the written analysis after it stays)."""
    text = path.read_text() if path.exists() else "# Performance\n\n"
    body = body + "\n\n" + end_marker
    if section in text:
        head, _, rest = text.partition(section)
        end = rest.find(end_marker)
        if end >= 0:
            tail = rest[end + len(end_marker) :].lstrip("\n")
        else:
            nxt = rest.find("\n## ")
            tail = rest[nxt + 1 :] if nxt >= 0 else ""
        text = head + section + "\n\n" + body + "\n\n" + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n\n" + body + "\n"
    path.write_text(text)


# ---- real shapes ------------------------------------------------------------------------------------

REAL_SECTION = "## Credit audit at real shapes (`benchmarks/credit_cost.py --only real`)"
REAL_END = "<!-- the block above is written by benchmarks/credit_cost.py --only real --write; the text below is not -->"
#: The real-shape policies: transformers configs built from random weights (nothing downloaded).
REAL_SHAPES = {
    "qwen2": dict(
        vocab=151936, hidden=896, layers=2, intermediate=4864, heads=14, kv_heads=2, tied=True, qkv_bias=True
    ),
    "llama": dict(vocab=32000, hidden=512, layers=4, intermediate=1376, heads=8, kv_heads=8, tied=False),
}
#: (policy, m, T) rows run by default; the issue's other combinations are listed with why they are not run.
REAL_ROWS = (("llama", 8, 128), ("qwen2", 8, 128), ("llama", 32, 128), ("llama", 8, 512))
REAL_GRID = tuple((k, m, t) for k in ("qwen2", "llama") for m in (8, 32) for t in (128, 512))
REAL_MODES = ("step", "ride_shares", "sep_shares", "sep_all", "trainer", "trainer_all", "vmap", "opacus")
REAL_LABELS = {
    "ride_shares": "ride-along `shares` (extra over a step)",
    "sep_shares": "separate `shares`",
    "sep_all": "separate, all readings",
    "trainer": '`full_grad="trainer"` (`shares`)',
    "trainer_all": '`full_grad="trainer"`, all readings',
    "vmap": "torch.func vmap(grad)",
    "opacus": "Opacus",
}


def make_real_model(kind: str, T: int, seed: int = 0, **override: Any) -> nn.Module:
    """A random-initialised transformers policy of a real shape (``override``: e.g. ``vocab=512`` for a smoke test)."""
    if kind not in REAL_SHAPES:
        raise ValueError(f"`kind` must be one of {sorted(REAL_SHAPES)}, got {kind!r}.")
    bad = sorted(set(override) - set(REAL_SHAPES[kind]))
    if bad:
        raise ValueError(f"shape overrides must be among {sorted(REAL_SHAPES[kind])}, got {bad!r}.")
    sh = {**REAL_SHAPES[kind], **override}
    if not sh.get("qkv_bias", kind == "qwen2") == (kind == "qwen2"):
        raise ValueError(f"`qkv_bias` follows the policy's family ({kind}: {kind == 'qwen2'}), got {sh['qkv_bias']!r}.")
    common = dict(
        vocab_size=sh["vocab"],
        hidden_size=sh["hidden"],
        intermediate_size=sh["intermediate"],
        num_hidden_layers=sh["layers"],
        num_attention_heads=sh["heads"],
        num_key_value_heads=sh["kv_heads"],
        max_position_embeddings=max(T, 64),
        tie_word_embeddings=sh["tied"],
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "qwen2":
            from transformers import Qwen2Config, Qwen2ForCausalLM

            # transformers' default attention (sdpa): the step the user runs is every ratio's denominator
            return Qwen2ForCausalLM(Qwen2Config(**common, attention_dropout=0.0))
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common))


def real_estimate(kind: str, m: int, T: int, **override: Any) -> dict:
    """Peak bytes and a step's multiply-adds, estimated before building anything (to drop rows that do not fit)."""
    from route_counts import n_params, route_counts

    sh = {**REAL_SHAPES[kind], **override}
    P = n_params(sh)
    # parameters, .grad, Adam's two moments, a float64 copy for the drift reading; logits, their
    # log-softmax and their gradient live at once in the step
    peak = 4 * P * 4 + 8 * P * 2 + 3 * 4 * m * T * sh["vocab"]
    per_row = 4 * m * P  # what the peers hold: every per-row gradient
    return {"params": P, "peak_bytes": peak, "peer_bytes": per_row, "step_macs": route_counts(sh, m, T)["step"].macs}


def _real_setup(kind: str, m: int, T: int, modes, *, seed: int = 0, peer_budget: float = 3 * 2**30, **override: Any):
    """One real-shape row's policy, batch, optimiser and the callable of every mode it can run (a mode the
    row cannot run is in ``row["skipped"]`` with the reason)."""
    prompt = T // 8
    policy = Policy(make_real_model(kind, T, seed, **override))
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-5)
    V = policy.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (m, T), generator=g)  # [m, T]
    ids[:, 3] = ids[:, 2]  # a token repeated within a row
    ids[1:, 5] = ids[0, 5]  # and across rows
    adv = torch.randn(m, generator=g)  # [m]
    trained = torch.zeros(m, T, dtype=torch.bool)  # [m, T]
    trained[:, prompt:] = True
    batch = (ids, adv, trained)
    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    n_params = sum(p.numel() for _, p in named)
    param_bytes = sum(p.numel() * p.element_size() for _, p in named)
    z = trained.sum()
    row: dict[str, Any] = {
        "kind": kind,
        "m": m,
        "T": T,
        "n_params": n_params,
        "param_bytes": param_bytes,
        "vocab": V,
        "tied": bool(policy.model.config.tie_word_embeddings),
        "layers": policy.model.config.num_hidden_layers,
        "skipped": {},
    }
    modes = list(modes)
    if 4 * m * n_params > peer_budget:
        for k in ("vmap", "opacus"):
            if k in modes:
                modes.remove(k)
                row["skipped"][k] = (
                    f"needs m × |θ| = {4 * m * n_params / 2**30:.1f} GiB of per-row gradients (budget {peer_budget / 2**30:.1f} GiB)"
                )

    train_step, fwd_bwd, ride_step = make_steps(policy, opt, batch, readings="shares")

    def vmap_audit():
        per = vmap_row_grads(policy, named, ids, adv, trained, z)
        dots = torch.zeros(m, dtype=torch.float64)  # [m]
        gram = torch.zeros(m, m, dtype=torch.float64)  # [m, m]
        for n, _ in named:  # readings parameter by parameter: no second m × |θ| buffer
            r = per.pop(n).reshape(m, -1)  # [m, n]
            dots += (r @ r.sum(0)).double()
            gram += (r @ r.T).double()
        return dots, gram

    opacus_named: list[torch.Tensor] = []
    if "opacus" in modes:
        try:
            from opacus import GradSampleModule
        except ImportError:
            modes.remove("opacus")
            row["skipped"]["opacus"] = "not installed (the `bench` extra)"
        else:
            om = make_real_model(kind, T, seed, **override)
            om.load_state_dict(policy.model.state_dict())
            om.train()
            GradSampleModule(om)
            opacus_policy = Policy(om)
            opacus_named = [p for p in om.parameters() if p.requires_grad]

    def opacus_audit():
        for p in opacus_named:
            p.grad_sample = None
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            opacus_policy.credit_terms(batch).terms.sum().backward()
        dots = torch.zeros(m, dtype=torch.float64)  # [m]
        gram = torch.zeros(m, m, dtype=torch.float64)  # [m, m]
        for p in opacus_named:
            r = p.grad_sample.reshape(m, -1)  # [m, n]
            p.grad_sample = None
            dots += (r @ r.sum(0)).double()
            gram += (r @ r.T).double()
        return dots, gram

    def audit(readings: str, trainer: bool) -> Callable[[], Any]:
        """The one-pass audit with ``g_full`` by its own backward or from ``.grad`` as it is at the call."""

        def run():
            g = {"full_grad": [p.grad for _, p in named]} if trainer else {"reference_grads": "grad"}
            return disintegrate(policy, batch, "by_rollout", engine="ghost", readings=readings, **g)

        return run

    audits: dict[str, Callable[[], Any]] = {
        "sep_shares": audit("shares", trainer=False),
        "sep_all": audit("all", trainer=False),
        "trainer": audit("shares", trainer=True),
        "trainer_all": audit("all", trainer=True),
        "vmap": vmap_audit,
        "opacus": opacus_audit,
    }
    audits = {k: v for k, v in audits.items() if k in modes}
    return SimpleNamespace(
        policy=policy,
        batch=batch,
        row=row,
        modes=modes,
        train_step=train_step,
        fwd_bwd=fwd_bwd,
        ride_step=ride_step,
        audits=audits,
    )


def measure_real(
    kind: str,
    m: int,
    T: int,
    repeats: int,
    modes=REAL_MODES,
    *,
    seed: int = 0,
    memory: bool = True,
    drift: bool = True,
    peer_budget: float = 3 * 2**30,
    profile: bool = False,
    **override: Any,
) -> dict:
    """One real-shape row: every mode timed in this process, interleaved; ratios of medians to the plain step."""
    s = _real_setup(kind, m, T, modes, seed=seed, peer_budget=peer_budget, **override)
    policy, batch, row, train_step, fwd_bwd, ride_step = s.policy, s.batch, s.row, s.train_step, s.fwd_bwd, s.ride_step
    if tuple(modes) != REAL_MODES:
        row["modes"] = list(modes)  # --rows-from merges these modes into the row's earlier full run
    modes = s.modes
    audits = s.audits
    ride = "ride_shares" in modes

    train_step()  # warm-up (allocations, Adam state)
    if ride:
        ride_step()
    fwd_bwd()
    for fn in audits.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in ["step"] + (["ride_shares"] if ride else []) + list(audits)}
    usage: dict[str, list] = {k: [] for k in times}

    def timed(k, fn):
        t, u = clock_usage(fn)
        times[k].append(t)
        if u is not None:
            usage[k].append(u)

    order = list(audits.items())
    for i in range(repeats):
        timed("step", train_step)
        if ride:
            timed("ride_shares", ride_step)
        # Every separate pass starts right after a backward of this batch (its .grad, as at
        # on_before_optimizer_step), never after another pass: the allocator's state a pass inherits
        # moves its wall time by a third of a step (on llama m = 8, T = 128 a pass run after `trainer`
        # paid ~1 s more in system time for mapping fresh memory, whichever pass it was).
        j = i % len(order) if order else 0
        for k, fn in order[j:] + order[:j]:
            fwd_bwd()
            timed(k, fn)
    tr = statistics.median(times["step"])
    row["step_s"] = tr
    row["repeats"] = repeats
    for k, ts in times.items():
        if k != "step":
            med = statistics.median(ts)
            row[f"{k}_over_train"] = (med - tr) / tr if k == "ride_shares" else med / tr
    if all(usage.values()):
        # per mode, medians over the repeats: user and system seconds, minor page faults
        row["cpu"] = {k: [statistics.median(u[j] for u in us) for j in range(3)] for k, us in usage.items()}
    # The timings now, before the memory and precision passes: a process killed in those (the Qwen2 shape
    # at T = 512 was, twice, at 24 GiB) keeps them for --rows-from.
    print(json.dumps({**row, "partial": "timings only: memory and precision passes not finished"}), flush=True)
    if memory:
        row["mem_step"] = peak_alloc_bytes(train_step)
        if ride:
            row["mem_ride_shares"] = peak_alloc_bytes(ride_step)
        for k, fn in audits.items():
            fwd_bwd()
            row[f"mem_{k}"] = peak_alloc_bytes(fn)
    fwd_bwd()
    r32 = disintegrate(policy, batch, "by_rollout", engine="ghost", readings="shares", reference_grads="grad")
    row["conservation_error"] = r32.conservation_error
    row["grad_match"] = r32.grad_match
    row["sum_shares_err"] = abs(math.fsum(r32.projected_share) - 1.0)
    if drift:
        r64 = disintegrate(policy, batch, "by_rollout", engine="ghost", readings="shares", dtype="float64")
        row["drift"] = max(abs(a - b) for a, b in zip(r32.projected_share, r64.projected_share))
        row["sum_shares_err_f64"] = abs(math.fsum(r64.projected_share) - 1.0)
    if profile:
        row["profile"] = {}
        for k, fn in (("sep_shares", audits.get("sep_shares")), ("ride_shares", ride_step if ride else None)):
            if fn is not None:
                fwd_bwd()
                row["profile"][k] = profile_top(fn, tr)
    return row


APART_READINGS = tuple(f"mem_{k}" for k in REAL_MODES) + ("drift",)


def measure_reading(
    kind: str, m: int, T: int, reading: str, *, seed: int = 0, peer_budget: float = 3 * 2**30, **override: Any
) -> dict:
    """One memory or precision reading of a real row, made alone in this process (each of ``--apart``'s
    children runs one): ``mem_<mode>``, the mode's peak bytes as :func:`measure_real` reads them, or
    ``drift``, the float32 shares against a float64 pass.

    Each call the reading measures runs once unmeasured first, as in :func:`measure_real`, where the peak is
    read after the timed repeats: what a first call allocates and keeps is not counted as its peak."""
    if reading not in APART_READINGS:
        raise ValueError(f"`reading` must be one of {list(APART_READINGS)}, got {reading!r}.")
    mode = reading[len("mem_") :] if reading != "drift" else "sep_shares"
    s = _real_setup(kind, m, T, ("step", mode), seed=seed, peer_budget=peer_budget, **override)
    out: dict[str, Any] = {"kind": kind, "m": m, "T": T, "param_bytes": s.row["param_bytes"], "apart": [reading]}
    if mode in s.row["skipped"]:
        out["skipped"] = {mode: s.row["skipped"][mode]}
        return out
    if reading == "drift":
        s.fwd_bwd()
        r32 = disintegrate(s.policy, s.batch, "by_rollout", engine="ghost", readings="shares", reference_grads="grad")
        s.policy.zero_grad(set_to_none=True)  # the float64 pass needs no .grad: its room goes to float64 activations
        r64 = disintegrate(s.policy, s.batch, "by_rollout", engine="ghost", readings="shares", dtype="float64")
        out["drift"] = max(abs(a - b) for a, b in zip(r32.projected_share, r64.projected_share))
        out["sum_shares_err"] = abs(math.fsum(r32.projected_share) - 1.0)
        out["sum_shares_err_f64"] = abs(math.fsum(r64.projected_share) - 1.0)
        out["conservation_error"] = r32.conservation_error
        return out
    if mode in ("step", "ride_shares"):
        s.train_step()  # Adam's state exists before the measured step, as in a run
        fn = s.train_step if mode == "step" else s.ride_step
    else:
        s.fwd_bwd()  # .grad of this batch, as at on_before_optimizer_step; the audits leave it as it is
        fn = s.audits[mode]
    fn()
    out[reading] = peak_alloc_bytes(fn)
    return out


def measure_apart(
    kind: str,
    m: int,
    T: int,
    readings=APART_READINGS,
    *,
    seed: int = 0,
    peer_budget: float = 3 * 2**30,
    **override: Any,
) -> dict:
    """A real row's memory and drift readings, each in a Python process of its own (:func:`measure_reading`).

    In one process the resident set grows across the profiled memory passes and the float64 pass (the
    rows of 4,096 and more positions a step were killed at 24 GiB there); alone, each reading needs only
    its own pass's memory. A child that fails (killed for memory, say) is recorded in ``failed`` with its
    exit status; the other readings are still made."""
    out: dict[str, Any] = {"kind": kind, "m": m, "T": T, "apart": [], "failed": {}, "skipped": {}}
    shape = [f"--shape={k}={v}" for k, v in override.items()]
    for reading in readings:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--only",
            "real",
            "--real-rows",
            f"{kind}:{m}:{T}",
            "--seed",
            str(seed),
            "--peer-budget-gib",
            repr(peer_budget / 2**30),
            "--reading",
            reading,
            *shape,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not got:
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            out["failed"][reading] = f"exit status {proc.returncode}: {why}"
            continue
        r = got[-1]
        out["skipped"].update(r.pop("skipped", {}))
        out["apart"] += r.pop("apart")
        out.update({k: v for k, v in r.items() if k not in ("kind", "m", "T")})
        print(
            json.dumps({"reading": reading, **{k: v for k, v in r.items() if k not in ("kind", "m", "T")}}), flush=True
        )
    return out


def profile_top(fn: Callable[[], Any], step_s: float, n: int = 6) -> list[tuple[str, float]]:
    """The ``n`` operators with the most self CPU time inside ``fn()``, each as a fraction of a plain step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, e.self_cpu_time_total / 1e6 / step_s) for e in ev]


def _cpu_text(cpu: dict) -> str:
    """A run's CPU time per mode: user time against the plain step's (the work, whatever the allocator
    does), then system seconds and minor page faults (mapping fresh memory)."""
    u0 = cpu["step"][0]
    return "CPU time a call (medians): user time against the step's, system seconds, minor page faults — " + "; ".join(
        f"step {u:.2f} s user, {sy:.2f} s, {fl / 1e3:.0f}k"
        if k == "step"
        else f"{k} {u / u0:.2f}×, {sy:.2f} s, {fl / 1e3:.0f}k"
        for k, (u, sy, fl) in cpu.items()
    )


def real_table(rows: list[dict], repeats: int, dropped: list[str]) -> str:
    reps = " / ".join(str(x) for x in sorted({r.get("repeats", repeats) for r in rows})) or str(repeats)
    shapes = []
    for kind, sh in REAL_SHAPES.items():
        shapes.append(
            f"`{kind}`: {'Qwen2ForCausalLM' if kind == 'qwen2' else 'LlamaForCausalLM'}, vocabulary {sh['vocab']:,} "
            f"({'tied' if sh['tied'] else 'untied'} embedding / LM head), width {sh['hidden']}, {sh['layers']} layers, MLP "
            f"{sh['intermediate']}, {sh['heads']} heads / {sh['kv_heads']} KV heads"
        )
    lines = [
        "Policies (transformers configs, random weights, float32, their default sdpa attention, nothing downloaded): "
        + "; ".join(shapes)
        + ".",
        f"`by_rollout`, m rows of T positions (the first T/8 untrained); {reps} interleaved repeats in one",
        'process, ratios of medians, `torch.set_num_threads(1)`. "step" = forward + backward + Adam (its wall time',
        "on the machine as loaded during the run in the `step (s)` column). Separate",
        'passes: audit time / step time (`engine="ghost"`, `reference_grads="grad"`); ride-along: (audited step −',
        "plain step) / plain step. Peers make all readings (dots with g_full and the Gram) from per-row gradients.",
        "Memory: peak bytes allocated inside the call and alive at once, minus the plain step's, in units of the",
        "parameters' bytes. Drift: max |float32 share − float64 share| (one-pass engine both); Σ: |Σ float32 shares − 1|.",
        "",
        "| policy | params | m | T | step (s) | "
        + " | ".join(REAL_LABELS[k] for k in REAL_MODES[1:])
        + " | f32 vs f64 drift | Σ shares − 1 | conservation_error |",
        "|---|---:|---:|---:|---:|" + "---:|" * (len(REAL_MODES) - 1) + "---:|---:|---:|",
    ]

    def cell(r, k):
        v = r.get(f"{k}_over_train")
        if v is None:
            return "not run" if k in r.get("skipped", {}) else "—"
        text = f"+{v:.2f}" if k == "ride_shares" else f"{v:.2f}×"
        mem = r.get(f"mem_{k}")
        if mem is not None and "mem_step" in r:
            text += f" ({(mem - r['mem_step']) / r['param_bytes']:+.1f})"
        return text

    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['n_params'] / 1e6:.0f} M | {r['m']} | {r['T']} | {r['step_s']:.2f} | "
            + " | ".join(cell(r, k) for k in REAL_MODES[1:])
            + "".join(
                f" | {'not run' if r.get(k) is None else format(r[k], '.1e')}"
                for k in ("drift", "sum_shares_err", "conservation_error")
            )
            + " |"
        )
    lines.append("")
    for r in rows:
        for o in r.get("other_runs", []):
            lines.append(
                f"{r['kind']}, m = {r['m']}, T = {r['T']}: {', '.join(k for k in o['modes'] if k != 'step')} timed in a separate "
                f"run (`--modes`), against that run's plain step ({o['step_s']:.2f} s)."
            )
    for r in rows:
        if r.get("apart"):
            lines.append(
                f"{r['kind']}, m = {r['m']}, T = {r['T']}: {', '.join(r['apart'])} read each in a process of its own (`--apart`)."
            )
    for r in rows:
        for run, cpu in [("", r.get("cpu"))] + [
            (f" (the `--modes {' '.join(o['modes'])}` run)", o.get("cpu")) for o in r.get("other_runs", [])
        ]:
            if cpu and cpu.get("step", [0])[0] > 0:
                lines.append(f"{r['kind']}, m = {r['m']}, T = {r['T']}{run}: {_cpu_text(cpu)}.")
    if any(r.get("other_runs") or r.get("apart") or r.get("cpu") for r in rows):
        lines.append("")
    lines.append("(In parentheses: extra peak memory over the plain step, in parameter-sizes.)")
    skipped = [
        f"- {r['kind']}, m = {r['m']}, T = {r['T']}: {k} not run — {why}."
        for r in rows
        for k, why in r.get("skipped", {}).items()
    ]
    skipped += [
        f"- {r['kind']}, m = {r['m']}, T = {r['T']}: {k} (`--apart`) failed — {why}."
        for r in rows
        for k, why in r.get("apart_failed", {}).items()
    ]
    if skipped or dropped:
        lines += ["", "Not run:", ""] + [f"- {d}" for d in dropped] + skipped
    return "\n".join(lines)


def _span_text(sp: tuple[float, float]) -> str:
    return f"{sp[0]:.2f}" if f"{sp[0]:.2f}" == f"{sp[1]:.2f}" else f"{sp[0]:.2f}–{sp[1]:.2f}"


def real_verdict(rows: list[dict]) -> str:
    """The issue's goals at real shapes, against the rows: met or not, with the numbers."""

    def span(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return (min(vals), max(vals)) if vals else None

    lines = ["", "Against the goals at real shapes (this run):", ""]
    for key, goal, label in (
        ("ride_shares_over_train", 0.5, "riding on the step with `shares`: ≤ +0.5 of a step"),
        ("sep_shares_over_train", 1.3, "separate pass `shares`: ≤ 1.3×"),
        ("sep_all_over_train", 1.5, "separate pass, all readings: ≤ 1.5×"),
        (
            "trainer_all_over_train",
            1.5,
            'all readings with `g_full` from the step\'s `.grad` (`full_grad="trainer"`), '
            "against the separate pass's bound: ≤ 1.5×",
        ),
    ):
        sp = span(key)
        if sp is None:
            continue
        met = "met" if sp[1] <= goal else ("met on some rows" if sp[0] <= goal else "not met")
        lines.append(f"- {label}: {_span_text(sp)} — {met}.")
    ahead = total = 0
    for r in rows:
        peers = [r[f"{k}_over_train"] for k in ("vmap", "opacus") if r.get(f"{k}_over_train") is not None]
        if peers:
            total += 1
            ahead += r.get("sep_all_over_train", float("inf")) < min(peers)
    lines.append(
        f"- ahead of torch.func and Opacus (separate pass, all readings, against the faster peer): {ahead} of {total} rows where a peer ran"
        f"{'' if total == len(rows) else f' (on the other {len(rows) - total} rows the peers need more memory than the budget)'}."
    )
    extra = [
        ((r[f"mem_{k}"] - r["mem_step"]) / r["param_bytes"], k)
        for r in rows
        for k in ("ride_shares", "sep_shares", "sep_all", "trainer", "trainer_all")
        if r.get(f"mem_{k}") is not None and "mem_step" in r
    ]
    if extra:
        worst = max(extra)
        lines.append(
            f"- extra peak memory ≤ one parameter-size over a plain step: worst {worst[0]:+.1f} ({worst[1]}) — {'met' if worst[0] <= 1.0 else 'not met'}."
        )
    dr, ss = span("drift"), span("sum_shares_err")
    if dr is not None:
        lines.append(
            f"- float32 shares within 1e-7 of float64: max drift {dr[1]:.1e} — {'met' if dr[1] <= 1e-7 else 'not met'}."
        )
    if ss is not None:
        lines.append(
            f"- float32 shares sum to 1 within 1e-7: worst {ss[1]:.1e} — {'met' if ss[1] <= 1e-7 else 'not met'}."
        )
    prof = [(r, r["profile"]) for r in rows if r.get("profile")]
    if prof:
        lines += [
            "",
            "Where the time goes (`torch.profiler`, one call each, self CPU time of the top operators as a",
            "fraction of the median plain step):",
            "",
        ]
        what = {
            "sep_shares": "the separate `shares` pass",
            "ride_shares": "the whole ride-along step (the step's own work included)",
        }
        for r, p in prof:
            for k, ops in p.items():
                lines.append(
                    f"- {r['kind']}, m = {r['m']}, T = {r['T']}, {what[k]}: "
                    + ", ".join(f"`{name}` {frac:.2f}" for name, frac in ops)
                    + "."
                )
    return "\n".join(lines)


def paper_block() -> str:
    """The 7B shape on paper: multiply-adds and bytes per route, from :mod:`route_counts`."""
    from route_counts import SHAPES, counts_table

    return "\n".join(
        [
            "",
            "### On paper: Qwen2.5-7B's shape (`benchmarks/route_counts.py`)",
            "",
            counts_table("Qwen2.5-7B shape", SHAPES["qwen2.5-7b"], 8, 4096, bytes_per_element=2),
            "",
            "The benchmark's Qwen2 row, counted the same way (float32):",
            "",
            counts_table("qwen2 (this benchmark)", SHAPES["qwen2-bench"], 8, 128, bytes_per_element=4),
        ]
    )


def run_real(args, override: dict) -> str:
    wanted = [tuple(x) for x in args.real_rows]
    dropped, rows = [], []
    if args.rows_from is not None:
        # re-render rows measured earlier (the JSON lines this script prints), e.g. after a run cut short
        latest: dict[tuple, dict] = {}
        apart: list[dict] = []
        for line in args.rows_from.read_text().splitlines():
            if line.startswith("{") and '"kind"' in line and '"apart"' in line and '"step_s"' not in line:
                apart.append(json.loads(line))  # memory and drift read apart (--apart), merged below
            elif line.startswith("{") and '"kind"' in line and '"step_s"' in line:
                r = json.loads(line)
                key = (r["kind"], r["m"], r["T"])
                if r.get("modes") is not None and key in latest:
                    latest[key] = _merge_modes(latest[key], r)  # a later run of some modes only (--modes)
                else:
                    latest[key] = r  # a row's full line follows its timings-only line
        for a in apart:
            key = (a["kind"], a["m"], a["T"])
            if key in latest:
                latest[key] = _merge_apart(latest[key], a)
        rows = list(latest.values())
        done = {(r["kind"], r["m"], r["T"]) for r in rows}
        for kind, m, T in wanted:
            if (kind, m, T) not in done:
                dropped.append(f"{kind}, m = {m}, T = {T}: not finished in the run these rows come from")
        wanted = [w for w in wanted if w in done]
    for kind, m, T in REAL_GRID:
        if (kind, m, T) in wanted or any(d.startswith(f"{kind}, m = {m}, T = {T}:") for d in dropped):
            continue
        est = real_estimate(kind, m, T)
        passes = len(REAL_MODES) + 6
        took = ""
        if rows:  # the measured rows' rate (multiply-adds a second of a plain step) prices the missing one
            rate = statistics.median(real_estimate(r["kind"], r["m"], r["T"])["step_macs"] / r["step_s"] for r in rows)
            took = f" (≈ {passes * est['step_macs'] / rate / 60:.0f} min a repeat on one thread at the measured rows' rate)"
        dropped.append(
            f"{kind}, m = {m}, T = {T}: not run — about {est['peak_bytes'] / 2**30:.1f} GiB at peak (estimated) and "
            f"{est['step_macs'] / 1e12:.2f} T multiply-adds a step, about {passes} step-sized passes per repeat{took}"
        )
    for kind, m, T in [] if args.rows_from is not None else wanted:
        row = measure_real(
            kind,
            m,
            T,
            args.repeats if not args.quick else 1,
            modes=args.modes,
            memory=args.memory and not args.quick,
            drift=args.drift and not args.quick,
            profile=args.profile and not args.quick,
            peer_budget=args.peer_budget_gib * 2**30,
            seed=args.seed,
            **override,
        )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}), flush=True)
    return (
        real_table(rows, args.repeats if not args.quick else 1, dropped)
        + "\n"
        + real_verdict(rows)
        + "\n"
        + paper_block()
    )


def _merge_apart(row: dict, extra: dict) -> dict:
    """``row`` with the memory and drift readings an ``--apart`` run made (each in a process of its own)."""
    out = {**row, "skipped": {**row.get("skipped", {}), **extra.get("skipped", {})}}
    for k, v in extra.items():
        if k.startswith("mem_") or k in ("drift", "sum_shares_err_f64"):
            out[k] = v
    out["apart"] = sorted(set(row.get("apart", [])) | set(extra.get("apart", [])))
    out["apart_failed"] = {**row.get("apart_failed", {}), **extra.get("failed", {})}
    return out


def _merge_modes(row: dict, extra: dict) -> dict:
    """``row`` with the modes a later ``--modes`` run timed taken from that run (each ratio is to the plain
    step of its own process)."""
    out = {**row, "skipped": dict(row.get("skipped", {}))}
    for k in extra["modes"]:
        if k == "step":
            continue
        for key in (f"{k}_over_train", f"mem_{k}"):
            if extra.get(key) is not None:
                out[key] = extra[key]
        if k in extra.get("skipped", {}):
            out["skipped"][k] = extra["skipped"][k]
        else:
            out["skipped"].pop(k, None)
    out["mem_step_" + "+".join(extra["modes"])] = extra.get("mem_step")
    runs = [
        o for o in out.get("other_runs", []) if o["modes"] != extra["modes"]
    ]  # its timings-only line, then its full one
    out["other_runs"] = runs + [
        {"modes": extra["modes"], "step_s": extra["step_s"], **({"cpu": extra["cpu"]} if extra.get("cpu") else {})}
    ]
    return out


def _shape_override(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not value.strip().lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"a shape override must be KEY=INTEGER, e.g. vocab=4096, got {text!r}.")
    return key.strip(), int(value)


def _real_row(text: str) -> tuple[str, int, int]:
    try:
        kind, m, T = text.split(":")
        if kind not in REAL_SHAPES:
            raise ValueError
        return kind, int(m), int(T)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a real row must be POLICY:m:T with POLICY one of {sorted(REAL_SHAPES)}, got {text!r}; e.g. llama:8:128."
        ) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        choices=["all", "toy", "real"],
        default="all",
        help="run the toy rows, the real-shape rows, or both (default)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one repeat, toys at m = 8 only, real rows llama:8:128 only, no memory/drift/profile (a smoke run)",
    )
    ap.add_argument("--parts", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--policies", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--real-rows",
        type=_real_row,
        nargs="+",
        default=list(REAL_ROWS),
        metavar="POLICY:m:T",
        help="real-shape rows to run (default: %(default)s)",
    )
    ap.add_argument("--real-repeats", type=int, default=3)
    ap.add_argument(
        "--peer-budget-gib",
        type=float,
        default=3.0,
        help="skip torch.func / Opacus on a real row whose m × |θ| per-row gradients exceed this",
    )
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile the separate `shares` pass and the ride-along step on each real row",
    )
    ap.add_argument(
        "--rows-from",
        type=Path,
        default=None,
        metavar="LOG",
        help="render the real-shape block from the JSON rows an earlier run printed, instead of measuring",
    )
    ap.add_argument(
        "--drift",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="real rows: read the float32 shares against a float64 pass (--no-drift where a float64 "
        "copy of the step does not fit: the Qwen2 shape at T = 512 needs more than 24 GiB)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(REAL_MODES),
        choices=list(REAL_MODES),
        type=str,
        help="real rows: the modes to time (the plain step always); e.g. `--modes step vmap opacus "
        "--peer-budget-gib 8` for the peers alone, merged into the row's earlier run by --rows-from",
    )
    ap.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="real rows: take each mode's peak memory (--no-memory where the profiled passes do not fit: "
        "the Qwen2 shape at 4,096 positions a step was killed for memory at 24 GiB after them)",
    )
    ap.add_argument(
        "--apart",
        nargs="*",
        default=None,
        choices=list(APART_READINGS),
        metavar="READING",
        help="real rows: no timings; the memory and drift readings (all, or those named: "
        f"{', '.join(APART_READINGS)}), each in a process of its own, for rows whose profiled passes "
        "do not fit in one process; --rows-from merges them into the row's timed run",
    )
    ap.add_argument(
        "--reading", choices=list(APART_READINGS), default=None, help=argparse.SUPPRESS
    )  # one --apart child
    ap.add_argument("--seed", type=int, default=0, help="real rows: the seed of the policy and the batch")
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        type=_shape_override,
        metavar="KEY=VALUE",
        help="real rows: override one of the policy's shape figures (e.g. vocab=4096 for a smoke run)",
    )
    ap.add_argument("--no-episode", action="store_true", help="skip the 40-turn within-row episode")
    ap.add_argument(
        "--route",
        default="auto",
        choices=["auto", "direct", "ghost"],
        help="how the ghost engines read Linear/Conv1D weights: per layer by cost (auto), per-row products, or the ghost identities",
    )
    ap.add_argument("--write", type=Path, default=None, help="markdown file whose generated blocks are replaced")
    args = ap.parse_args(argv)
    if args.quick:
        args.parts, args.repeats, args.no_episode = [8], 1, True
        if args.real_rows == list(REAL_ROWS):
            args.real_rows = [("llama", 8, 128)]
    torch.set_num_threads(1)
    override = dict(args.shape)
    if args.reading is not None:  # one child of --apart: one reading of one row, one JSON line
        kind, m, T = args.real_rows[0]
        print(
            json.dumps(
                measure_reading(
                    kind, m, T, args.reading, seed=args.seed, peer_budget=args.peer_budget_gib * 2**30, **override
                )
            ),
            flush=True,
        )
        return 0
    if args.apart is not None:
        for kind, m, T in args.real_rows:
            row = measure_apart(
                kind,
                m,
                T,
                args.apart or APART_READINGS,
                seed=args.seed,
                peer_budget=args.peer_budget_gib * 2**30,
                **override,
            )
            print(json.dumps(row), flush=True)
        return 0
    if args.only in ("all", "toy"):
        rows = []
        for kind in args.policies:
            for m in args.parts:
                rows.append(
                    measure(m, args.repeats, kind, tuple(args.engines), memory=m == max(args.parts), route=args.route)
                )
                print(json.dumps({k: v for k, v in rows[-1].items()}), flush=True)
        body = table(rows, args.repeats) + "\n" + verdict(rows)
        if not args.no_episode:
            episodes = [measure_episode(args.repeats, kind) for kind in args.policies]
            body += "\n" + episode_table(episodes)
        print(body)
        if args.write is not None:
            write_section(args.write, body)
            print(f"wrote the toy rows to {args.write}")
    if args.only in ("all", "real"):
        args.repeats = args.real_repeats
        body = run_real(args, override)
        print(body)
        if args.write is not None:
            write_section(args.write, body, REAL_SECTION, REAL_END)
            print(f"wrote the real-shape rows to {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
