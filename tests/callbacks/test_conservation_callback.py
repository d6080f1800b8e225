"""ConservationCheckCallback in a real Trainer, against readings a spy callback makes independently."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lens_callbacks.callbacks.conservation import ConservationCheckCallback
from lens_callbacks.credit import CreditTerms
from lens_callbacks.credit.readings.conservation import ConservationReading
from lens_callbacks.metrics.conservation import ConservationMetric, conservation_summary
from lens_callbacks.refusal import Refusal
from tests._spawn_exit import DestroyGroupAtExit

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")

VOCAB, D, T, B = 11, 8, 6, 4


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    # Trainers without a logger write beside the working directory (the audit's last table, too).
    monkeypatch.chdir(tmp_path)


class LitPolicy(LightningModule):
    """Embedding → tanh MLP (optional dropout) → logits; GRPO-style terms over a fixed set of batches."""

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        opt_kwargs: dict | None = None,
        groups: tuple[float, float] | None = None,
        scheduler: bool = False,
        dtype: torch.dtype = torch.float64,
        dropout: float = 0.0,
        manual: bool = False,
        steps_per_batch: int = 1,
        inf_at: int | None = None,
        clip_override: bool = False,
        freeze_embedding: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, D)
        self.hid = nn.Linear(D, D)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(D, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.to(dtype)
        self.emb.weight.requires_grad_(not freeze_embedding)  # frozen, yet still handed to the optimizer
        self.opt_name, self.lr, self.opt_kwargs, self.groups = optimizer, lr, opt_kwargs or {}, groups
        self.scheduler, self.inf_at, self.steps_per_batch = scheduler, inf_at, steps_per_batch
        self.automatic_optimization = not manual
        if clip_override:
            self.configure_gradient_clipping = lambda *a, **k: None  # type: ignore[method-assign]

    def credit_terms(self, batch) -> CreditTerms:
        tokens, mask, adv = batch  # [B, T+1], [B, T], [B]
        h = self.drop(torch.tanh(self.hid(self.emb(tokens[:, :-1]))))  # [B, T, D]
        lp = torch.log_softmax(self.out(h), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T]
        m = mask.to(lp.dtype)
        terms = -adv[:, None].to(lp.dtype) * lp * m / m.sum()  # [B, T]
        return CreditTerms(terms, mask, torch.arange(tokens.shape[0]), torch.arange(tokens.shape[0]) // 2)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            loss = self.credit_terms(batch).terms.sum()
            return loss * float("inf") if batch_idx == self.inf_at else loss
        opt = self.optimizers()
        for _ in range(self.steps_per_batch):
            opt.zero_grad()
            self.manual_backward(self.credit_terms(batch).terms.sum())
            opt.step()

    def configure_optimizers(self):
        if self.groups is not None:
            params = [
                {"params": [self.emb.weight, self.hid.weight, self.hid.bias], "lr": self.groups[0]},
                {"params": [self.out.weight, self.out.bias], "lr": self.groups[1], **self.opt_kwargs},
            ]
            kwargs = {}
        else:
            params, kwargs = self.parameters(), self.opt_kwargs
        cls = {
            "sgd": torch.optim.SGD,
            "adam": torch.optim.Adam,
            "adamw": torch.optim.AdamW,
            "lbfgs": torch.optim.LBFGS,
        }[self.opt_name]
        opt = cls(params, lr=self.lr, **kwargs)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(4):
            tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
            mask = torch.rand(B, T, generator=g) > 0.2
            mask[:, 0] = True
            adv = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
            batches.append((tokens, mask, adv))
        return torch.utils.data.DataLoader(batches, batch_size=None)


class Recording(ConservationCheckCallback):
    """Keeps every reading it emits (the callback itself keeps only the last)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list = []

    def _emit(self, trainer, pl_module, reading, step):
        super()._emit(trainer, pl_module, reading, step)
        self.seen.append(reading)


class Spy(Callback):
    """Independent reference: θ around each step, .grad and η at the step, numpy error."""

    def __init__(self):
        self.records = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        self._grad = {
            n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in pl_module.named_parameters()
        }
        self._lr = {n: lr_of[id(p)] for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        d, g = [], []
        for n, p in pl_module.named_parameters():
            d.append(((self._before[n].double() - p.detach().double()) / self._lr[n]).numpy().ravel())
            g.append(self._grad[n].double().numpy().ravel())
        d, g = np.concatenate(d), np.concatenate(g)
        self.records.append((np.linalg.norm(d - g) / np.linalg.norm(g), sorted(set(self._lr.values()))))


def _fit(module, callbacks, max_steps=3, logger=False, **trainer_kw):
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kw,
    )
    with warnings.catch_warnings():
        for msg in (".*does not have many workers.*", ".*LeafSpec.*", ".*log_every_n_steps.*", ".*GradScaler.*"):
            warnings.filterwarnings("ignore", msg)
        trainer.fit(module)
    return trainer


