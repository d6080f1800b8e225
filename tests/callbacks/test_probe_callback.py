"""``ProbeCreditCallback`` on the GRPO example with a probe: against a plain reference, read-only, resumable.

Reference: at the hook a spy takes per-rollout gradients of ``credit_terms`` and ``∇L_probe`` (eval mode)
by a plain ``autograd.grad`` loop on the live module and the optimizer's learning rate; after the step it
evaluates the probe again. Nothing of the callback's code is used to make the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger

from lens_callbacks import ProbeCreditCallback
from lens_callbacks.credit.readings.probe import ProbeCreditReport
from lens_callbacks.examples.grpo import AdditionDataModule
from lens_callbacks.examples.grpo.probe import GRPOProbeModule
from lens_callbacks.refusal import Refusal

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3, n_probe=4)
F64 = dict(dtype="float64")


class _Memory(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.extend((step, k, float(v)) for k, v in metrics.items())


def _fit(callbacks=(), steps=3, seed=0, module_kw=None, module_cls=GRPOProbeModule, logger=False, ckpt=None, **kw):
    pl.seed_everything(seed, verbose=False)
    m = module_cls(**{**SMALL, **(module_kw or {})})
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        log_every_n_steps=1,
        **kw,
    )
    trainer.fit(m, AdditionDataModule(batch_size=2, data_seed=seed), ckpt_path=ckpt)
    return m


def _flat_grad(loss, params):
    gs = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).detach().double().reshape(-1) for p, g in zip(params, gs)]
    )


class _Spy(pl.Callback):
    """Per-rollout gradients and ``g_probe`` by plain autograd at the hook; the probe losses after the step."""

    def __init__(self, probe_cb):
        self.probe_cb, self.checked = probe_cb, []

    def _probe_eval(self, m, batch, grad):
        flags = [(mod, mod.training) for mod in m.modules()]
        m.eval()
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                return m.probe_loss(batch)
        finally:
            for mod, was in flags:
                mod.training = was

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for p in pl_module.parameters() if p.requires_grad]
        with torch.enable_grad():
            terms = pl_module.credit_terms(None).terms
            rows = [_flat_grad(terms[k].sum(), params) for k in range(terms.shape[0])]
            probes = {}
            for name, batch in pl_module.probe_batches().items():
                loss = self._probe_eval(pl_module, batch, True)
                probes[name] = (float(loss.detach()), _flat_grad(loss, params))
        group = optimizer.param_groups[0]
        lr = group["lr"]
        if isinstance(optimizer, torch.optim.Adam):  # D by hand from the state before the step (no weight decay)
            assert group["weight_decay"] == 0 and not group["amsgrad"]
            (b1, b2), eps, d = group["betas"], group["eps"], []
            for p in params:
                st = optimizer.state.get(p, {})
                t = int(st["step"]) + 1 if "step" in st else 1
                v = st["exp_avg_sq"] * b2 if "exp_avg_sq" in st else torch.zeros_like(p)
                v = (v + (1 - b2) * p.grad.detach() ** 2) / (1 - b2**t)
                d.append((lr * (1 - b1) / ((1 - b1**t) * (v.sqrt() + eps))).double().reshape(-1))
            lr = torch.cat(d)  # [|θ|]
        self.ref = (lr, rows, probes)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        lr, rows, probes = self.ref
        for name, (before, gp) in probes.items():
            rep = self.probe_cb.last_reports[name]
            assert isinstance(rep, ProbeCreditReport) and rep.step == trainer.global_step - 1
            for k, g in enumerate(rows):
                want = -float((lr * g) @ gp)
                assert rep.contribution[k] == pytest.approx(want, rel=1e-9, abs=1e-14)
            after = float(self._probe_eval(pl_module, pl_module.probe_batches()[name], False))
            assert rep.loss_before == pytest.approx(before, rel=1e-13)
            assert rep.actual == pytest.approx(after - before, rel=1e-9, abs=1e-15)
            assert rep.update_match < 1e-10
            self.checked.append(name)


def test_sgd_readings_equal_a_plain_reference_loop():
    cb = ProbeCreditCallback(dtype="float64", log_table_every_n_steps=1)
    spy = _Spy(cb)
    log = _Memory()
    _fit([cb, spy], steps=3, module_kw={**F64, "optimizer": "sgd", "lr": 0.5}, logger=log)
    assert sorted(set(spy.checked)) == ["carry", "no_carry"] and len(spy.checked) == 6
    names = {k for _, k, _ in log.rows}
    for key in ("predicted", "actual", "first_order_gap", "alignment", "split/by_advantage_sign/positive", "refused"):
        assert f"probe/carry/{key}" in names
    rep = cb.last_reports["carry"]
    assert rep.carried == 0.0 and rep.parts_gap < 1e-12
    assert math.fsum(rep.split("by_advantage_sign").values()) == pytest.approx(rep.parts_sum, rel=1e-12, abs=1e-16)
    assert cb.n_readings == 6 and cb.n_refusals == 0


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_prediction_is_the_applied_update(optimizer):
    cb = ProbeCreditCallback(dtype="float64")
    _fit([cb], steps=3, module_kw={**F64, "optimizer": optimizer, "lr": 1e-2, "weight_decay": 0.1})
    for name in ("carry", "no_carry"):
        rep = cb.last_reports[name]
        # ⟨θ_after − θ_before, g_probe⟩ against −⟨D ⊙ .grad, g_probe⟩ + carried, and the parts through D.
        assert rep.update_match < 1e-10 and rep.parts_gap < 1e-9
        assert rep.carried != 0.0  # first moment of earlier steps and weight decay


def test_an_unknown_optimizer_is_refused_by_name_and_training_goes_on():
    class RMS(GRPOProbeModule):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    cb = ProbeCreditCallback()
    log = _Memory()
    with pytest.warns(RuntimeWarning, match="RMSprop"):
        m = _fit([cb], steps=2, module_cls=RMS, logger=log)
    assert m.trainer.global_step == 2
    for name in ("carry", "no_carry"):
        rep = cb.last_reports[name]
        assert isinstance(rep, Refusal) and rep.condition == "optimizer"
        assert [(s, v) for s, k, v in log.rows if k == f"probe/{name}/refused"] == [(0, 1.0), (1, 1.0)]


def test_gradient_clipping_is_refused():
    cb = ProbeCreditCallback()
    with pytest.warns(RuntimeWarning, match="gradient_clip_val"):
        _fit([cb], steps=1, gradient_clip_val=1.0)
    assert all(isinstance(r, Refusal) and r.condition == "gradient_clip_val" for r in cb.last_reports.values())


class _Params(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["separate", "training_step"])
def test_training_with_the_callback_is_bitwise_training_without(capture):
    kw = dict(dropout=0.1, optimizer="adam", lr=3e-3)
    plain = _Params()
    a = _fit([plain], steps=20, module_kw=kw)
    watched = _Params()
    cb = ProbeCreditCallback(probe_mode="train", capture=capture)  # the probe's dropout masks: a forked stream
    b = _fit([cb, watched], steps=20, module_kw=kw)
    assert cb.n_readings == 40 and cb.n_ride_along == (40 if capture == "training_step" else 0)
    assert plain.losses == watched.losses
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_resume_continues_the_readings(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = {**F64, "optimizer": "adam", "lr": 1e-2}
    straight = ProbeCreditCallback(dtype="float64")
    _fit([straight], steps=4, module_kw=kw)

    first = ProbeCreditCallback(dtype="float64")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=2)
    _fit([first, ckpt], steps=2, module_kw=kw)
    resumed = ProbeCreditCallback(dtype="float64")
    _fit([resumed], steps=4, module_kw=kw, ckpt=str(tmp_path / "last.ckpt"))
    assert resumed.n_readings == straight.n_readings == 8
    assert resumed.history == straight.history  # the checkpoint's readings, continued bit for bit
    # The epoch means (logged when fit stops) hold the checkpoint's readings and the resumed ones.
    assert resumed.last_epoch_values["probe/carry/epoch/readings"] == 4.0
    assert resumed.last_epoch_values == straight.last_epoch_values


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_reading_is_of_the_global_step(tmp_path):
    """2 ranks (gloo): every rank holds the global reading, equal to one process over both ranks' batches."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=str(here.parents[1]), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, str(here / "_probe_distributed_worker.py"), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    sys.path.insert(0, str(here))
    import _distributed_worker as base
    import _probe_distributed_worker as worker

    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False)["rows"] for i in range(worker.W)]
    assert [row["step"] for row in ranks[0]] == list(range(worker.STEPS))
    for a, b in zip(*ranks):
        assert a["contribution"] == b["contribution"] and a["loss_after"] == b["loss_after"]
    for row in ranks[0]:
        plain = worker.ProbePolicy(torch.float64)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(row["before"][n])
        params = list(plain.parameters())
        # The global step: each rank's terms averaged (DDP's mean), the probe the rank mean.
        parts = [plain.credit_terms(base.make_batch(rk, row["step"])).terms / worker.W for rk in range(worker.W)]
        probe = sum(plain.probe_loss(worker.probe_batch(rk)) for rk in range(worker.W)) / worker.W
        gp = _flat_grad(probe, params)
        names, want = [], []
        for rk, terms in enumerate(parts):
            for k in range(terms.shape[0]):
                names.append(f"r{rk}/rollout_{k}")
                want.append(-0.1 * float(_flat_grad(terms[k].sum(), params) @ gp))
        assert row["part_names"] == tuple(names)
        for got, w in zip(row["contribution"], want):
            assert got == pytest.approx(w, rel=1e-10, abs=1e-15)
        assert row["loss_before"] == pytest.approx(float(probe), rel=1e-13)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(row["after"][n])
            after = sum(plain.probe_loss(worker.probe_batch(rk)) for rk in range(worker.W)) / worker.W
        assert row["loss_after"] == pytest.approx(float(after), rel=1e-13)
        assert row["update_match"] < 1e-10
        assert row["logged"]["probe/heldout/predicted"] == pytest.approx(math.fsum(want), rel=1e-10)


