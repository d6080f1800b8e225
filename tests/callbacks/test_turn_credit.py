"""Which turn got the credit, from a Trainer, on stock transformers models with their default ``sdpa`` attention.

``CreditAuditCallback(partition="by_turn", readings="projected")`` on a Llama and a Qwen2 (tied head), each
built with transformers' default attention: the forward-mode engine reads every turn in one tangent pass —
separately (after its own forward and backward) and riding along (the tangent pass alone, along the step's
``.grad``). Reference: the reference engine (one backward per turn) on the same module at the same
parameters, float64, with transformers' two float32 spots (RMSNorm) patched to float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.credit import CreditTerms, disintegrate

V, T, B, TURNS = 48, 12, 3, 3
TOL = 1e-12


@pytest.fixture
def rmsnorm_float64(monkeypatch):
    """transformers' RMSNorm computes in float32 even on float64 weights: patched to the input's dtype."""
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.qwen2 import modeling_qwen2 as mq

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_forward)
    monkeypatch.setattr(mq.Qwen2RMSNorm, "forward", rms_forward)


def _stock(arch: str) -> nn.Module:
    import transformers as tf

    kw = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    cfg = tf.LlamaConfig(**kw) if arch == "llama" else tf.Qwen2Config(**kw, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = (tf.LlamaForCausalLM if arch == "llama" else tf.Qwen2ForCausalLM)(cfg).double()
    assert net.config._attn_implementation == "sdpa"  # transformers' default: nothing set by us
    return net


class TurnPolicy(pl.LightningModule):
    """Each row an episode of three turns; every turn trained, each its own part (``row/turn``)."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        self.net = _stock(arch)
        self.cached = None

    def credit_terms(self, batch=None) -> CreditTerms:
        ids, adv = self.cached
        lp = torch.log_softmax(self.net(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        trained = torch.ones(B, T, dtype=torch.bool)
        trained[:, 0] = False
        per_turn = T // TURNS
        segment = torch.arange(B)[:, None] * TURNS + torch.arange(T)[None] // per_turn  # [B, T]
        names = tuple(f"row{k}/turn{j}" for k in range(B) for j in range(TURNS))
        terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))
        return CreditTerms(
            terms, trained, torch.arange(B), torch.zeros(B, dtype=torch.long), segment=segment, segment_names=names
        )

    def training_step(self, batch, batch_idx):
        self.cached = batch
        return self.credit_terms().terms.sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _Reference(Callback):
    def __init__(self, audit):
        self.audit, self.pairs = audit, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ref = disintegrate(pl_module, None, "by_turn", dtype="float64", engine="reference")
        self.pairs.append((self.audit.last_report, ref))


def _data():
    out = []
    for j in range(2):
        g = torch.Generator().manual_seed(j)
        out.append((torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g, dtype=torch.float64)))
    return torch.utils.data.DataLoader(out, batch_size=None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("capture, engine", [("separate", "jvp"), ("training_step", "jvp+grad")])
def test_turns_of_a_stock_sdpa_model_from_a_trainer(arch, capture, engine, rmsnorm_float64):
    audit = CreditAuditCallback(
        partition="by_turn",
        readings="projected",
        capture=capture,
        dtype="float64",
        log_figure=False,
        log_table_every_n_steps=0,
    )
    ref = _Reference(audit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback, no refusal
        pl.Trainer(
            max_steps=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[audit, ref],
        ).fit(TurnPolicy(arch), _data())
    assert len(ref.pairs) == 2
    for got, want in ref.pairs:
        assert got is not None and got.engine == engine, got
        assert got.part_names == want.part_names and len(got.part_names) == B * TURNS
        err = max(abs(a - b) for a, b in zip(got.projected_share, want.projected_share))
        assert err <= TOL, err
        assert got.full_grad_norm == pytest.approx(want.full_grad_norm, rel=1e-12)
        assert got.conservation_error <= 1e-12


def test_every_reading_of_parts_inside_rows_says_its_cost_at_setup():
    audit = CreditAuditCallback(partition="by_turn", log_figure=False, log_table_every_n_steps=0)
    with pytest.warns(RuntimeWarning, match="one backward pass per part"):
        pl.Trainer(
            max_steps=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[audit],
        ).fit(TurnPolicy("llama"), _data())
    assert audit.last_report.engine == "reference"
