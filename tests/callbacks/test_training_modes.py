"""Every way people train, audited from a Trainer: each reading exact within its floor, or refused by name.

One LightningModule of our own (a transformers Llama with its default ``sdpa`` attention, or a Qwen2-style
LoRA, or an ``nn.MultiheadAttention`` policy) trains for two optimizer steps in each mode: gradient
accumulation 1/2/4 × the separate pass / riding along, ``torch.compile`` (inductor, aot_eager) × each engine,
activation checkpointing reentrant / non-reentrant, ``bf16-mixed`` riding along, LoRA, packed rows (rollouts as
segments of a row, position ids restarting). At every optimizer step a second callback, listed after the
audit, takes the independent reference: a float64 twin of the module (uncompiled, not checkpointed, no
autocast) at the same parameters, every micro-batch of the step replayed, one backward per part and one for
the whole step, in ``.grad``'s units. Every reading the audit logged is held against it; training with the
audit is held bit for bit against training without it.

The faults the matrix exists to catch are planted one at a time (the audit reads only the last micro-batch;
the compile guard is skipped; the audit's terms are scaled by 1.01) and each must make it fail.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.credit import CreditTerms
from lens_callbacks.credit.report import CreditReport
from lens_callbacks.refusal import Refusal

V, T, B = 64, 12, 4  # vocabulary, positions, rows per micro-batch
TURN = 4  # positions per turn: by_segment pools turn j of every row


@dataclass(frozen=True)
class Mode:
    """One training mode: the module, the trainer and the audit's options."""

    name: str
    arch: str = "llama"  # "llama" | "qwen2_lora" | "mha"
    accumulate: int = 1
    capture: str = "separate"
    engine: str = "auto"
    partition: str = "by_rollout"
    readings: str = "all"
    compile: Optional[str] = None  # "inductor" | "aot_eager"
    checkpointing: Optional[str] = None  # "reentrant" | "non_reentrant"
    precision: str = "32-true"
    packed: bool = False
    tol: float = 2e-6  # float32 audit against the float64 reference
    expect_engine: Optional[str] = None  # the engine the reading must come from
    expect_fallback: Optional[str] = None  # words of the one warning that riding along fell back
    bitwise: bool = True  # training with the audit equals training without it, bit for bit