class _Texts(_Memory):
    """A logger whose experiment keeps every text it is handed, as TensorBoard's ``add_text`` would."""

    def __init__(self):
        super().__init__()
        self.texts = []

    @property
    def experiment(self):
        return self

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, global_step))


@pytest.mark.parametrize("every, want", [(0, [2]), (2, [0, 2]), (10, [0, 2])])
def test_log_table_every_n_steps_zero_means_only_the_last_as_in_the_credit_audit(every, want):
    # One meaning in every callback: 0 writes only the last reading's table, at the end of fit; the last
    # reading's table is written at fit end whatever the cadence skipped.
    cb = ProbeCreditCallback(dtype="float64", log_table_every_n_steps=every, split_by=[])
    log = _Texts()
    _fit([cb], steps=3, module_kw={**F64, "optimizer": "sgd", "lr": 0.5}, logger=log)
    steps = sorted({s for tag, s in log.texts if tag == "probe/carry/table"})
    assert steps == want, log.texts


class _CallsTerms(pl.Callback):
    """Another callback's own pass of ``credit_terms`` (with grad) before the probe callback reads the step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with torch.enable_grad():
            pl_module.credit_terms(None)


@pytest.mark.parametrize("optimizer, kw", [("sgd", {"lr": 0.5}), ("adam", {"lr": 1e-2})])
def test_riding_on_the_training_step_equals_a_plain_reference_loop(optimizer, kw):
    # The parts are read from the training step's own captures against D ⊙ g_probe; a callback listed
    # before this one that runs credit_terms itself does not count as the training step's call.
    cb = ProbeCreditCallback(dtype="float64", capture="training_step")
    spy = _Spy(cb)
    m = _fit([_CallsTerms(), cb, spy], steps=3, module_kw={**F64, "optimizer": optimizer, **kw})
    assert len(spy.checked) == 6 and cb.n_readings == cb.n_ride_along == 6
    for rep in cb.last_reports.values():
        assert rep.engine == "ghost+training_step" and rep.ride_fallback is None
        assert rep.parts_gap < 1e-12 and rep.update_match < 1e-10
    assert "credit_terms" not in vars(m)  # the module's own method is back


class _DoubledLoss(GRPOProbeModule):
    def training_step(self, batch, batch_idx):
        return 2.0 * super().training_step(batch, batch_idx)


def test_riding_falls_back_to_the_separate_pass_once_where_the_loss_is_not_the_terms():
    cb = ProbeCreditCallback(dtype="float64", capture="training_step")
    spy = _Spy(cb)
    with pytest.warns(RuntimeWarning, match="capture='training_step' falls back to a separate pass") as rec:
        _fit([cb, spy], steps=2, module_cls=_DoubledLoss, module_kw={**F64, "optimizer": "sgd", "lr": 0.5})
    assert sum("falls back" in str(w.message) for w in rec) == 1
    assert len(spy.checked) == 4 and cb.n_ride_along == 0  # every reading exact, by the separate pass
    for rep in cb.last_reports.values():
        assert "is not `terms.sum()`" in rep.ride_fallback and rep.engine != "ghost+training_step"


def test_a_credit_audit_and_probe_credit_ride_on_the_same_step():
    from lens_callbacks import CreditAuditCallback

    kw = {**F64, "optimizer": "adam", "lr": 1e-2}
    alone = ProbeCreditCallback(dtype="float64")
    audit_alone = CreditAuditCallback(dtype="float64", readings="projected")
    _fit([audit_alone, alone], steps=2, module_kw=kw)
    audit = CreditAuditCallback(dtype="float64", capture="training_step", readings="projected")
    probe = ProbeCreditCallback(dtype="float64", capture="training_step")
    m = _fit([audit, probe], steps=2, module_kw=kw)
    assert audit.n_ride_along == 2 and probe.n_ride_along == 4
    assert "credit_terms" not in vars(m)
    for name, rep in probe.last_reports.items():
        want = alone.last_reports[name]
        assert rep.contribution == pytest.approx(want.contribution, rel=1e-9, abs=1e-15)
        assert rep.actual == want.actual
    assert audit.last_report.projected_share == pytest.approx(audit_alone.last_report.projected_share, rel=1e-9)


def test_riding_captures_nothing_on_an_accumulated_step_which_is_refused_by_name(monkeypatch):
    import lens_callbacks.callbacks.probe as probe_cb

    started = []
    monkeypatch.setattr(probe_cb, "RideAlong", lambda module: started.append(module))  # any capture would show
    cb = ProbeCreditCallback(dtype="float64", capture="training_step")
    with pytest.warns(RuntimeWarning, match="accumulate_grad_batches") as rec:
        m = _fit([cb], steps=2, accumulate_grad_batches=2, module_kw={**F64, "optimizer": "sgd", "lr": 0.5})
    assert not any("falls back" in str(w.message) for w in rec)
    assert all(isinstance(r, Refusal) for r in cb.last_reports.values()) and cb.n_ride_along == 0
    assert started == [] and "credit_terms" not in vars(m)


class _Every(pl.Callback):
    """Every reading of one probe, as made (``last_reports`` keeps only the latest)."""

    def __init__(self, cb, name="carry"):
        self.cb, self.name, self.reports = cb, name, []

    def on_train_batch_end(self, *args):
        self.reports.append(self.cb.last_reports.get(self.name))


def test_riding_under_bf16_mixed_reads_what_the_separate_pass_reads_within_bf16():
    kw = {"optimizer": "adam", "lr": 1e-3}
    sep, ride = ProbeCreditCallback(), ProbeCreditCallback(capture="training_step")
    a, b = _Every(sep), _Every(ride)
    _fit([sep, a], steps=4, precision="bf16-mixed", module_kw=kw)
    _fit([ride, b], steps=4, precision="bf16-mixed", module_kw=kw)
    assert ride.n_ride_along == ride.n_readings == 8
    moved = 0
    for x, y in zip(a.reports, b.reports):
        assert y.engine == "ghost+training_step" and x.engine != y.engine
        if x.grad_norm == 0:  # every advantage zero: no part moved anything
            assert y.grad_norm == 0 and not any(y.contribution)
            continue
        moved += 1
        mass = math.fsum(abs(c) for c in x.contribution)
        assert max(abs(p - q) for p, q in zip(x.contribution, y.contribution)) < 2e-2 * mass  # bf16's rounding
        assert y.parts_gap < 1e-2 and y.actual == x.actual
    assert moved >= 2


class _Touch(pl.Callback):
    """Changes nothing's value but bumps every parameter's version counter, before each training step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(1.0)


