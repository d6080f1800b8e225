"""The credit table where a user reads it: CreditAuditCallback's ``credit/table`` text and
``credit_last.txt``, and ``lens-callbacks audit``'s output.

References: the module's own rollouts (``last_rollouts``: completion text, reward, group, as sampled)
and a :func:`credit_table` built here from the report and the terms the module returns; TensorBoard
events read back with tensorboard's own EventAccumulator; the run record's trajectories.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lens_callbacks.callbacks import CreditAuditCallback
from lens_callbacks.credit import by_rollout, credit_table
from lens_callbacks.credit.readings.table import module_decoder
from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3)


def _trainer(callbacks, steps, logger=False, **kw):
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


class _Seen(pl.Callback):
    """After the audit: the step's report, the module's rollouts and the table rebuilt from fresh terms."""

    def __init__(self, audit, parts):
        self.audit, self.parts, self.rows = audit, parts, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        report = self.audit.last_report
        with torch.no_grad():
            terms = pl_module.credit_terms(None)
        want = None
        if report is not None:
            want = credit_table(
                report,
                terms,
                by_rollout(terms),
                decode=module_decoder(pl_module),
                top_k=(self.parts + 1) // 2,
                bottom_k=self.parts // 2,
            )
        self.rows.append((trainer.global_step, report, list(pl_module.last_rollouts), want))


def test_callback_logs_the_sorted_table_with_rollout_columns(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    audit = CreditAuditCallback(log_table_every_n_steps=1, table_parts=4, log_figure=False)
    seen = _Seen(audit, 4)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    pl.seed_everything(3, verbose=False)
    m = GRPOModule(**SMALL)
    _trainer([audit, seen], 4, logger).fit(m, AdditionDataModule(batch_size=3, data_seed=3))
    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    logged = {t.step: t.tensor_proto.string_val[0].decode() for t in acc.Tensors("credit/table/text_summary")}
    checked = 0
    for step, report, rollouts, want in seen.rows:
        body = logged[step]
        if report is None or not report.ok:
            continue
        checked += 1
        assert want.render() in body  # the callback's table is the pure function's, on the step's own terms
        assert audit.last_table is None or step != audit.last_report_step or audit.last_table.render() == want.render()
        lines = body.splitlines()
        head = next(ln for ln in lines if ln.startswith("part "))
        assert head.split() == [
            "part",
            "projected_share",
            "norm_share",
            "||g_S||",
            "group",
            "reward",
            "advantage",
            "trained",
            "completion",
        ]
        shown = [ln for ln in lines if ln.startswith("rollout_")]
        assert len(shown) == 4 and any(ln.startswith("... 8 more parts") for ln in lines)
        shares = [abs(float(ln.split()[1])) for ln in shown]
        assert shares[:2] == sorted(shares[:2], reverse=True) and min(shares[:2]) >= max(shares[2:])
        for ln in shown:
            k = int(ln.split()[0].split("_")[1])
            ro = rollouts[k]  # the module's own record of what it sampled and how it was scored
            cols = ln.split()
            assert int(cols[4]) == ro.group and float(cols[5]) == pytest.approx(ro.reward, abs=5e-4)
            assert int(cols[7]) == len(ro.completion_ids)
            assert ln.endswith(f'"{ro.completion}"')
        # The omitted parts' line holds the sum of the omitted shares.
        rest = [i for i, n in enumerate(report.part_names) if not any(ln.startswith(n + " ") for ln in shown)]
        summary = next(ln for ln in lines if ln.startswith("..."))
        assert f"share {math.fsum(report.projected_share[i] for i in rest):.6f} in all" in summary
    assert checked >= 2


class _ZeroAtLast(GRPOModule):
    def sample_rollouts(self, pairs):
        rb, ro = super().sample_rollouts(pairs)
        rb.advantages = torch.linspace(-1, 1, rb.batch_size) * float(self.trainer.global_step != 2)
        return rb, ro


def test_last_report_file_opens_with_the_last_defined_reading(tmp_path, capsys):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    audit = CreditAuditCallback(print_last_report=True, log_figure=False)
    seen = _Seen(audit, 10)
    pl.seed_everything(4, verbose=False)
    _trainer([audit, seen], 3, logger).fit(_ZeroAtLast(**SMALL), AdditionDataModule(batch_size=2, data_seed=4))
    assert not audit.last_report.ok and seen.rows[1][1].ok
    text = (Path(logger.log_dir) / "credit_last.txt").read_text()
    first = "step 1 (the last step whose shares are defined)\n" + seen.rows[1][3].render()
    assert text.startswith(first)
    assert "step 2 (the last audited step)\n" in text and "UNDEFINED" in text.split("step 2 (the last audited step)")[1]
    assert "nan" not in text.split("step 2 (the last audited step)")[0]
    printed = capsys.readouterr().out
    assert printed.startswith("credit audit, " + first)


def test_audit_command_prints_the_table_with_rollout_columns(tmp_path, capsys, monkeypatch):
    from lens_callbacks.callbacks.records import RunRecordCallback
    from lens_callbacks.cli import main
    from lens_callbacks.io.records import RunRecord

    torch.manual_seed(0)
    m = GRPOModule(**SMALL)
    rec_cb = RunRecordCallback(
        str(tmp_path / "record"), batch_builder="lens_callbacks.examples.grpo_tools.single_turn.grpo_rollout_batch"
    )
    _trainer([rec_cb], 3).fit(m, AdditionDataModule(batch_size=3))
    rec = RunRecord(tmp_path / "record")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["audit", str(rec.run_dir), "--step", "2", "--no-progress", "--table-parts", "6"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"step 2 of {rec.run_dir}"
    head = next(ln for ln in lines if ln.startswith("part "))
    assert head.split()[4:] == ["group", "reward", "advantage", "trained", "completion"]
    shown = [ln for ln in lines if ln.startswith("rollout_")]
    assert len(shown) == 6 and any(ln.startswith("... 6 more parts") for ln in lines)
    trajs = {t.rollout: t for t in rec.trajectories(2)}
    for ln in shown:
        cols = ln.split()
        t = trajs[int(cols[0].split("_")[1])]
        assert int(cols[4]) == t.group and float(cols[5]) == pytest.approx(t.reward, abs=5e-4)
        assert int(cols[7]) == len(t.turns[1].token_ids)
        assert ln.endswith(f'"{t.turns[1].text}"')
    with pytest.raises(SystemExit) as exit_:
        main(["audit", str(rec.run_dir), "--table-parts", "0", "--no-progress"])
    assert exit_.value.code == 2
    assert "argument --table-parts: must be a positive int, got '0'" in capsys.readouterr().err
