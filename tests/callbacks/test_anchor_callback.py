"""AnchorProjectionCallback on a tiny LightningModule implementing credit_terms."""

import math

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lens_callbacks.callbacks.anchor import AnchorProjectionCallback
from lens_callbacks.credit import CreditTerms
from tests._spawn_exit import DestroyGroupAtExit

B, T, V = 6, 5, 3


class Tiny(LightningModule):
    """Batches are a function of the step (resume-safe); the loss is credit_terms(...).terms.sum()."""

    def __init__(self, dropout: float = 0.0, lr: float = 0.1, momentum: float = 0.9, fail_anchor: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, V))
        self.lr, self.momentum, self.fail_anchor = lr, momentum, fail_anchor
        self.last_batch = None
        self._in_step = False

    def make_batch(self, step):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(B, T, 4, generator=g)
        y = torch.randint(0, V, (B, T), generator=g)
        adv = torch.randn(B, generator=g)
        return {"x": x, "y": y, "adv": adv}

    def credit_terms(self, batch):
        if self.fail_anchor and not self._in_step:
            raise RuntimeError("no anchor here")
        b = batch if isinstance(batch, dict) else self.last_batch
        return CreditTerms(self._terms(b), torch.ones(B, T, dtype=torch.bool), torch.arange(B), torch.arange(B) // 2)

    def _terms(self, b):
        logp = torch.log_softmax(self.net(b["x"]), -1).gather(-1, b["y"][..., None])[..., 0]  # [B, T]
        return -b["adv"][:, None] * logp / (B * T)  # [B, T]

    def training_step(self, batch, batch_idx):
        self.last_batch = self.make_batch(self.global_step)
        self._in_step = True
        try:
            return self._terms(self.last_batch).sum()
        finally:
            self._in_step = False

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(1000, 1)), batch_size=1)


class Plain(Tiny):
    credit_terms = None  # a module without the interface


def _trainer(steps, callbacks=(), **kw):
    return Trainer(
        max_steps=steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kw,
    )


def _run(steps, cb=None, seed=0, model_kw=None, callbacks_around=None, **kw):
    seed_everything(seed, verbose=False)
    m = Tiny(**(model_kw or {}))
    cbs = list(callbacks_around) if callbacks_around is not None else ([cb] if cb is not None else [])
    _trainer(steps, cbs, **kw).fit(m)
    return m


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_off_is_bitwise_no_callback_with_dropout():
    ref = _run(30, None, model_kw={"dropout": 0.3})
    off = _run(30, AnchorProjectionCallback(mode="off", cadence=2, delay_K=2), model_kw={"dropout": 0.3})
    assert _same(ref, off)
    on = _run(30, AnchorProjectionCallback(mode="signed_ema", cadence=2, delay_K=2), model_kw={"dropout": 0.3})
    assert not _same(ref, on)  # the comparison can fail


class _RngProbe(Callback):
    def __init__(self, store):
        self.store = store

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.store.append(torch.get_rng_state())


def test_the_anchor_forward_leaves_the_global_rng_stream_alone():
    # With dropout on, the anchor's forward draws random numbers: they must come from a forked stream.
    before, after = [], []
    cb = AnchorProjectionCallback(mode="signed_ema", cadence=2, delay_K=1)
    _run(8, None, model_kw={"dropout": 0.3}, callbacks_around=(_RngProbe(before), cb, _RngProbe(after)))
    assert cb.m_anchor is not None and cb.last_refusal is None
    assert len(before) == len(after) == 8
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_projected_below_n0_equals_signed_ema_bitwise():
    # snapshots at 0,5,10,15 become visible at 5,10,15 (3 fires) within 18 steps: n0 = 4 is never reached
    a = _run(18, AnchorProjectionCallback(mode="signed_ema", cadence=5, delay_K=5))
    cb = AnchorProjectionCallback(mode="projected", cadence=5, delay_K=5)
    b = _run(18, cb)
    assert _same(a, b)
    assert len(cb.readings) == 3 and not any(r.projected for r in cb.readings)


class _Probe(Callback):
    def __init__(self, store, key):
        self.store, self.key = store, key

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.store.setdefault(self.key, []).append(
            (
                trainer.global_step,
                {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()},
            )
        )