class _NewProbes(GRPOProbeModule):
    """Probe batches that change every step (a rotating probe set), fixed within a step."""

    shift = 0

    def on_train_batch_start(self, batch, batch_idx):
        self.shift = batch_idx + 1

    def probe_batches(self):
        return {name: (pairs + self.shift) % 10 for name, pairs in super().probe_batches().items()}


@pytest.mark.parametrize("capture", ["separate", "training_step"])
def test_the_forward_after_a_read_step_is_the_next_readings_probe_pass(capture):
    cb = ProbeCreditCallback(dtype="float64", capture=capture)
    spy = _Spy(cb)  # every reading against its own probe evaluations at the hook, by plain autograd
    every = _Every(cb)
    kw = {**F64, "optimizer": "adam", "lr": 1e-2}
    _fit([cb, spy, every], steps=4, module_kw=kw)
    assert len(spy.checked) == 8 and cb.n_probe_reused == 6  # two probes, every reading after the first
    off = ProbeCreditCallback(dtype="float64", capture=capture, reuse_probe_pass=False)
    every_off = _Every(off)
    _fit([off, every_off], steps=4, module_kw=kw)
    assert off.n_probe_reused == 0
    for x, y in zip(every.reports, every_off.reports):  # the same parameters, batch and stream: the same numbers
        assert x.contribution == y.contribution and x.loss_before == y.loss_before and x.actual == y.actual


