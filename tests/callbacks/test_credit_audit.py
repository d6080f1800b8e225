"""CreditAuditCallback on the GRPO example: what it logs, that it changes nothing, and how it fails.

References: per-rollout gradients by a plain loop of ``torch.autograd.grad`` on the live parameters,
shares in numpy float64; TensorBoard events read back with tensorboard's own EventAccumulator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.credit import CreditTerms
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule
from lens_callbacks.refusal import Refusal
from tests._spawn_exit import DestroyGroupAtExit

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3)


def _trainer(callbacks=(), steps=3, logger=False, **kw):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        log_every_n_steps=1,
        **kw,
    )


def _fit(callbacks=(), steps=3, seed=0, module_kw=None, module_cls=GRPOModule, logger=False, **kw):
    pl.seed_everything(seed, verbose=False)
    m = module_cls(**{**SMALL, **(module_kw or {})})
    _trainer(callbacks, steps, logger, **kw).fit(m, AdditionDataModule(batch_size=2, data_seed=seed))
    return m


def _reference_shares(pl_module):
    """Per-rollout gradients by a plain loop; shares and cancellation in numpy float64."""
    params = [p for p in pl_module.parameters() if p.requires_grad]

    def flat(loss):
        gs = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
        return np.concatenate(
            [(torch.zeros_like(p) if g is None else g).detach().double().flatten().numpy() for p, g in zip(params, gs)]
        )

    with torch.enable_grad():
        terms = pl_module.credit_terms(None).terms  # [B, T]
        g_full = flat(terms.sum())
        parts = [flat(terms[k].sum()) for k in range(terms.shape[0])]
    full_sq = g_full @ g_full
    norms = np.array([np.linalg.norm(g) for g in parts])
    grad = np.concatenate([p.grad.detach().double().flatten().numpy() for p in params])
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero-gradient step reads NaN, as the audit does
        return {
            "projected_share": np.array([g @ g_full for g in parts]) / full_sq,
            "cancellation": norms.sum() / np.sqrt(full_sq),
            "grad_match": np.linalg.norm(g_full - grad) / np.sqrt(full_sq),
        }


class _Reference(pl.Callback):
    """Placed after the audit: records the audit's report beside the naive reference, per step."""

    def __init__(self, audit):
        self.audit = audit
        self.rows = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append(
            (trainer.global_step, self.audit.last_report, self.audit.last_report_step, _reference_shares(pl_module))
        )


def test_readings_match_a_naive_per_rollout_loop_float64():
    audit = CreditAuditCallback(dtype="float64")
    ref = _Reference(audit)
    _fit([audit, ref], steps=3, module_kw={"dtype": "float64", "dropout": 0.1})
    assert len(ref.rows) == 3
    defined = 0
    for step, report, report_step, want in ref.rows:
        assert report_step == step
        assert report.n_parts == 2 * SMALL["group_size"] and report.dtype == "float64"
        if not report.ok:  # every group had equal rewards: shares are undefined, and say so
            assert report.reason and np.isnan(report.projected_share).all()
            continue
        defined += 1
        np.testing.assert_allclose(report.projected_share, want["projected_share"], rtol=1e-9, atol=1e-12)
        assert report.cancellation == pytest.approx(want["cancellation"], rel=1e-9)
        assert report.grad_match == pytest.approx(want["grad_match"], abs=1e-12)
        assert report.grad_match < 1e-12  # the trainer's .grad is the audited gradient, dropout included
        assert report.conservation_error < 1e-13
        assert abs(report.share_sum - 1.0) < 1e-12
    assert defined >= 1


