"""``CreditAuditCallback(extras=ExtraReadings(update_shares=True))`` on the GRPO example with Adam.

Reference: per-rollout gradients at θ_before by a plain ``autograd.grad`` loop (taken at the hook,
before the step), dotted with ``θ_before − θ_after`` read after it, in numpy float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger

from lens_callbacks.callbacks import CreditAuditCallback, ExtraReadings
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3)


class _Memory(Logger):
    """Every scalar logged, as ``(step, name, value)``."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.extend((step, k, float(v)) for k, v in metrics.items())

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _fit(callbacks=(), steps=3, seed=0, module_kw=None, logger=False):
    pl.seed_everything(seed, verbose=False)
    m = GRPOModule(**{**SMALL, **(module_kw or {})})
    pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        log_every_n_steps=1,
    ).fit(m, AdditionDataModule(batch_size=2, data_seed=seed))
    return m


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


class _Reference(pl.Callback):
    """Placed after the audit: per-rollout gradients at θ_before, then the update shares they give."""

    def __init__(self, audit):
        self.audit = audit
        self.rows = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for p in pl_module.parameters() if p.requires_grad]
        with torch.enable_grad():
            terms = pl_module.credit_terms(None).terms  # [B, T]
            parts = []
            for k in range(terms.shape[0]):
                gs = torch.autograd.grad(terms[k].sum(), params, retain_graph=True, allow_unused=True)
                parts.append(
                    np.concatenate(
                        [
                            (torch.zeros_like(p) if g is None else g).double().flatten().numpy()
                            for p, g in zip(params, gs)
                        ]
                    )
                )
        self._parts = np.stack(parts)  # [B, |θ|]
        self._before = np.concatenate([p.detach().double().flatten().numpy() for p in params])
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = np.concatenate(
            [p.detach().double().flatten().numpy() for p in pl_module.parameters() if p.requires_grad]
        )
        dots = self._parts @ (self._before - after)  # [B]
        with np.errstate(invalid="ignore", divide="ignore"):  # a zero-gradient step reads NaN, as the callback does
            self.rows.append((self._step, dots / dots.sum(), dict(self.audit.last_values)))


def test_update_shares_match_a_naive_loop_and_are_logged_with_adam():
    audit = CreditAuditCallback(dtype="float64", extras=ExtraReadings(update_shares=True), log_table_every_n_steps=0)
    ref = _Reference(audit)
    mem = _Memory()
    _fit([audit, ref], steps=3, module_kw={"dtype": "float64", "dropout": 0.1, "optimizer": "adam"}, logger=mem)
    assert len(ref.rows) == 3
    checked = 0
    for step, expect, values in ref.rows:
        got = np.array([values[f"credit/update_share/rollout_{k}"] for k in range(len(expect))])
        if not np.all(np.isfinite(expect)):
            assert values["credit/update_undefined"] == 1.0
            continue
        assert np.max(np.abs(got - expect)) <= 1e-10
        assert abs(values["credit/update_share_sum"] - 1.0) <= 1e-10
        assert values["credit/update_conservation_error"] <= 1e-10
        assert values["credit/update_grad_cosine"] < 1.0 - 1e-6  # Adam's step is not along g
        checked += 1
    assert checked >= 2
    logged = {(s, k) for s, k, _ in mem.rows}
    for step, _, _ in ref.rows:
        assert (step, "credit/update_share_sum") in logged and (step, "credit/update_share/rollout_0") in logged


def test_training_is_bitwise_unchanged_with_update_shares_and_dropout_on():
    kw = {"dropout": 0.2, "optimizer": "adam", "dtype": "float64"}
    plain = _fit([], steps=4, seed=3, module_kw=kw)
    rng_plain = torch.get_rng_state()
    audit = CreditAuditCallback(dtype="float64", extras=ExtraReadings(update_shares=True), log_table_every_n_steps=0)
    audited = _fit([audit], steps=4, seed=3, module_kw=kw)
    rng_audited = torch.get_rng_state()
    a, b = _params(plain), _params(audited)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(rng_plain, rng_audited)
    assert "credit/update_share_sum" in audit.last_values and audit._update_before is None
    init = _params(GRPOModule(**SMALL, **kw))
    assert any(not torch.equal(a[n], init[n]) for n in a)