def test_signed_ema_merger_matches_an_independent_torch_func_reference():
    cad, K, alpha, beta = 3, 2, 0.25, 0.5
    store = {}
    cb = AnchorProjectionCallback(mode="signed_ema", cadence=cad, delay_K=K, alpha=alpha, beta_anc=beta)
    seed_everything(0, verbose=False)
    m = Tiny()
    _trainer(14, [_Probe(store, "before"), cb, _Probe(store, "after")]).fit(m)
    before, after = store["before"], store["after"]
    snaps, M = {}, None
    names = [n for n, _ in m.named_parameters()]
    for (step, params, G), (_, params_after, merged) in zip(before, after):
        # the anchor never writes the live weights
        assert all(torch.equal(params[n], params_after[n]) for n in names)
        if step % cad == 0:
            snaps[step] = params
        visible = [t for t in snaps if t + K <= step]
        if not visible:
            assert all(torch.equal(G[n], merged[n]) for n in names)
            continue
        anchor = snaps[max(visible)]
        batch = m.make_batch(step)

        def loss(p):
            return torch.func.functional_call(_Wrap(m), {"m." + k: v for k, v in p.items()}, (batch,)).sum()

        g_anchor = torch.func.grad(loss)(anchor)
        M = (
            {n: g_anchor[n].clone() for n in names}
            if M is None
            else {n: beta * M[n] + (1 - beta) * g_anchor[n] for n in names}
        )
        for n in names:
            want = alpha * G[n] + (1 - alpha) * G[n].abs() * torch.sign(M[n])
            torch.testing.assert_close(merged[n], want, rtol=1e-5, atol=1e-7)
    assert M is not None


class _Wrap(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, batch):
        return self.m.credit_terms(batch).terms


def _ckpt_run(tmp_path, cb_kw, total, cut):
    seed_everything(0, verbose=False)
    full_cb = AnchorProjectionCallback(**cb_kw)
    full = Tiny()
    _trainer(total, [full_cb]).fit(full)

    seed_everything(0, verbose=False)
    first = Tiny()
    tr = _trainer(cut, [AnchorProjectionCallback(**cb_kw)])
    tr.fit(first)
    path = tmp_path / "cut.ckpt"
    tr.save_checkpoint(path)
    seed_everything(1, verbose=False)  # resumed state must not depend on the global RNG
    resumed = Tiny()
    res_cb = AnchorProjectionCallback(**cb_kw)
    _trainer(total, [res_cb]).fit(resumed, ckpt_path=str(path))
    return full, resumed, full_cb, res_cb


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    kw = dict(mode="projected", cadence=2, delay_K=2, w_cap=5, n0=4, pool="global", null_quantile=0.5, r2_min=0.3)
    # Cut at 17: the fire of step 16 gated θ̂ ON, so step 17 merges with the restored τ, and the fire of
    # step 18 reads its retrospective factor and fire_cos from the restored previous fit.
    cut = 17
    full, resumed, full_cb, res_cb = _ckpt_run(tmp_path, kw, total=30, cut=cut)
    assert _same(full, resumed)
    on = {r.t_fast for r in full_cb.readings if r.gated_on_fraction > 0}
    assert cut - 1 in on and cut + 1 in on  # θ̂ was the anchor on both sides of the cut
    after = [r.to_dict() for r in full_cb.readings if r.t_fast > cut]
    assert after and after == [r.to_dict() for r in res_cb.readings]
    torch.testing.assert_close(full_cb.projector.ring.base_gram(), res_cb.projector.ring.base_gram(), rtol=0, atol=0)
    for n in full_cb.m_anchor:
        assert torch.equal(full_cb.m_anchor[n], res_cb.m_anchor[n])
    assert float(full_cb.weight_error.compute()) == float(res_cb.weight_error.compute())


def test_projected_mode_uses_theta_hat_and_logs_readings():
    cb = AnchorProjectionCallback(
        mode="projected", cadence=2, delay_K=4, w_cap=6, pool="global", null_quantile=0.5, r2_min=0.3
    )
    seed_everything(0, verbose=False)
    m = Tiny()
    tr = _trainer(30, [cb])
    tr.fit(m)
    proj = [r for r in cb.readings if r.projected]
    assert proj and all(r.t_tgt <= r.t_fast for r in proj)
    assert all(r.span_residual < 1e-9 for r in proj)
    for k in (
        "anchor/evr1",
        "anchor/r2",
        "anchor/weight_err_ratio",
        "anchor/comm_bytes",
        "anchor/disagree_fraction",
        "anchor/run/weight_err_ratio",
        "anchor/run/gated_on_fraction",
    ):
        assert k in tr.callback_metrics, k
    # weights up in fp32 plus one sign bit per parameter down (bytes rounded up per tensor)
    want = sum(p.numel() * 4 + math.ceil(p.numel() / 8) for p in m.parameters())
    assert float(tr.callback_metrics["anchor/comm_bytes"]) == want


def test_a_failing_anchor_leaves_training_as_without_it():
    ref = _run(12, None)
    cb = AnchorProjectionCallback(mode="signed_ema", cadence=2, delay_K=1)
    got = _run(12, cb, model_kw={"fail_anchor": True})
    assert _same(ref, got)
    assert cb.last_refusal is not None and "no anchor here" in cb.last_refusal.reason