def test_plain_sgd_reading_matches_the_spy():
    cb, spy = Recording(), Spy()
    _fit(LitPolicy(), [cb, spy])
    assert len(cb.seen) == 3 and len(spy.records) == 3
    for r, (ref, _) in zip(cb.seen, spy.records):
        assert isinstance(r, ConservationReading) and r.source == "grad"
        assert r.relative_error == pytest.approx(ref, rel=1e-9, abs=1e-18)
        assert r.relative_error < 1e-12 and r.holds
    assert [r.step for r in cb.seen] == [0, 1, 2]


def test_two_param_groups_and_a_step_lr_scheduler_are_exact():
    cb, spy = Recording(), Spy()
    _fit(LitPolicy(groups=(0.02, 0.1), scheduler=True), [cb, spy])
    assert len(cb.seen) == 3
    for k, (r, (ref, lrs)) in enumerate(zip(cb.seen, spy.records)):
        assert r.relative_error == pytest.approx(ref, rel=1e-9, abs=1e-18)
        assert r.relative_error < 1e-12 and r.holds
        # η as it was at the step, halved by the scheduler after every step
        assert r.lrs == pytest.approx((0.02 * 0.5**k, 0.1 * 0.5**k), rel=1e-15)
        assert sorted(r.lrs) == pytest.approx(lrs, rel=1e-15)