def test_tensorboard_holds_credit_scalars_text_and_figure(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    audit = CreditAuditCallback(log_table_every_n_steps=2, max_logged_parts=3, log_positional_parts=True)
    ref = _Reference(audit)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _fit([audit, ref], steps=4, seed=1, logger=logger)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in (
        "credit/cancellation",
        "credit/conservation_error",
        "credit/grad_match",
        "credit/share_sum",
        "credit/projected_share/rollout_0",
        "credit/norm_share/rollout_2",
        "credit/epoch/cancellation",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    assert "credit/projected_share/rollout_3" not in scalars  # capped at max_logged_parts
    # The i-th logged value is the i-th audit; compare with the naive reference (float32 audit).
    logged = [e.value for e in acc.Scalars("credit/projected_share/rollout_0")]
    canc = [e.value for e in acc.Scalars("credit/cancellation")]
    assert len(logged) == len(ref.rows) == 4
    for (_, report, _, want), v, c in zip(ref.rows, logged, canc):
        if report.ok:
            assert v == pytest.approx(want["projected_share"][0], abs=2e-5)
            assert c == pytest.approx(want["cancellation"], rel=1e-4)
        else:
            assert np.isnan(v)
    # Text tables: steps 0 and 2 by the cadence, step 3 as the last report at fit end.
    texts = acc.Tensors("credit/table/text_summary")
    assert [t.step for t in texts] == [0, 2, 3]
    body = texts[-1].tensor_proto.string_val[0].decode()
    assert body.startswith("```") and "credit by by_rollout (8 parts" in body and "conservation_error" in body
    assert audit.last_table.render() in body and audit.last_table.report is audit.last_report
    assert "credit/heatmap" in acc.Tags()["images"]
    assert (tmp_path / "tb" / "version_0" / "credit_last.txt").read_text().startswith("step 3\n")


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_parameters_are_bitwise_those_of_a_run_without_the_callback_with_dropout_on():
    kw = {"dropout": 0.2}
    plain = _fit([], steps=4, seed=3, module_kw=kw)
    rng_plain = torch.get_rng_state()
    audited = _fit([CreditAuditCallback(dtype="float64", keep_grads=True)], steps=4, seed=3, module_kw=kw)
    rng_audited = torch.get_rng_state()
    a, b = _params(plain), _params(audited)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(rng_plain, rng_audited)
    # The runs did train: the weights moved from their seeded initial values.
    init = _params(GRPOModule(**SMALL, **kw))
    assert any(not torch.equal(a[n], init[n]) for n in a)


class _GlobalDropout(pl.LightningModule):
    """Dropout straight from the global stream, no replay: only the audit's own RNG fork keeps it neutral."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(7, 6, generator=g))
        self.out = torch.nn.Parameter(torch.randn(6, 7, generator=g))
        self.drop = torch.nn.Dropout(0.3)

    def credit_terms(self, batch):
        tokens, adv = batch  # [B, T+1], [B]
        logp = torch.log_softmax(self.drop(self.emb[tokens[:, :-1]]) @ self.out, -1)  # [B, T, V]
        lp = logp.gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T]
        terms = -adv[:, None] * lp / lp.numel()  # [B, T]
        B = tokens.shape[0]
        return CreditTerms(terms, torch.ones_like(terms, dtype=torch.bool), torch.arange(B), torch.arange(B) // 2)

    def training_step(self, batch, batch_idx):
        return self.credit_terms(batch).terms.sum()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randint(0, 7, (4, 5), generator=g), torch.tensor([1.0, -1.0, 0.5, -0.5])) for _ in range(4)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_audit_leaves_the_global_random_stream_to_training():
    def run(callbacks):
        pl.seed_everything(5, verbose=False)
        m = _GlobalDropout()
        _trainer(callbacks, steps=3).fit(m)
        return _params(m), torch.get_rng_state()

    (a, rng_a), (b, rng_b) = run([]), run([CreditAuditCallback(dtype="float64", log_table_every_n_steps=0)])
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(rng_a, rng_b)


class _GradSnapshot(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {
            n: (p.grad.clone(), p.grad.data_ptr()) for n, p in pl_module.named_parameters() if p.grad is not None
        }


class _GradCheck(pl.Callback):
    def __init__(self, snap):
        self.snap, self.checked = snap, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        now = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        assert now.keys() == self.snap.grads.keys() and now
        for n, g in now.items():
            assert torch.equal(g, self.snap.grads[n][0]) and g.data_ptr() == self.snap.grads[n][1]
        self.checked += 1


def test_grad_is_unchanged_by_the_audit():
    snap = _GradSnapshot()
    check = _GradCheck(snap)
    _fit([snap, CreditAuditCallback(dtype="float64"), check], steps=2, module_kw={"dropout": 0.1})
    assert check.checked == 2


class _DoubledLoss(GRPOModule):
    """A module whose loss is NOT the sum of its terms: the audit must catch it through grad_match."""

    def training_step(self, batch, batch_idx):
        return 2.0 * super().training_step(batch, batch_idx)


def test_grad_match_catches_terms_that_do_not_add_up_to_the_loss():
    audit = CreditAuditCallback(dtype="float64")
    ref = _Reference(audit)
    _fit([audit, ref], steps=3, module_cls=_DoubledLoss, module_kw={"dtype": "float64"})
    matches = [r.grad_match for _, r, _, _ in ref.rows if r.ok]
    assert matches and all(m == pytest.approx(1.0, abs=1e-12) for m in matches)  # ||g - 2g|| / ||g||


class _NoCreditTerms(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        return self.layer(batch[0]).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_module_without_credit_terms_is_an_error_at_setup():
    m = _NoCreditTerms()
    with pytest.raises(TypeError, match="_NoCreditTerms.*credit_terms|credit_terms.*_NoCreditTerms"):
        _trainer([CreditAuditCallback()], steps=1).fit(m)
    assert m.steps_run == 0


def test_unknown_partition_name_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"'by_turnn'.*|.*by_rollout.*'by_turnn'"):
        CreditAuditCallback(partition="by_turnn")


def test_unimportable_partition_path_is_an_error_at_setup_before_any_step():
    pl.seed_everything(0, verbose=False)
    m = GRPOModule(**SMALL)
    calls = []
    m.training_step = lambda *a, **k: calls.append(1)  # would record any step that ran
    with pytest.raises(ValueError, match="no_such_module.by_turn"):
        _trainer([CreditAuditCallback(partition="no_such_module.by_turn")], steps=1).fit(
            m, AdditionDataModule(batch_size=2)
        )
    assert calls == []


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"every_n_steps": 0}, "`every_n_steps`.*0"),
        ({"dtype": "float8"}, "'float8'"),
        ({"max_logged_parts": -1}, "`max_logged_parts`"),
        ({"partition": 3}, r"`partition` must be one of .*by_rollout.*, got 3\."),
    ],
)
def test_config_errors_at_init(kw, needle):
    with pytest.raises(ValueError, match=needle):
        CreditAuditCallback(**kw)


class _FailsAtStep1(GRPOModule):
    """credit_terms fails for the audit (which passes the dataloader batch) at step 1 only."""

    def credit_terms(self, batch=None):
        if batch is not None and self.trainer.global_step == 1:
            raise ValueError("rollout 3 has no tokens")
        return super().credit_terms(batch)


class _Seen(pl.Callback):
    def __init__(self, audit):
        self.audit, self.rows = audit, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append((trainer.global_step, self.audit.last_report_step, self.audit.last_refusal))


def test_a_failed_reading_is_a_refusal_and_training_continues(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    audit = CreditAuditCallback()
    seen = _Seen(audit)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with pytest.warns(RuntimeWarning, match="step 1 declined.*rollout 3 has no tokens"):
        m = _fit([audit, seen], steps=3, module_cls=_FailsAtStep1, logger=logger)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    [text] = acc.Tensors("credit/refusal/text_summary")
    assert (
        text.step == 1
        and "REFUSED (credit_audit): ValueError: rollout 3 has no tokens" in text.tensor_proto.string_val[0].decode()
    )
    assert [(e.step, e.value) for e in acc.Scalars("credit/refused")] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    assert np.isnan(acc.Scalars("credit/cancellation")[1].value)
    assert m.trainer.global_step == 3
    assert audit.n_audits == 3 and audit.n_refusals == 1
    step, report_step, refusal = seen.rows[1]
    assert step == 1 and report_step == -1 and isinstance(refusal, Refusal) and "rollout 3" in refusal.reason
    assert seen.rows[2][1] == 2  # the next step is audited again


class _ConstantReward(GRPOModule):
    def sample_rollouts(self, pairs):
        rb, ro = super().sample_rollouts(pairs)
        rb.advantages = torch.zeros_like(rb.advantages)
        return rb, ro


def test_zero_gradient_step_is_undefined_not_a_crash():
    audit = CreditAuditCallback()
    _fit([audit], steps=2, module_cls=_ConstantReward)
    assert not audit.last_report.ok and "zero" in audit.last_report.reason
    assert audit.last_values["credit/undefined_fraction"] == 1.0


class _ZeroAtStep2(GRPOModule):
    def sample_rollouts(self, pairs):
        rb, ro = super().sample_rollouts(pairs)
        # Non-zero advantages except at step 2, whatever the sampled rewards were.
        rb.advantages = torch.linspace(-1, 1, rb.batch_size) * float(self.trainer.global_step != 2)
        return rb, ro


def test_last_report_file_adds_the_last_defined_reading_when_the_last_is_undefined(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    audit = CreditAuditCallback()
    ref = _Reference(audit)
    _fit([audit, ref], steps=3, seed=4, module_cls=_ZeroAtStep2, logger=logger)
    assert not audit.last_report.ok and ref.rows[1][1].ok
    text = (tmp_path / "tb" / "version_0" / "credit_last.txt").read_text()
    # The last defined reading comes first (its rows of shares), the undefined last step after it.
    assert text.startswith("step 1 (the last step whose shares are defined)\n")
    assert "rollout_" in text.split("step 2 (the last audited step)\n")[0]
    assert "UNDEFINED" in text.split("step 2 (the last audited step)\n")[1]


class _Steps(pl.Callback):
    def __init__(self, audit):
        self.audit, self.rows = audit, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append((trainer.global_step, self.audit.last_report_step))


def test_every_n_steps_logs_the_audited_steps_only(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    audit = CreditAuditCallback(every_n_steps=2)
    probe = _Steps(audit)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _fit([audit, probe], steps=5, logger=logger)
    assert probe.rows == [(0, 0), (1, 0), (2, 2), (3, 2), (4, 4)]
    assert audit.n_audits == 3
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("credit/conservation_error")] == [0, 2, 4]  # nothing stale in between


class _AsksForGrads(pl.Callback):
    """Another callback may switch keep_grads on in its own setup (as a conservation check does)."""

    def __init__(self, audit):
        self.audit = audit

    def setup(self, trainer, pl_module, stage):
        self.audit.keep_grads = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        g = self.audit.last_report.grads
        names = [n for n, p in pl_module.named_parameters() if p.requires_grad]
        assert list(g.names) == names
        for n, gf, gs in zip(g.names, g.g_full, g.parts_sum):
            ref = dict(pl_module.named_parameters())[n].grad
            torch.testing.assert_close(gf, ref, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(gs, ref, rtol=1e-5, atol=1e-7)
        self.seen = True


def test_keep_grads_set_by_another_callback():
    audit = CreditAuditCallback()
    other = _AsksForGrads(audit)
    _fit([audit, other], steps=2)
    assert other.seen


def test_partition_by_import_path_adds_up_the_per_rollout_shares():
    by_rollout = CreditAuditCallback(dtype="float64")
    by_group = CreditAuditCallback(partition="lens_callbacks.credit.inputs.partition.by_group", dtype="float64")
    probe = _Reference(by_rollout)
    rows = []

    class _Both(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rows.append((by_rollout.last_report, by_group.last_report))

    _fit([by_rollout, by_group, probe, _Both()], steps=2, module_kw={"dtype": "float64"})
    assert by_rollout.state_key != by_group.state_key
    G = SMALL["group_size"]
    for r, g in rows:
        assert g.part_names == ("group_0", "group_1")
        if r.ok:
            want = np.array(r.projected_share).reshape(-1, G).sum(1)
            np.testing.assert_allclose(g.projected_share, want, rtol=1e-9, atol=1e-12)


def test_state_dict_round_trip():
    audit = CreditAuditCallback(every_n_steps=1)
    _fit([audit], steps=3)
    sd = audit.state_dict()
    fresh = CreditAuditCallback()
    fresh.load_state_dict(sd)
    assert (fresh.n_audits, fresh.n_refusals, fresh.last_report_step) == (3, 0, 2)
    for name in audit.metric._defaults:
        assert torch.equal(getattr(fresh.metric, name), getattr(audit.metric, name))


def test_prints_last_report_and_tensorboard_line(tmp_path, capsys):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    audit = CreditAuditCallback(print_last_report=True)
    _fit([audit], steps=2, logger=logger)
    out = capsys.readouterr().out
    assert "credit audit, step 1\n" in out and audit.last_table.render() in out
    assert f"tensorboard --logdir {logger.log_dir}" in out


def test_without_a_logger_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    audit = CreditAuditCallback()
    _fit([audit], steps=1, default_root_dir=str(tmp_path))
    assert audit.last_report is not None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cap", [0, 1])
def test_small_part_caps(cap):
    audit = CreditAuditCallback(max_logged_parts=cap, dtype="float64", log_positional_parts=True)
    _fit([audit], steps=2, seed=1, module_kw={"dtype": "float64"})
    logged = {k for k in audit.last_values if k.startswith("credit/projected_share/")}
    assert logged == ({"credit/projected_share/rollout_0"} if cap else set())
    if cap and audit.last_report.ok:
        assert audit.last_values["credit/projected_share/rollout_0"] == pytest.approx(
            audit.last_report.projected_share[0], rel=1e-12
        )


class _DDPChecks(pl.Callback):
    """Runs inside each ddp_spawn worker, after the audit: asserts there (a failure fails the spawn)."""

    def __init__(self, audit):
        self.audit = audit

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        r = self.audit.last_report
        assert r is not None and self.audit.last_report_step == trainer.global_step
        # The global step: every rank's parts, named by rank, against the averaged .grad.
        assert {n.split("/")[0] for n in r.part_names} == {"r0", "r1"}
        assert r.grad_match is not None and r.grad_match < 1e-6  # float32 rounding
        assert self.audit.last_values["credit/grad_match"] == r.grad_match  # logged
        if r.ok:
            assert abs(r.share_sum - 1.0) < 1e-6 and r.conservation_error < 1e-6

    def on_train_end(self, trainer, pl_module):
        assert self.audit.n_audits == trainer.global_step == 3
        assert "credit/epoch/cancellation" in self.audit.last_epoch_values  # synchronised on every rank
        assert "credit/grad_match" in self.audit.last_values


@pytest.mark.slow
def test_ddp_two_cpu_ranks_each_audit_their_batch(tmp_path):
    audit = CreditAuditCallback(max_logged_parts=2)
    pl.seed_everything(0, verbose=False)
    m = GRPOModule(**SMALL)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=TensorBoardLogger(str(tmp_path), version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[audit, _DDPChecks(audit), DestroyGroupAtExit()],
    )
    trainer.fit(m, AdditionDataModule(batch_size=2))  # the workers assert; here we read what rank 0 wrote
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert len(acc.Scalars("credit/cancellation")) == 3 and "credit/epoch/share_sum" in acc.Tags()["scalars"]
    assert [e.value < 1e-6 for e in acc.Scalars("credit/grad_match")] == [True] * 3  # the global grad_match, logged
    assert [t.step for t in acc.Tensors("credit/table/text_summary")] == [0, 2]  # rank 0 wrote it once per table
    assert (tmp_path / "lightning_logs" / "version_0" / "credit_last.txt").exists()


def test_state_survives_a_checkpoint_resume(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = CreditAuditCallback()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=2)
    pl.seed_everything(0, verbose=False)
    m = GRPOModule(**SMALL)
    pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[first, ckpt],
    ).fit(m, AdditionDataModule(batch_size=2))
    assert first.n_audits == 2
    resumed = CreditAuditCallback()
    m2 = GRPOModule(**SMALL)
    pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[resumed],
    ).fit(m2, AdditionDataModule(batch_size=2), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.n_audits == 3 and resumed.last_report_step == 2