def test_a_merger_failing_midway_leaves_every_grad_as_it_was(monkeypatch):
    import lens_callbacks.callbacks.anchor as anchor_cb

    calls = []
    real = anchor_cb.signed_ema

    def flaky(g, m, alpha):  # the second tensor of every step fails, after the first was merged
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("merger broke")
        return real(g, m, alpha)

    monkeypatch.setattr(anchor_cb, "signed_ema", flaky)
    store = {}
    cb = AnchorProjectionCallback(mode="signed_ema", cadence=2, delay_K=1)
    seed_everything(0, verbose=False)
    m = Tiny()
    _trainer(6, [_Probe(store, "before"), cb, _Probe(store, "after")]).fit(m)
    assert calls and cb.last_refusal is not None and cb.last_refusal.condition == "anchor_merge"
    for (_, p0, g0), (_, p1, g1) in zip(store["before"], store["after"]):
        assert all(torch.equal(g0[n], g1[n]) and torch.equal(p0[n], p1[n]) for n in g0)
    assert _same(m, _run(6, None))


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(cadence=0), "cadence"),
        (dict(cadence=-3), "cadence"),
        (dict(delay_K=-1), "delay_K"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=-0.1), "alpha"),
        (dict(w_cap=3, n0=4), "w_cap"),
        (dict(mode="on"), "mode"),
        (dict(beta_anc=1.0), "beta_anc"),
        (dict(kappa=0), "kappa"),
        (dict(p=0.0), "`p`"),
        (dict(pool="rows"), "pool"),
        (dict(h_safe=-1), "h_safe"),
    ],
)
def test_bad_configuration_is_a_clear_error(kw, word):
    with pytest.raises(ValueError, match=word):
        AnchorProjectionCallback(mode=kw.pop("mode", "projected"), **kw)


def test_module_without_credit_terms_is_an_error_at_setup():
    seed_everything(0, verbose=False)
    with pytest.raises(ValueError, match="credit_terms"):
        _trainer(2, [AnchorProjectionCallback(mode="signed_ema")]).fit(Plain())
    _trainer(2, [AnchorProjectionCallback(mode="off")]).fit(Plain())  # off needs nothing