REFUSALS = [
    (dict(optimizer="adam"), {}, "optimizer"),
    (dict(optimizer="adamw"), {}, "optimizer"),
    (dict(optimizer="lbfgs", lr=0.1, opt_kwargs={"max_iter": 2}), {}, "optimizer"),
    (dict(opt_kwargs={"momentum": 0.9}), {}, "momentum"),
    (dict(opt_kwargs={"weight_decay": 0.01}), {}, "weight_decay"),
    (dict(opt_kwargs={"momentum": 0.9, "nesterov": True}), {}, "nesterov"),
    (dict(opt_kwargs={"maximize": True}), {}, "maximize"),
    (dict(), {"gradient_clip_val": 0.5}, "gradient_clip_val"),
    (dict(), {"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
    (dict(groups=(0.05, 0.05), opt_kwargs={"momentum": 0.5}), {}, "momentum"),
    (dict(clip_override=True), {}, "configure_gradient_clipping"),
]


@pytest.mark.parametrize("module_kw, trainer_kw, condition", REFUSALS, ids=[c for _, _, c in REFUSALS])
def test_refusals_name_the_broken_condition(module_kw, trainer_kw, condition):
    cb = Recording()
    with pytest.warns(UserWarning, match="REFUSED") as rec:
        _fit(LitPolicy(**module_kw), [cb], max_steps=2, **trainer_kw)
    assert len(cb.seen) == 2  # one per optimizer step, however often the optimizer calls its closure
    assert all(isinstance(r, Refusal) and r.condition == condition for r in cb.seen)
    assert len([w for w in rec if "REFUSED" in str(w.message)]) == 1  # logged once as text
    if "groups" in module_kw:
        assert cb.seen[0].numbers["param_group"] == 1


def test_refusal_shows_in_tensorboard(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = ConservationCheckCallback()
    with pytest.warns(UserWarning, match="REFUSED"):
        _fit(
            LitPolicy(optimizer="adam"),
            [cb],
            max_steps=3,
            logger=TensorBoardLogger(tmp_path, name="tb"),
            log_every_n_steps=1,
        )
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    text_tags = [t for t in acc.Tags()["tensors"] if t.startswith("conservation/refusal")]
    assert text_tags, acc.Tags()
    text = acc.Tensors(text_tags[0])[0].tensor_proto.string_val[0].decode()
    assert "REFUSED (optimizer)" in text and "Adam" in text
    refused = [e.value for e in acc.Scalars("conservation/refused")]
    assert refused == [1.0, 1.0, 1.0]


def test_error_vs_floor_figure_in_tensorboard(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = Recording()
    _fit(LitPolicy(), [cb], max_steps=3, logger=TensorBoardLogger(tmp_path, name="tb"), log_every_n_steps=1)
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["conservation/error_vs_floor"]
    assert acc.Images("conservation/error_vs_floor")[0].step == 2
    assert [e.value for e in acc.Scalars("conservation/error")] == pytest.approx(
        [r.relative_error for r in cb.seen], rel=1e-6
    )


def test_skipped_amp_step_is_refused():
    cb, spy = Recording(), Spy()
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    _fit(
        LitPolicy(dtype=torch.float32, inf_at=1),
        [cb, spy],
        max_steps=3,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    assert [type(r).__name__ for r in cb.seen] == ["ConservationReading", "Refusal", "ConservationReading"]
    assert cb.seen[1].condition == "step_skipped"
    for k in (0, 2):
        assert cb.seen[k].relative_error == pytest.approx(spy.records[k][0], rel=1e-6, abs=1e-12)
        assert cb.seen[k].holds


def test_bf16_mixed_precision_reads_float32_weights():
    cb, spy = Recording(), Spy()
    _fit(LitPolicy(dtype=torch.float32), [cb, spy], max_steps=2, precision="bf16-mixed")
    assert len(cb.seen) == 2
    for r, (ref, _) in zip(cb.seen, spy.records):
        assert r.dtype == "float32" and r.relative_error == pytest.approx(ref, rel=1e-6, abs=1e-12) and r.holds


@pytest.mark.parametrize("steps_per_batch", [1, 2])
def test_manual_optimization_gives_one_reading_per_step(steps_per_batch):
    cb = Recording()
    _fit(LitPolicy(manual=True, steps_per_batch=steps_per_batch), [cb], max_steps=2 * steps_per_batch)
    assert len(cb.seen) == 2 * steps_per_batch
    assert [r.step for r in cb.seen] == list(range(2 * steps_per_batch))
    assert all(isinstance(r, ConservationReading) and r.relative_error < 1e-12 for r in cb.seen)


class _Capture(Logger):
    """An in-memory logger: every (step, name, value) the loggers receive."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name = "capture"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.rows.extend((step, k, float(v)) for k, v in metrics.items())

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_every_n_steps_logs_the_checked_steps_only(opt):
    cb, log = Recording(every_n_steps=2), _Capture()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Adam is refused with a warning
        _fit(LitPolicy(optimizer=opt), [cb], max_steps=4, logger=log, log_every_n_steps=1)
    assert len(cb.seen) == 2
    # no value on the skipped steps: not the previous reading, not a stale refusal flag
    refused = [(s, v) for s, k, v in log.rows if k == "conservation/refused"]
    assert refused == [(0, float(opt == "adam")), (2, float(opt == "adam"))]
    if opt == "sgd":
        assert [r.step for r in cb.seen] == [0, 2]
        errors = [(s, v) for s, k, v in log.rows if k == "conservation/error"]
        assert errors == [(r.step, r.relative_error) for r in cb.seen]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_is_bitwise_unchanged_with_the_callback(opt):
    def run(with_cb):
        torch.manual_seed(123)
        m = LitPolicy(optimizer=opt, dtype=torch.float32, dropout=0.2, lr=0.01)
        cbs = [Recording()] if with_cb else []
        t = _fit(m, cbs, max_steps=3)
        state = {k: v.clone() for k, v in m.state_dict().items()}
        return state, t.optimizers[0].state_dict(), torch.rand(3)

    if opt == "adam":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b = run(False), run(True)
    else:
        a, b = run(False), run(True)
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert torch.equal(a[2], b[2])  # the random stream after training
    sa, sb = a[1]["state"], b[1]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            va, vb = sa[i][k], sb[i][k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (i, k)


def test_metric_and_functional_agree_with_a_naive_loop():
    rng = np.random.default_rng(0)
    readings = []
    for i in range(12):
        if i % 5 == 0:
            readings.append(Refusal("optimizer", "Adam"))
            continue
        err, floor = float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 1e-3))
        readings.append(ConservationReading(err, floor, err <= floor, "float32", "grad", 5e-4))
    made = [r for r in readings if isinstance(r, ConservationReading)]
    resolved = [r.relative_error for r in made if not r.update_precision_limited]
    m = ConservationMetric()
    for r in readings[:7]:
        m.update(r)
    m.update(readings[7:])
    for out in (m.compute(), conservation_summary(readings)):
        assert float(out["readings"]) == 12
        assert float(out["refused_fraction"]) == pytest.approx(3 / 12)
        assert float(out["limited_fraction"]) == pytest.approx(
            sum(r.update_precision_limited for r in made) / len(made)
        )
        assert float(out["violations"]) == sum(not r.update_precision_limited and r.relative_error > 5e-4 for r in made)
        assert float(out["mean_resolved_error"]) == pytest.approx(np.mean(resolved), rel=1e-12)
        assert float(out["max_resolved_error"]) == pytest.approx(max(resolved), rel=1e-12)


@pytest.mark.parametrize(
    "kw, match",
    [({"every_n_steps": 0}, "every_n_steps"), ({"tolerance": -1.0}, "tolerance"), ({"prefix": 3}, "prefix")],
)
def test_init_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=f"`{match}` must be"):
        ConservationCheckCallback(**kw)


# ---------------------------------------------------------------- with the credit audit


@pytest.mark.parametrize("audit_first", [True, False])
def test_float64_summed_credit_parts_against_real_sgd_steps(audit_first):
    from lens_callbacks.callbacks.credit_audit import CreditAuditCallback

    audit = CreditAuditCallback(dtype="float64", log_table_every_n_steps=0, log_figure=False)
    cb, spy = Recording(), Spy()
    assert audit.keep_grads is False
    _fit(LitPolicy(lr=0.2), [audit, cb, spy] if audit_first else [cb, audit, spy])
    assert audit.keep_grads is True  # asked for by the check in setup
    assert len(cb.seen) == 3
    for r, (ref, _) in zip(cb.seen, spy.records):
        assert isinstance(r, ConservationReading) and r.source == "credit_parts"
        assert r.relative_error <= 1e-8  # the spec measured 4.9e-9
        # the parts meet .grad to float64 rounding, so the spy's .grad reading is the same number to ~1e-15
        assert r.relative_error == pytest.approx(ref, abs=1e-13)


def test_frozen_parameters_in_the_optimizer_are_accounted_for():
    from lens_callbacks.callbacks.credit_audit import CreditAuditCallback

    for callbacks in ([], [CreditAuditCallback(dtype="float64", log_table_every_n_steps=0, log_figure=False)]):
        cb, spy = Recording(), Spy()
        m = LitPolicy(freeze_embedding=True)
        frozen = m.emb.weight.detach().clone()
        _fit(m, [*callbacks, cb, spy], max_steps=2)
        assert torch.equal(m.emb.weight, frozen)
        for r, (ref, _) in zip(cb.seen, spy.records):
            assert r.n_without_grad == 1 and r.n_tensors == 5
            assert r.source == ("credit_parts" if callbacks else "grad")
            assert r.relative_error == pytest.approx(ref, abs=1e-13) and r.relative_error < 1e-12


def test_a_module_hook_that_edits_grad_after_the_read_is_a_violation():
    class Rescales(LitPolicy):
        def on_before_optimizer_step(self, optimizer):
            for p in self.parameters():
                p.grad.mul_(0.5)  # runs after the callbacks' hook: the step applies half the gradient read

    cb = Recording()
    _fit(Rescales(), [cb], max_steps=2)
    for r in cb.seen:
        assert r.source == "grad" and r.violated
        assert r.relative_error == pytest.approx(0.5, rel=1e-9)  # ||g/2 − g|| / ||g||


def test_credit_parts_that_do_not_add_up_to_the_loss_are_a_violation():
    from lens_callbacks.callbacks.credit_audit import CreditAuditCallback

    class Inflated(LitPolicy):
        def credit_terms(self, batch):
            t = super().credit_terms(batch)
            t.terms = t.terms * 1.02  # the audit's claim is 2 % off the loss actually trained on
            return t

        def training_step(self, batch, batch_idx):
            return LitPolicy.credit_terms(self, batch).terms.sum()

    cb = Recording()
    _fit(
        Inflated(), [CreditAuditCallback(dtype="float64", log_table_every_n_steps=0, log_figure=False), cb], max_steps=2
    )
    for r in cb.seen:
        assert r.source == "credit_parts" and r.violated and not r.update_precision_limited
        assert r.relative_error == pytest.approx(0.02 / 1.02, rel=1e-6)  # ||g − 1.02g|| / ||1.02g||


# ---------------------------------------------------------------- the GRPO example from YAML

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _cli(args, monkeypatch):
    from lens_callbacks.cli import cli_main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["lens-callbacks"])  # the args below are the whole command line
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        return cli_main(args, run=False)


def _watch(cb):
    seen, emit = [], cb._emit

    def _emit(trainer, pl_module, reading, step):
        emit(trainer, pl_module, reading, step)
        seen.append(reading)

    cb._emit = _emit
    return seen


@pytest.mark.slow
def test_grpo_conservation_yaml_holds_the_audit_against_sgd(tmp_path, monkeypatch):
    cli = _cli(
        [
            "--config",
            "cli_configs/grpo_conservation.yaml",
            "--trainer.max_steps",
            "4",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        monkeypatch,
    )
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, ConservationCheckCallback))
    seen = _watch(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zero-gradient groups are refused with a warning
        cli.trainer.fit(cli.model, cli.datamodule)
    readings = [r for r in seen if isinstance(r, ConservationReading)]
    assert len(seen) == 4 and readings
    for r in seen:
        if isinstance(r, Refusal):  # every rollout of every group scored alike: no gradient, no update
            assert r.condition == "zero_gradient" and r.numbers["update_norm"] == 0.0
    for r in readings:
        assert r.source == "credit_parts" and r.dtype == "float64" and r.relative_error <= 1e-8 and r.holds


@pytest.mark.slow
def test_shipped_adam_config_shows_the_refusal_in_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = _cli(
        [
            "--config",
            "cli_configs/grpo_credit.yaml",
            "--trainer.max_steps",
            "2",
            "--trainer.callbacks+=lens_callbacks.callbacks.ConservationCheckCallback",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        monkeypatch,
    )
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, ConservationCheckCallback))
    with pytest.warns(UserWarning, match=r"REFUSED \(optimizer\)"):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert isinstance(cb.last_reading, Refusal) and cb.last_reading.condition == "optimizer"
    acc = EventAccumulator(cli.trainer.logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    text = acc.Tensors("conservation/refusal/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "REFUSED (optimizer)" in text and "torch.optim.adam.Adam" in text
    assert [e.value for e in acc.Scalars("conservation/refused")] == [1.0, 1.0]


# ---------------------------------------------------------------- DDP on 2 CPU ranks


class RankPolicy(LitPolicy):
    """Each rank trains on its own batches, so local audit parts differ from the rank-averaged .grad."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(100 + self.global_rank)
        batches = []
        for _ in range(2):
            tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
            adv = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64) * (1 + self.global_rank)
            batches.append((tokens, torch.ones(B, T, dtype=torch.bool), adv))
        return torch.utils.data.DataLoader(batches, batch_size=None)

    def credit_terms(self, batch):
        if self.global_rank == 1 and self.trainer.global_step == 1:
            raise ValueError("no terms on this rank this step")  # the audit refuses on rank 1 only
        return super().credit_terms(batch)

    def training_step(self, batch, batch_idx):
        return LitPolicy.credit_terms(self, batch).terms.sum()


class CheckInWorker(Callback):
    """Asserts inside each spawned rank (its state is not sent back)."""

    def __init__(self, check, audit):
        self.check, self.audit, self.local_gap = check, audit, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.audit.last_report is None:
            return
        parts = dict(zip(self.audit.last_report.grads.names, self.audit.last_report.grads.parts_sum))
        num = sum(float(((parts[n] - p.grad) ** 2).sum()) for n, p in pl_module.named_parameters())
        den = sum(float((p.grad**2).sum()) for p in pl_module.parameters())
        self.local_gap.append((num / den) ** 0.5)

    def on_train_end(self, trainer, pl_module):
        seen = self.check.seen
        assert len(seen) == 2, seen
        assert self.local_gap and all(g > 1e-2 for g in self.local_gap), (
            self.local_gap
        )  # local parts would not conserve
        # Step 1: one rank has no audit parts, so every rank holds the step against .grad (no hang).
        assert [r.source for r in seen] == ["credit_parts", "grad"], seen
        for r in seen:
            assert isinstance(r, ConservationReading) and r.relative_error < 1e-12, r.render()


@pytest.mark.slow
@pytest.mark.timeout(300)  # a collective run on some ranks only would hang, not fail
def test_ddp_two_cpu_ranks_average_the_audit_parts():
    from lens_callbacks.callbacks.credit_audit import CreditAuditCallback

    # Per-rank audit: the check itself must average the local parts (the global scope is tested in
    # test_distributed_readings.py).
    audit = CreditAuditCallback(dtype="float64", log_table_every_n_steps=0, log_figure=False, scope="rank")
    cb = Recording()
    _fit(
        RankPolicy(),
        [audit, cb, CheckInWorker(cb, audit), DestroyGroupAtExit()],
        max_steps=2,
        strategy="ddp_spawn",
        devices=2,
        use_distributed_sampler=False,
    )


def test_state_round_trip_and_two_instances_have_distinct_keys():
    a, b = ConservationCheckCallback(), ConservationCheckCallback(every_n_steps=5)
    assert a.state_key != b.state_key
    a._once.refusals["optimizer"] = [2, 0, 1, "Adam"]
    a._once.seen.add("violated:grad")
    a.readings_made = 3
    c = ConservationCheckCallback()
    c.load_state_dict(a.state_dict())
    assert c._once.refusals == {"optimizer": [2, 0, 1, "Adam"]} and c._once.seen == {"violated:grad"}
    assert c.readings_made == 3