@pytest.mark.parametrize(
    "callbacks, module_cls, every_n_steps",
    [([_Touch()], GRPOProbeModule, 1), ([], _NewProbes, 1), ([], GRPOProbeModule, 2)],
    ids=["parameters-touched", "probe-batch-changed", "every-other-step"],
)
def test_the_probe_pass_is_not_reused_where_anything_changed(callbacks, module_cls, every_n_steps):
    cb = ProbeCreditCallback(dtype="float64", every_n_steps=every_n_steps)
    spy = [_Spy(cb)] if every_n_steps == 1 else []  # the spy checks a reading on every step
    _fit([*callbacks, cb, *spy], steps=4, module_cls=module_cls, module_kw={**F64, "optimizer": "sgd", "lr": 0.5})
    assert cb.n_probe_reused == 0 and cb.n_readings == 8 // every_n_steps and cb.n_refusals == 0
    assert all(len(s.checked) == 8 for s in spy)
    assert cb._ahead == {}  # nothing held past the end of fit


class _Scratch(pl.Callback):
    """The buffer the probe callback holds at each step's start: its storages, or None."""

    def __init__(self, probe_cb):
        self.probe_cb, self.seen = probe_cb, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        held = self.probe_cb._scratch
        self.seen.append(None if held is None else [b.data_ptr() for b in held])