MODES = [
    Mode("accumulate1_separate", expect_engine="ghost"),
    Mode("accumulate2_separate", accumulate=2, expect_engine="ghost"),
    Mode("accumulate4_separate", accumulate=4, expect_engine="ghost"),
    Mode("accumulate1_ride", capture="training_step", expect_engine="ghost+training_step"),
    Mode("accumulate2_ride", accumulate=2, capture="training_step", expect_engine="ghost+training_step"),
    Mode("accumulate4_ride", accumulate=4, capture="training_step", expect_engine="ghost+training_step"),
    Mode("accumulate2_by_segment", accumulate=2, partition="by_segment", readings="projected", expect_engine="jvp"),
    Mode("checkpoint_reentrant_separate", checkpointing="reentrant", expect_engine="ghost"),
    Mode(
        "checkpoint_reentrant_ride",
        checkpointing="reentrant",
        capture="training_step",
        expect_engine="ghost",
        expect_fallback="reentrant activation checkpointing",
    ),
    Mode(
        "checkpoint_non_reentrant_ride",
        checkpointing="non_reentrant",
        capture="training_step",
        expect_engine="ghost+training_step",
    ),
    Mode(
        "checkpoint_reentrant_by_segment",
        checkpointing="reentrant",
        partition="by_segment",
        engine="reference",
        expect_engine="reference",
    ),
    Mode(
        "bf16_mixed_ride",
        capture="training_step",
        precision="bf16-mixed",
        tol=3e-2,
        expect_engine="ghost+training_step",
    ),
    Mode("qwen2_lora_separate", arch="qwen2_lora", expect_engine="ghost"),
    Mode("qwen2_lora_ride", arch="qwen2_lora", capture="training_step", expect_engine="ghost+training_step"),
    Mode("mha_separate", arch="mha", expect_engine="ghost"),
    Mode("mha_by_segment_jvp", arch="mha", partition="by_segment", readings="projected", expect_engine="jvp"),
    Mode("packed_rows", packed=True, partition="by_segment", engine="reference", expect_engine="reference"),
    Mode("packed_rows_jvp", packed=True, partition="by_segment", readings="projected", expect_engine="jvp"),
    Mode("packed_rows_one_pass", packed=True, expect_engine="ghost"),
    Mode("packed_rows_ride", packed=True, capture="training_step", expect_engine="ghost+training_step"),
    Mode(
        "packed_rows_accumulate2_ride",
        packed=True,
        accumulate=2,
        capture="training_step",
        expect_engine="ghost+training_step",
    ),
    # the forward-mode engine (per-turn credit) in the same modes, riding along and separate
    *(
        Mode(name, partition="by_segment", readings="projected", **kw)
        for name, kw in (
            ("by_segment_jvp_ride", dict(capture="training_step", expect_engine="jvp+grad")),
            ("accumulate2_by_segment_jvp_ride", dict(accumulate=2, capture="training_step", expect_engine="jvp+grad")),
            ("checkpoint_reentrant_by_segment_jvp", dict(checkpointing="reentrant", expect_engine="jvp")),
            (
                "checkpoint_non_reentrant_by_segment_jvp_ride",
                dict(checkpointing="non_reentrant", capture="training_step", expect_engine="jvp+grad"),
            ),
            ("bf16_mixed_by_segment_jvp", dict(precision="bf16-mixed", tol=3e-2, expect_engine="jvp")),
            (
                "bf16_mixed_by_segment_jvp_ride",
                dict(precision="bf16-mixed", tol=3e-2, capture="training_step", expect_engine="jvp+grad"),
            ),
            (
                "qwen2_lora_by_segment_jvp_ride",
                dict(arch="qwen2_lora", capture="training_step", expect_engine="jvp+grad"),
            ),
            ("packed_rows_jvp_ride", dict(packed=True, capture="training_step", expect_engine="jvp+grad")),
        )
    ),
]
COMPILED = [
    Mode(
        f"compile_{backend}_{engine}",
        compile=backend,
        engine=engine,
        partition=part,
        readings=readings,
        expect_engine=engine,
    )
    for backend in ("aot_eager", "inductor")
    for engine, part, readings in (
        ("ghost", "by_rollout", "all"),
        ("reference", "by_segment", "all"),
        ("jvp", "by_segment", "projected"),
    )
] + [
    Mode(
        "compile_inductor_ride",
        compile="inductor",
        capture="training_step",
        expect_engine="ghost",
        expect_fallback="torch.compile",
    ),
]


# ---- the module -------------------------------------------------------------------------------------------


def _net(arch: str, checkpointing: Optional[str]) -> nn.Module:
    import transformers as tf

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if arch == "mha":
            return MHANet()
        if arch == "llama":
            cfg = tf.LlamaConfig(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
            net = tf.LlamaForCausalLM(cfg)
        else:
            from peft import LoraConfig, get_peft_model

            cfg = tf.Qwen2Config(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=True,
            )
            net = get_peft_model(
                tf.Qwen2ForCausalLM(cfg),
                LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
            )
            with torch.no_grad():
                for n, p in net.named_parameters():
                    if "lora_B" in n:  # peft starts B at zero: a zero adapter has a degenerate gradient
                        p.normal_(0, 0.3)
        if checkpointing is not None:
            net.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
            )
        return net


class MHANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, V)

    def forward(self, input_ids, position_ids=None):
        x = self.emb(input_ids)
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h, _ = self.attn(x, x, x, attn_mask=causal, need_weights=False)
        return self.head(self.norm(x + h))