def test_off_by_default_and_skipped_steps_copy_nothing():
    audit = CreditAuditCallback(dtype="float64", every_n_steps=2)
    _fit([audit], steps=2, module_kw={"dtype": "float64"})
    assert audit.update_shares is False and not any("update_share" in k for k in audit.last_values)

    class _Spy(pl.Callback):
        seen = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.seen.append((trainer.global_step, audit2._update_before is not None))

    audit2 = CreditAuditCallback(
        dtype="float64", every_n_steps=2, extras=ExtraReadings(update_shares=True), log_table_every_n_steps=0
    )
    spy = _Spy()
    _fit([audit2, spy], steps=3, module_kw={"dtype": "float64"})
    assert spy.seen == [(0, True), (1, False), (2, True)]


class _Fused(torch.autograd.Function):
    """A fused kernel with a backward and no forward-mode rule (as flash-attention-2 or a custom op)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2)


class _FusedAttention(pl.LightningModule):
    """An op without a forward-mode derivative, so update shares must be refused, not crash."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(7, 4, generator=g))
        self.out = torch.nn.Parameter(torch.randn(4, 7, generator=g))

    def credit_terms(self, batch):
        from lens_callbacks.credit import CreditTerms

        tokens, adv = batch  # [B, T+1], [B]
        x = self.emb[tokens[:, :-1]][:, None]  # [B, 1, T, 4]
        h = _Fused.apply(torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True))[:, 0]  # [B, T, 4]
        lp = torch.log_softmax(h @ self.out, -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T]
        terms = -adv[:, None] * lp / lp.numel()  # [B, T]
        B = tokens.shape[0]
        return CreditTerms(
            terms, torch.ones_like(terms, dtype=torch.bool), torch.arange(B), torch.zeros(B, dtype=torch.long)
        )

    def training_step(self, batch, batch_idx):
        return self.credit_terms(batch).terms.sum()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randint(0, 7, (4, 5), generator=g), torch.tensor([1.0, -1.0, 0.5, -0.5])) for _ in range(2)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def test_a_module_without_forward_derivatives_gets_a_refusal_and_trains_on():
    audit = CreditAuditCallback(extras=ExtraReadings(update_shares=True), log_table_every_n_steps=0)
    m = _FusedAttention()
    with pytest.warns(
        RuntimeWarning, match=r"update shares at step 0 declined: REFUSED \(update_share\): ForwardADUnsupportedError"
    ):
        pl.Trainer(
            max_steps=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[audit],
        ).fit(m)
    assert m.trainer.global_step == 2
    assert audit.last_report is not None and audit.last_report.ok  # the gradient audit itself still reads
    assert not any("update_share" in k for k in audit.last_values)


def test_update_shares_must_be_a_bool():
    with pytest.raises(ValueError, match="`update_shares` must be True or False, got 'yes'"):
        ExtraReadings(update_shares="yes")


def test_update_shares_of_a_stable_partition_join_the_run_ledger():
    """With a stable-name primary partition the ledger's ``update`` book is the sum of the logged update shares."""
    log = _Memory()
    cb = CreditAuditCallback(partition="by_advantage_sign", extras=ExtraReadings(update_shares=True), dtype="float64")
    _fit([cb], steps=3, logger=log)
    per_step = {}
    for step, name, value in log.rows:
        if name.startswith("credit/update_share/"):
            per_step.setdefault(name.rsplit("/", 1)[1], {})[step] = value
    assert per_step, "no update share was logged"
    totals = cb.step_readings.ledger.totals("update", "by_advantage_sign")
    for part, steps in per_step.items():
        finite = [v for v in steps.values() if np.isfinite(v)]
        assert totals[part] == pytest.approx(sum(finite), abs=1e-12)
    # The ledger's own scalars carry the same totals.
    last = {name: value for _, name, value in log.rows if name.startswith("credit/ledger/update/")}
    for part, total in totals.items():
        assert last[f"credit/ledger/update/by_advantage_sign/{part}"] == pytest.approx(total, abs=1e-12)