@pytest.mark.parametrize(
    "capture, module_kw, every_n_steps",
    [
        ("training_step", F64, 1),
        ("separate", {}, 1),  # float32 parameters read in float64: θ_before in clones, v in the buffer
        ("separate", F64, 2),
    ],
    ids=["every-step-riding", "audit-dtype-not-the-parameters", "every-other-step"],
)
def test_the_scratch_buffer_is_kept_for_the_next_reading_and_changes_no_number(capture, module_kw, every_n_steps):
    kw = {**module_kw, "optimizer": "adam", "lr": 1e-2}
    cb = ProbeCreditCallback(dtype="float64", capture=capture, every_n_steps=every_n_steps)
    # every reading of a float64 module against plain autograd (a float32 one steps in float32: its D too)
    spy = [_Spy(cb)] if every_n_steps == 1 and module_kw else []
    held, every = _Scratch(cb), _Every(cb)
    _fit([cb, held, every, *spy], steps=4, module_kw=kw)
    off = ProbeCreditCallback(dtype="float64", capture=capture, every_n_steps=every_n_steps, keep_scratch=False)
    held_off, every_off = _Scratch(off), _Every(off)
    _fit([off, held_off, every_off], steps=4, module_kw=kw)
    assert cb.n_readings == off.n_readings == 8 // every_n_steps and cb.n_refusals == off.n_refusals == 0
    assert all(len(s.checked) == 8 for s in spy)
    assert all(math.isfinite(r.actual) and r.update_match < 1e-5 for r in every.reports)
    if every_n_steps == 1:  # the same storages from the second step on
        assert held.seen[0] is None and all(s is not None for s in held.seen[1:])
        assert held.seen[1] == held.seen[2] == held.seen[3]
    else:
        assert held.seen == [None] * 4  # nothing held through a step that is not read
    assert held_off.seen == [None] * 4 and cb._scratch is None and off._scratch is None  # nothing past fit
    for x, y in zip(every.reports, every_off.reports):  # bit for bit
        assert x.contribution == y.contribution and x.actual == y.actual and x.applied == y.applied
    with pytest.raises(ValueError, match="`keep_scratch` must be a bool, got 'yes'"):
        ProbeCreditCallback(keep_scratch="yes")