class Policy(pl.LightningModule):
    """GRPO-style terms over a fixed data set of rollouts; ``training_step`` caches its micro-batch in a new object."""

    def __init__(self, mode: Mode, scale_terms: float = 1.0) -> None:
        super().__init__()
        self.mode = mode
        self.net = _net(mode.arch, mode.checkpointing)
        if mode.compile is not None:
            self.net = torch.compile(self.net, backend=mode.compile)
        self.last_rollout_batch: Optional[dict] = None

    def forward_logits(self, rb: dict) -> torch.Tensor:
        if self.mode.arch == "mha":
            return self.net(input_ids=rb["ids"])
        # no attention mask and no cache: transformers makes restarting position ids a block-diagonal mask
        return self.net(input_ids=rb["ids"], position_ids=rb["pos"], use_cache=False).logits

    def credit_terms(self, batch: Any = None) -> CreditTerms:
        rb = self.last_rollout_batch
        logits = self.forward_logits(rb)[:, :-1].float()  # [B, T-1, V]
        lp = torch.log_softmax(logits, -1).gather(-1, rb["ids"][:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        per = -rb["adv"] * lp / rb["trained"].sum()  # [B, T]
        terms = torch.where(rb["trained"], per, torch.zeros_like(per))
        return CreditTerms(terms, rb["trained"], rb["rollout"], rb["group"], segment=rb["segment"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.last_rollout_batch = dict(batch)  # a new object per micro-batch
        return self.credit_terms(None).terms.sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def micro_batches(mode: Mode, n: int) -> list[dict]:
    """``n`` micro-batches; each numbers its rows from 0 (``torch.arange(B)``), as people write it."""
    out = []
    for j in range(n):
        g = torch.Generator().manual_seed(100 + j)
        ids = torch.randint(1, V, (B, T), generator=g)
        trained = torch.ones(B, T, dtype=torch.bool)
        trained[:, :2] = False  # the prompt
        pos = torch.arange(T)[None].expand(B, T).clone()
        if mode.packed:
            # two rollouts per row, positions restarting at the second: attention stays inside each
            cut = T // 2
            pos[:, cut:] -= cut
            trained[:, cut : cut + 2] = False
            rollout_of = torch.where(torch.arange(T) < cut, 0, 1)[None].expand(B, T) + 2 * torch.arange(B)[:, None]
            adv = torch.randn(2 * B, generator=g)[rollout_of]  # [B, T]: each rollout its own advantage
            segment = torch.where(trained, rollout_of, -1)
            rollout = rollout_of.clone()  # [B, T]: one id per position, the prompt's included
        else:
            adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
            segment = torch.where(trained, torch.arange(T)[None].expand(B, T) // TURN, -1)
            rollout = torch.arange(B)
        out.append(
            dict(
                ids=ids, trained=trained, adv=adv, pos=pos, segment=segment, rollout=rollout, group=torch.arange(B) // 2
            )
        )
    return out


# ---- the independent reference ----------------------------------------------------------------------------


@dataclass
class Step:
    report: Optional[CreditReport]
    refusal: Optional[Refusal]
    reference: dict


def _twin_params(module: Policy) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): p.detach() for n, p in module.named_parameters()}


class Reference(Callback):
    """Listed after the audit: at each optimizer step, the float64 reference of the whole step (every micro-batch)."""

    def __init__(self, audit: CreditAuditCallback, mode: Mode) -> None:
        self.audit, self.mode = audit, mode
        self.twin = Policy(replace(mode, compile=None, checkpointing=None)).double()
        self.micro: list[dict] = []
        self.step: Optional[int] = None
        self.steps: list[Step] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.step != trainer.global_step:
            self.micro, self.step = [], trainer.global_step
        self.micro.append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        k = trainer.accumulate_grad_batches
        twin = self.twin
        with torch.no_grad():
            live = _twin_params(pl_module)
            for n, p in twin.named_parameters():
                p.copy_(live[n])
        leaves = [p for p in twin.parameters() if p.requires_grad]
        terms, names = [], []
        for j, mb in enumerate(self.micro):
            twin.last_rollout_batch = mb
            t = twin.credit_terms(None)
            terms.append(t.terms / k)
            names.append(self._names(t, j, len(self.micro)))
        with torch.enable_grad():
            parts: dict[str, torch.Tensor] = {}
            for t, nm in zip(terms, names):
                for key, mask in nm.items():
                    parts[key] = parts.get(key, 0.0) + t[mask].sum()
            g_full = torch.autograd.grad(sum(t.sum() for t in terms), leaves, retain_graph=True, allow_unused=True)
            g_full = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, g_full)]
            flat = torch.cat([g.reshape(-1) for g in g_full])
            gs = {}
            for key in sorted(parts):
                g = torch.autograd.grad(parts[key], leaves, retain_graph=True, allow_unused=True)
                gs[key] = torch.cat([(torch.zeros_like(x) if y is None else y).reshape(-1) for x, y in zip(leaves, g)])
        sq = float(flat @ flat)
        norms = {key: float(v.norm()) for key, v in gs.items()}
        total = math.fsum(norms.values())
        ref = dict(
            names=tuple(sorted(gs)),
            projected_share={key: float(v @ flat) / sq for key, v in gs.items()},
            norm_share={key: n / total for key, n in norms.items()},
            cancellation=total / math.sqrt(sq),
            full_grad_norm=math.sqrt(sq),
        )
        self.steps.append(
            Step(
                self.audit.last_report if self.audit.last_report_step == trainer.global_step else None,
                self.audit.last_refusal if self.audit.last_report is None else None,
                ref,
            )
        )

    def _names(self, t: CreditTerms, j: int, n: int) -> dict[str, torch.Tensor]:
        """The part name of every trained position, as the audit names them (independently derived)."""
        out = {}
        if self.mode.partition == "by_rollout":
            ids = t.rollout if t.rollout.dim() == 2 else t.rollout[:, None].expand_as(t.trained)  # [B, T]
            for r in sorted(set(ids[t.trained].tolist())):
                key = f"rollout_{r}" if n == 1 else f"mb{j}/rollout_{r}"  # row ids repeat in every micro-batch
                out[key] = (ids == r) & t.trained
        else:
            for s in sorted(set(t.segment[t.trained].tolist())):
                out[f"segment_{s}"] = (t.segment == s) & t.trained
        return out


def problems(step: Step, mode: Mode) -> list[str]:
    """What differs between the audit's logged reading of one step and the reference (empty: exact)."""
    r, ref, tol = step.report, step.reference, mode.tol
    if r is None:
        return [f"no reading: {step.refusal.render() if step.refusal is not None else 'none made'}"]
    out = []
    if mode.expect_engine is not None and r.engine != mode.expect_engine:
        out.append(f"engine {r.engine}, expected {mode.expect_engine}")
    if tuple(sorted(r.part_names)) != ref["names"]:
        return out + [f"parts {sorted(r.part_names)} against {list(ref['names'])}"]
    got = dict(zip(r.part_names, r.projected_share))
    err = max(abs(got[k] - ref["projected_share"][k]) for k in ref["names"])
    if not err <= tol:
        out.append(f"projected shares off by {err:.3g}")
    if r.readings != "projected":
        gn = dict(zip(r.part_names, r.norm_share))
        err_n = max(abs(gn[k] - ref["norm_share"][k]) for k in ref["names"])
        if not err_n <= tol:
            out.append(f"norm shares off by {err_n:.3g}")
        if not abs(r.cancellation - ref["cancellation"]) <= tol * ref["cancellation"]:
            out.append(f"cancellation {r.cancellation:.6g} against {ref['cancellation']:.6g}")
    if not abs(r.full_grad_norm - ref["full_grad_norm"]) <= max(tol, 1e-5) * ref["full_grad_norm"]:
        out.append(f"full_grad_norm {r.full_grad_norm:.8g} against {ref['full_grad_norm']:.8g}")
    if r.conservation_violated:
        out.append(f"conservation_error {r.conservation_error:.3g} over its floor {r.conservation_floor:.3g}")
    return out


# ---- a run ------------------------------------------------------------------------------------------------


@dataclass
class Run:
    audit: CreditAuditCallback
    reference: Reference
    params: dict[str, torch.Tensor]
    warned: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = [f"step {i}: {p}" for i, s in enumerate(self.reference.steps) for p in problems(s, self.reference.mode)]
        return out or ([] if self.reference.steps else ["no optimizer step was read"])


def _trainer(mode: Mode, callbacks) -> pl.Trainer:
    return pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        accumulate_grad_batches=mode.accumulate,
        precision=mode.precision,
        num_sanity_val_steps=0,
    )