def test_readings_and_the_coefficient_figure_reach_tensorboard(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = AnchorProjectionCallback(
        mode="projected", cadence=2, delay_K=2, w_cap=6, pool="global", figure_every_n_fires=2
    )
    seed_everything(0, verbose=False)
    tr = Trainer(
        max_steps=16,
        callbacks=[cb],
        logger=TensorBoardLogger(tmp_path, name="a"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    tr.fit(Tiny())
    ea = EventAccumulator(str(tmp_path / "a" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    ea.Reload()
    assert "anchor/coefficient_trajectory" in ea.Tags()["images"]
    assert {"anchor/evr1", "anchor/weight_err_ratio", "anchor/gated_on_fraction"} <= set(ea.Tags()["scalars"])
    logged = {e.step: e.value for e in ea.Scalars("anchor/evr1")}
    want = {r.t_fast: r.evr1 for r in cb.readings if r.projected}
    common = set(logged) & set(want)
    assert len(common) >= 3
    assert all(logged[s] == pytest.approx(want[s], rel=1e-6) for s in common)


class _RankTiny(Tiny):
    """A different batch on each rank: the anchor's gradient must still be the same on both."""

    def make_batch(self, step):
        return super().make_batch(step * 10 + self.global_rank)


class _SameOnRanks(Callback):
    def on_train_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, AnchorProjectionCallback))
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        m = torch.cat([x.reshape(-1) for x in cb.m_anchor.values()])
        ring = torch.cat([cb.projector.ring.base_gram().reshape(-1).float()])
        for x in (flat, m, ring):
            both = trainer.strategy.all_gather(x)
            if not torch.equal(both[0], both[1]):
                raise AssertionError("a rank diverged from the other")
        if not any(r.projected for r in cb.readings):
            raise AssertionError("no projected fire")


@pytest.mark.slow
def test_ddp_two_cpu_ranks_stay_identical():
    seed_everything(0, verbose=False)
    cb = AnchorProjectionCallback(mode="projected", cadence=2, delay_K=2, w_cap=6, pool="global")
    Trainer(
        max_steps=14,
        callbacks=[cb, _SameOnRanks(), DestroyGroupAtExit()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
    ).fit(_RankTiny())


class _AnchorProbe(Callback):
    """Runs after the anchor callback: records the anchor's weights, trust and gate it used this step."""

    def __init__(self, cb, store):
        self.cb, self.store = cb, store

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        a = self.cb._anchor
        self.store.append(
            None
            if a is None
            else (
                {n: x.clone() for n, x in a.items()},
                dict(self.cb._tau),
                dict(self.cb._gate),
                self.cb._projected_active,
            )
        )


def test_projected_merger_matches_a_reference_at_the_recorded_anchor():
    alpha, beta, kappa, p = 0.25, 0.5, 1.5, 0.4
    cb = AnchorProjectionCallback(
        mode="projected",
        cadence=2,
        delay_K=2,
        w_cap=6,
        pool="tensor",
        alpha=alpha,
        beta_anc=beta,
        kappa=kappa,
        p=p,
        null_quantile=0.5,
        r2_min=0.3,
        retro_gate=False,
    )
    store, used = {}, []
    seed_everything(0, verbose=False)
    m = Tiny()
    _trainer(24, [_Probe(store, "before"), cb, _AnchorProbe(cb, used), _Probe(store, "after")]).fit(m)
    names = [n for n, _ in m.named_parameters()]
    M, n_gated, snaps = None, 0, {}
    for (step, params, G), (_, _, merged), rec in zip(store["before"], store["after"], used):
        if step % 2 == 0:
            snaps[step] = params
        if rec is None:
            continue
        anchor, tau, gate, active = rec
        stale = snaps[max(t for t in snaps if t + 2 <= step)]
        for n in names:  # θ̂ where the gate is ON, else the raw stale snapshot
            assert torch.equal(anchor[n], stale[n]) != bool(active and gate[n])
        batch = m.make_batch(step)
        g_anchor = torch.func.grad(
            lambda q: torch.func.functional_call(_Wrap(m), {"m." + k: v for k, v in q.items()}, (batch,)).sum()
        )(anchor)
        M = (
            {n: g_anchor[n].clone() for n in names}
            if M is None
            else {n: beta * M[n] + (1 - beta) * g_anchor[n] for n in names}
        )
        for n in names:
            g, mm = G[n].double(), M[n].double()
            if active and gate[n]:
                q = np.quantile(mm.abs().numpy().ravel(), p, method="inverted_cdf")
                w = torch.from_numpy(np.clip(mm.abs().numpy() / (kappa * q), 0, 1))
                ae = alpha + (1 - alpha) * (1 - tau[n])
                want = ae * g + (1 - ae) * (w * g.abs() * torch.sign(mm) + (1 - w) * g)
                n_gated += 1
            else:
                want = alpha * g + (1 - alpha) * g.abs() * torch.sign(mm)
            torch.testing.assert_close(merged[n].double(), want, rtol=1e-5, atol=1e-7)
    assert n_gated > 0


class _FreezeAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, *a):
        if trainer.global_step == self.step:
            pl_module.net[0].weight.requires_grad_(False)


def test_a_fire_that_cannot_be_made_is_a_refusal_not_a_crash():
    cb = AnchorProjectionCallback(mode="projected", cadence=2, delay_K=2)
    seed_everything(0, verbose=False)
    m = Tiny()
    _trainer(12, [_FreezeAt(5), cb]).fit(m)  # the ring holds net.0.weight; later snapshots lack it
    assert cb.last_refusal is not None and cb.last_refusal.condition == "anchor_fire"
    assert "net.0.weight" in cb.last_refusal.reason
    assert all(torch.isfinite(p).all() for p in m.parameters())


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_grpo_anchor_yaml_wires_projected_mode(monkeypatch):
    import sys

    from lens_callbacks.cli import cli_main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lens-callbacks"])
    cli = cli_main(["--config", str(ROOT / "cli_configs" / "grpo_anchor.yaml")], run=False)
    cbs = [c for c in cli.trainer.callbacks if isinstance(c, AnchorProjectionCallback)]
    assert len(cbs) == 1 and cbs[0].mode == "projected"
    # the first projection (n0 snapshots visible) must fall inside the demo's steps
    first = (cbs[0].n0 - 1) * cbs[0].cadence + cbs[0].delay_K
    assert first < cli.trainer.max_steps


@pytest.mark.slow
def test_grpo_anchor_demo_projects_and_logs_to_tensorboard(tmp_path, run_cli):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_cli(
        "fit",
        "--config",
        ROOT / "cli_configs" / "grpo_anchor.yaml",
        "--trainer.max_steps=21",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        check=True,
    )
    ea = EventAccumulator(str(tmp_path / "grpo_anchor" / "version_0"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    proj = {e.step: e.value for e in ea.Scalars("anchor/projected")}
    assert proj[16] == 1.0 and proj[20] == 1.0  # snapshots 0, 4, 8, 12 visible at 16: the first projection
    for tag in (
        "anchor/evr1",
        "anchor/evr1_null",
        "anchor/r2",
        "anchor/weight_err_ratio",
        "anchor/vel_err_ratio",
        "anchor/coef_pred_error",
        "anchor/comm_bytes",
        "anchor/disagree_fraction",
    ):
        assert tag in ea.Tags()["scalars"], tag
    assert "anchor/coefficient_trajectory" in ea.Tags()["images"]
