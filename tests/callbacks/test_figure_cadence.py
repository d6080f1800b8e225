"""Figures are off the hot path: a text table every step draws the figures only on their own cadence and at fit end."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import Logger

from lens_callbacks.callbacks import CreditAuditCallback, ExtraReadings
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

pytest.importorskip("matplotlib")

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3)


class _Experiment:
    def __init__(self):
        self.texts, self.figures = [], []

    def add_text(self, tag, text, global_step=None):
        self.texts.append((global_step, tag))

    def add_figure(self, tag, figure, global_step=None, close=True):
        self.figures.append((global_step, tag))
        import matplotlib.pyplot as plt

        plt.close(figure)


class _Capture(Logger):
    """What a TensorBoard-shaped logger receives: text and figure tags per step."""

    def __init__(self):
        super().__init__()
        self._exp = _Experiment()

    @property
    def experiment(self):
        return self._exp

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _fit(steps: int, **audit_kw) -> _Experiment:
    pl.seed_everything(0, verbose=False)
    logger = _Capture()
    audit = CreditAuditCallback(
        partition="by_rollout", extras=ExtraReadings(partitions=["by_advantage_sign"]), dtype="float64", **audit_kw
    )
    pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[audit],
        log_every_n_steps=1,
    ).fit(GRPOModule(**SMALL), AdditionDataModule(batch_size=2, data_seed=0))
    return logger.experiment


def _steps(rows, tag):
    return sorted({s for s, t in rows if t == tag})


def test_a_table_every_step_draws_figures_on_their_own_cadence_and_at_fit_end():
    exp = _fit(6, log_table_every_n_steps=1, log_figure_every_n_steps=4)
    assert _steps(exp.texts, "credit/table") == [0, 1, 2, 3, 4, 5]  # the text table keeps its cadence
    assert _steps(exp.texts, "credit/readings") == [0, 1, 2, 3, 4, 5]
    for tag in ("credit/heatmap", "credit/concentration/lorenz", "credit/ledger/gradient/by_advantage_sign"):
        assert _steps(exp.figures, tag) == [0, 4, 5], (tag, exp.figures)  # 0, 0 + 4, and fit end
    # Each figure once per drawing step: the fit-end drawing does not repeat step 4's.
    assert len(exp.figures) == len(set(exp.figures)), exp.figures


def test_figure_cadence_zero_draws_only_at_fit_end_and_bad_values_are_named():
    exp = _fit(3, log_table_every_n_steps=1, log_figure_every_n_steps=0)
    assert _steps(exp.texts, "credit/table") == [0, 1, 2]
    assert {s for s, _ in exp.figures} == {2}, exp.figures
    with pytest.raises(ValueError, match=r"`log_figure_every_n_steps` must be an int >= 0, got -1"):
        CreditAuditCallback(log_figure_every_n_steps=-1)