def _data(mode: Mode):
    return torch.utils.data.DataLoader(micro_batches(mode, 2 * mode.accumulate), batch_size=None)


def train(mode: Mode, audited: bool = True) -> Run:
    pl.seed_everything(0, verbose=False)
    module = Policy(mode)
    audit = CreditAuditCallback(
        partition=mode.partition,
        engine=mode.engine,
        readings=mode.readings,
        capture=mode.capture,
        log_figure=False,
        log_table_every_n_steps=0,
    )
    ref = Reference(audit, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(mode, [audit, ref] if audited else []).fit(module, _data(mode))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return Run(audit, ref, {n: p.detach().clone() for n, p in module.named_parameters()}, said)


def check(mode: Mode) -> list[str]:
    """Every problem of ``mode``: readings against the reference, the fallback said once, training unchanged."""
    run = train(mode)
    out = run.problems()
    fallback = [w for w in run.warned if "falls back to a separate pass" in w]
    if mode.expect_fallback is None and fallback:
        out.append(f"unexpected fallback: {fallback[0]}")
    if mode.expect_fallback is not None and (len(fallback) != 1 or mode.expect_fallback not in fallback[0]):
        out.append(f"expected one fallback naming {mode.expect_fallback!r}, got {fallback}")
    if mode.bitwise:
        plain = train(mode, audited=False)
        moved = [n for n in run.params if not torch.equal(run.params[n], plain.params[n])]
        if moved:
            out.append(f"training changed by the audit: {moved[:3]}")
    return out


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_every_mode_is_exact_and_leaves_training_unchanged(mode):
    if mode.arch == "qwen2_lora":
        pytest.importorskip("peft")
    assert check(mode) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", COMPILED, ids=[m.name for m in COMPILED])
def test_compiled_modes_are_exact_and_leave_training_unchanged(mode):
    assert check(mode) == []


# ---- the faults the matrix must catch ---------------------------------------------------------------------


def test_reading_only_the_last_micro_batch_fails_the_matrix(monkeypatch):
    from lens_callbacks.credit.replay import StepReplay

    real = StepReplay.terms_fn

    def last_only(self, module, fn=None):
        self.micro = self.micro[-1:]
        return real(self, module, fn)

    monkeypatch.setattr(StepReplay, "terms_fn", last_only)
    found = check(replace(MODES[1], name="planted_last_micro_batch", bitwise=False))
    assert found and any("no reading" in p or "parts" in p for p in found), found


def test_skipping_the_compile_guard_fails_the_matrix(monkeypatch):
    import lens_callbacks.credit.engines.jvp as jvp
    import lens_callbacks.credit.primitives as primitives

    @contextlib.contextmanager
    def compiled_as_is():
        yield

    monkeypatch.setattr(primitives, "audit_passes", compiled_as_is)
    monkeypatch.setattr(jvp, "audit_passes", compiled_as_is)
    # aot_eager: the compiled graph runs sdpa's fused kernel, past the forward-mode rule
    mode = Mode(
        "planted_no_compile_guard",
        compile="aot_eager",
        partition="by_segment",
        readings="projected",
        engine="jvp",
        bitwise=False,
    )
    found = check(mode)
    assert found, "the forward-mode engine through a compiled module read as exact"


@pytest.mark.slow
def test_skipping_the_compile_guard_fails_the_matrix_under_inductor(monkeypatch):
    import lens_callbacks.credit.primitives as primitives

    @contextlib.contextmanager
    def compiled_as_is():
        yield

    monkeypatch.setattr(primitives, "audit_passes", compiled_as_is)
    # inductor: functional_call and repeated autograd.grad through the compiled module give parts that do not add up
    mode = Mode(
        "planted_no_compile_guard_inductor",
        compile="inductor",
        partition="by_segment",
        engine="reference",
        bitwise=False,
    )
    found = check(mode)
    assert found, "the reference engine through an inductor-compiled module read as exact"


def test_terms_scaled_in_the_audit_only_fail_the_matrix(monkeypatch):
    from lens_callbacks.credit import primitives

    real = primitives.TermsCall.forward

    def scaled(self, batch):
        t = real(self, batch)
        return replace(t, terms=t.terms * 1.01)

    monkeypatch.setattr(primitives.TermsCall, "forward", scaled)
    found = check(replace(MODES[0], name="planted_scaled_terms", bitwise=False))
    assert any("full_grad_norm" in p for p in found), found
