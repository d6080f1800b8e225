"""CreditAuditCallback's engines and ``capture="training_step"`` on the GRPO example.

References: training without any callback (parameters compared bit for bit), and the separate pass of
the same step made by a second callback (``capture="separate"``) from the same ``.grad``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3, dropout=0.1)


def _fit(callbacks=(), steps=3, seed=0, module_cls=GRPOModule, logger=False, **kw):
    pl.seed_everything(seed, verbose=False)
    m = module_cls(**SMALL)
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
        **kw,
    ).fit(m, AdditionDataModule(batch_size=2, data_seed=seed))
    return m


class _Pairs(Callback):
    """Runs after both audits at each step: keeps (ride-along report, separate report, .grad snapshot)."""

    def __init__(self, ride, separate):
        self.ride, self.separate, self.rows = ride, separate, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append((self.ride.last_report, self.separate.last_report))


def test_ride_along_training_is_bitwise_unchanged_over_20_steps():
    plain = _fit(steps=20, seed=3)
    ride = CreditAuditCallback(capture="training_step", log_figure=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning: every step rode along
        audited = _fit([ride], steps=20, seed=3)
    assert ride.n_audits == 20 and ride.n_ride_along == 20
    assert ride.last_report.engine == "ghost+training_step"
    for (n, p), (_, q) in zip(plain.named_parameters(), audited.named_parameters()):
        assert torch.equal(p, q), n
    # hooks and the wrapper are gone after the step
    assert "credit_terms" not in audited.__dict__
    assert all(len(mod._forward_hooks) == 0 for mod in audited.modules())


def test_ride_along_readings_equal_the_separate_pass():
    ride = CreditAuditCallback(capture="training_step", log_figure=False)
    # The same partition by its import path: a second callback needs its own state key.
    separate = CreditAuditCallback(
        partition="lens_callbacks.credit.inputs.partition.by_rollout", engine="ghost", dtype="native", log_figure=False
    )
    pairs = _Pairs(ride, separate)
    _fit([ride, separate, pairs], steps=4, seed=1)
    compared = 0
    for r, s in pairs.rows:
        assert r.engine == "ghost+training_step" and s.engine == "ghost"
        if not s.ok:  # a zero gradient (every advantage 0): shares, grad_match and conservation are undefined
            assert not r.ok
            continue
        assert s.grad_match is not None and s.grad_match < 1e-6  # the separate pass's g_full is the step's .grad
        assert r.conservation_error < 1e-5
        compared += 1
        for a, b in zip(r.projected_share, s.projected_share):
            assert a == pytest.approx(b, abs=1e-5)
        for a, b in zip(r.norm_share, s.norm_share):
            assert a == pytest.approx(b, abs=1e-5)
        assert r.cancellation == pytest.approx(s.cancellation, rel=1e-5)
        gr = torch.tensor(r.gram, dtype=torch.float64)
        gs = torch.tensor(s.gram, dtype=torch.float64)
        assert float((gr - gs).abs().max()) <= 1e-5 * float(gs.diagonal().max())
    assert compared >= 1


class _ScaledLoss(GRPOModule):
    """A loss that is not ``terms.sum()``: riding along must not read it."""

    def training_step(self, batch, batch_idx):
        return 2.0 * super().training_step(batch, batch_idx)


def test_loss_not_terms_sum_falls_back_to_the_separate_pass_and_says_so_once():
    ride = CreditAuditCallback(capture="training_step", log_figure=False)
    with pytest.warns(RuntimeWarning, match="falls back to a separate pass") as rec:
        _fit([ride], steps=3, seed=0, module_cls=_ScaledLoss)
    assert sum("falls back" in str(w.message) for w in rec) == 1
    assert ride.n_ride_along == 0 and ride.n_audits == 3
    assert ride.last_report.engine == "ghost"  # the separate pass (auto: by_rollout → ghost)


class _Accumulated(pl.LightningModule):
    """A vocabulary policy trained on fixed micro-batches whose rows carry step-unique rollout ids."""

    def __init__(self):
        super().__init__()
        from tests.credit.test_ride_accumulated import MicroPolicy

        self.net = MicroPolicy(tie=True, dtype=torch.float64)

    def credit_terms(self, batch):
        return self.net.credit_terms(tuple(batch))  # the loader hands the micro-batch over as a list

    def training_step(self, batch, batch_idx):
        return self.credit_terms(batch).terms.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay: the reference reads the same step


def _micro(unique=True):
    from tests.credit.test_ride_accumulated import micro_batches

    return [mb[:4] + ((mb[4] if unique else 0), 1) for mb in micro_batches(n=4)]  # 2 steps of 2 micro-batches


def test_accumulation_rides_along_the_whole_step():
    micro = _micro()
    module = _Accumulated()
    ride = CreditAuditCallback(capture="training_step", readings="shares", log_figure=False, log_table_every_n_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        pl.Trainer(
            max_steps=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ride],
            accumulate_grad_batches=2,
        ).fit(module, torch.utils.data.DataLoader(micro, batch_size=None))
    assert ride.n_audits == 2 and ride.n_ride_along == 2
    got = ride.last_report
    assert got.engine == "ghost+training_step" and got.n_parts == 8  # both micro-batches' rows, the whole step
    from lens_callbacks.credit import disintegrate

    ref = disintegrate(module.net, micro[2:], "by_rollout", dtype="float64", engine="reference")
    for a, b in zip(ref.projected_share, got.projected_share):
        assert a == pytest.approx(b, abs=1e-12)
    for a, b in zip(ref.part_norm, got.part_norm):  # Lightning divides each micro-batch's loss by 2
        assert a / 2 == pytest.approx(b, rel=1e-10)
    assert got.conservation_error < 1e-13


def test_accumulation_with_rollout_ids_repeated_across_micro_batches_keys_them_by_micro_batch():
    micro = _micro(unique=False)  # every micro-batch numbers its rows from 0, as `torch.arange(B)` does
    ride = CreditAuditCallback(capture="training_step", readings="shares", log_figure=False, log_table_every_n_steps=0)
    module = _Accumulated()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the step rides along
        pl.Trainer(
            max_steps=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ride],
            accumulate_grad_batches=2,
        ).fit(module, torch.utils.data.DataLoader(micro, batch_size=None))
    got = ride.last_report
    assert ride.n_ride_along == 1 and got.engine == "ghost+training_step"
    assert got.part_names == tuple(f"mb{j}/rollout_{i}" for j in range(2) for i in range(4))
    from lens_callbacks.credit import disintegrate

    # the reference: one backward per part of the step's stacked micro-batches (before the optimizer step)
    fresh = _Accumulated()
    ref = disintegrate(fresh.net, micro[:2], "by_rollout", dtype="float64", engine="reference")
    assert ref.part_names == got.part_names
    for a, b in zip(ref.projected_share, got.projected_share):
        assert a == pytest.approx(b, abs=1e-12)


def test_engine_and_interference_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    audit = CreditAuditCallback(capture="training_step", log_table_every_n_steps=1)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _fit([audit], steps=2, seed=1, logger=logger)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert "credit/engine/ghost+training_step" in scalars and "credit/readings/all" in scalars
    assert "credit/interference/min_cosine" in scalars
    assert "credit/interference" in acc.Tags()["images"]
    body = acc.Tensors("credit/table/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "engine ghost+training_step" in body
    want = audit.last_report.interference_summary()["min_cosine"]
    got = acc.Scalars("credit/interference/min_cosine")[-1].value
    assert math.isclose(got, want, rel_tol=1e-6)


def test_bad_arguments_name_the_options():
    with pytest.raises(ValueError, match="`capture` must be one of"):
        CreditAuditCallback(capture="backward")
    with pytest.raises(ValueError, match="`engine` must be one of"):
        CreditAuditCallback(engine="fast")
    with pytest.raises(ValueError, match="`readings` must be one of"):
        CreditAuditCallback(readings="norms")


def test_projected_readings_ride_along():
    ride = CreditAuditCallback(capture="training_step", readings="projected", log_figure=False)
    separate = CreditAuditCallback(
        partition="lens_callbacks.credit.inputs.partition.by_rollout", engine="reference", log_figure=False
    )
    pairs = _Pairs(ride, separate)
    _fit([ride, separate, pairs], steps=2, seed=1)
    for r, s in pairs.rows:
        assert r.readings == "projected" and r.gram is None and all(math.isnan(x) for x in r.norm_share)
        assert s.engine == "reference"
        if s.ok:
            for a, b in zip(r.projected_share, s.projected_share):
                assert a == pytest.approx(b, abs=1e-5)
    assert ride.last_values["credit/readings/projected"] == 1.0


def test_shares_readings_ride_along_hold_the_norms_without_the_interference_matrix():
    ride = CreditAuditCallback(capture="training_step", readings="shares", log_figure=False)
    separate = CreditAuditCallback(
        partition="lens_callbacks.credit.inputs.partition.by_rollout", engine="reference", log_figure=False
    )
    pairs = _Pairs(ride, separate)
    _fit([ride, separate, pairs], steps=3, seed=1)
    compared = 0
    for r, s in pairs.rows:
        assert r.engine == "ghost+training_step" and r.readings == "shares" and r.gram is None
        if not s.ok:
            continue
        compared += 1
        for field in ("projected_share", "norm_share"):
            for a, b in zip(getattr(r, field), getattr(s, field)):
                assert a == pytest.approx(b, abs=1e-5), field
        assert r.cancellation == pytest.approx(s.cancellation, rel=1e-5)
    assert compared >= 1
    assert ride.last_values["credit/readings/shares"] == 1.0
    assert not any(k.startswith("credit/interference") for k in ride.last_values)


class _Readings(Callback):
    def __init__(self, check):
        self.check, self.seen = check, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(self.check.last_reading)


def test_ride_along_parts_hold_against_real_sgd_steps():
    from lens_callbacks.callbacks import ConservationCheckCallback
    from lens_callbacks.credit.readings.conservation import ConservationReading

    ride = CreditAuditCallback(capture="training_step", log_figure=False)
    check = ConservationCheckCallback(log_figure=False)
    rec = _Readings(check)
    pl.seed_everything(2, verbose=False)
    m = GRPOModule(**{**SMALL, "dropout": 0.0}, optimizer="sgd", lr=0.5, dtype="float64")
    pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ride, check, rec],
    ).fit(m, AdditionDataModule(batch_size=2, data_seed=2))
    assert ride.n_ride_along == 6 and ride.keep_grads
    made = [r for r in rec.seen if isinstance(r, ConservationReading)]
    assert len(rec.seen) == 6 and len(made) >= 2  # the rest: equal rewards, a zero gradient (refused)
    for r in made:
        assert r.source == "credit_parts"
        assert r.relative_error <= 1e-8  # Σ_S g_S from the captured pieces against θ_before − θ_after over η


def test_full_grad_trainer_reads_the_separate_pass_against_grad():
    plain = _fit(steps=3, seed=2)
    fast = CreditAuditCallback(full_grad="trainer", readings="shares", log_figure=False)
    own = CreditAuditCallback(
        partition="lens_callbacks.credit.inputs.partition.by_rollout",
        engine="ghost",
        readings="shares",
        log_figure=False,
    )
    pairs = _Pairs(fast, own)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: .grad is this batch's gradient
        audited = _fit([fast, own, pairs], steps=3, seed=2)
    for (n, p), (_, q) in zip(plain.named_parameters(), audited.named_parameters()):
        assert torch.equal(p, q), n  # read-only
    compared = 0
    for f, o in pairs.rows:
        assert f.engine == "ghost+grad" and f.grad_match is None and o.engine == "ghost"
        if not o.ok:
            continue
        compared += 1
        assert o.grad_match < 1e-6 and f.conservation_error < 1e-5
        for field in ("projected_share", "norm_share"):
            for a, b in zip(getattr(f, field), getattr(o, field)):
                assert a == pytest.approx(b, abs=1e-6), field
    assert compared >= 1


def test_full_grad_trainer_under_accumulation_reads_the_accumulated_grad():
    # The separate pass replays every micro-batch of the step, whose gradient is `.grad` itself.
    trainer_cb = CreditAuditCallback(full_grad="trainer", log_figure=False)
    own = CreditAuditCallback(partition="lens_callbacks.credit.inputs.partition.by_rollout", log_figure=False)
    pairs = _Pairs(trainer_cb, own)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        _fit([trainer_cb, own, pairs], steps=2, seed=0, accumulate_grad_batches=2)
    assert trainer_cb.last_report.engine == "ghost+grad" and own.last_report.engine == "ghost"
    compared = 0
    for r, s in pairs.rows:
        if r is None or s is None or not s.ok:
            continue
        assert s.grad_match < 1e-6  # the replayed micro-batches are the step's .grad
        assert r.n_parts == s.n_parts and r.n_parts > 8  # every micro-batch's rollouts
        for a, b in zip(r.projected_share, s.projected_share):
            assert a == pytest.approx(b, abs=1e-5)
        compared += 1
    assert compared >= 1
    with pytest.raises(ValueError, match="`full_grad` must be 'own'"):
        CreditAuditCallback(full_grad="grad")
