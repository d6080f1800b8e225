"""ProcessRewardCallback on a tiny RL loop: logs the instrument's numbers, changes nothing the run has."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lens_callbacks.callbacks.process import ProcessRewardCallback
from lens_callbacks.credit import CreditTerms
from lens_callbacks.process import audit_groups
from tests._spawn_exit import DestroyGroupAtExit

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class TinyRL(LightningModule):
    """Samples `group_size` completions per prompt from a bigram policy inside the step (GRPO-style loss)."""

    def __init__(
        self, vocab: int = 4, group_size: int = 4, length: int = 3, prompts: int = 2, with_tokens: bool = True
    ):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(vocab, vocab))
        self.dropout = nn.Dropout(0.1)
        self.vocab, self.group_size, self.length, self.prompts = vocab, group_size, length, prompts
        self.with_tokens = with_tokens
        self.last_rollout_batch = None
        self.seen = []  # (tokens, rewards, group) per step, for the test's reference

    def _sample(self):
        G, K, L = self.prompts, self.group_size, self.length
        B = G * K
        tok = torch.zeros(B, L + 1, dtype=torch.long)
        tok[:, 0] = torch.arange(G).repeat_interleave(K) % self.vocab
        with torch.no_grad():
            for t in range(L):
                probs = torch.softmax(self.logits[tok[:, t]], -1)  # [B, V]
                tok[:, t + 1] = torch.multinomial(probs, 1).squeeze(1)
        rewards = (tok[:, 1:] == 1).float().sum(-1)  # [B]
        group = torch.arange(G).repeat_interleave(K)  # [B]
        return tok, rewards, group

    def credit_terms(self, batch):
        tok, rewards, group = self.last_rollout_batch
        lp = torch.log_softmax(self.dropout(self.logits)[tok[:, :-1]], -1)  # [B, L, V]
        lp = lp.gather(-1, tok[:, 1:, None]).squeeze(-1)  # [B, L]
        adv = rewards - rewards.view(-1, self.group_size).mean(-1).repeat_interleave(self.group_size)  # [B]
        terms = -adv[:, None] * lp / lp.numel()  # [B, L]
        B, L = terms.shape
        return CreditTerms(
            terms=terms,
            trained=torch.ones(B, L, dtype=torch.bool),
            rollout=torch.arange(B),
            group=group,
            rewards=rewards if self.with_tokens else None,
            tokens=tok[:, 1:] if self.with_tokens else None,
        )

    def training_step(self, batch, batch_idx):
        self.last_rollout_batch = self._sample()
        self.seen.append(self.last_rollout_batch)
        return self.credit_terms(None).terms.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(torch.zeros(64, 1), batch_size=1)


def _fit(tmp_path, callbacks, steps=3, logger=None, **module_kw):
    seed_everything(7, workers=True)
    model = TinyRL(**module_kw)
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    return model, trainer


def test_logs_the_instruments_numbers_and_the_verdict_text(tmp_path):
    torch.set_num_threads(1)
    cb = ProcessRewardCallback(log_figure_every_n_steps=2)
    tb = TensorBoardLogger(tmp_path, name="tb")
    model, trainer = _fit(tmp_path, [cb], steps=3, logger=[tb, CSVLogger(tmp_path, name="csv")])
    assert cb.n_audits == 3 and len(model.seen) == 3
    tok, rewards, group = model.seen[-1]
    ref = audit_groups(
        [
            (
                [tok[r, 1:].tolist() for r in range(len(group)) if group[r] == g],
                [float(rewards[r]) for r in range(len(group)) if group[r] == g],
            )
            for g in group.unique().tolist()
        ]
    )
    logged = trainer.logged_metrics
    assert float(logged["process/kill_fraction"]) == pytest.approx(ref.kill_fraction)
    assert float(logged["process/n_groups"]) == ref.n_groups == 2
    for key in ("informative_fraction", "mean_divergence_depth", "zero_reward_fraction"):
        want = getattr(ref, key)
        assert float(logged[f"process/{key}"]) == pytest.approx(want, abs=1e-6), key
    assert cb.last_audit.numbers() == ref.numbers()
    assert cb.n_groups_total == 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb.experiment.flush()
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    tag = [t for t in acc.Tags()["tensors"] if t.startswith("process/verdict")]
    assert tag, acc.Tags()
    texts = acc.Tensors(tag[0])
    assert [e.step for e in texts] == [0, 1, 2]
    body = texts[-1].tensor_proto.string_val[0].decode()
    assert "Kill condition fires" in body and f"on {ref.n_killed} of 2" in body
    assert [e.step for e in acc.Images("process/process_rewards")] == [0, 2]


def test_changes_nothing_the_run_has(tmp_path):
    """Weights and the RNG stream after training are bit-identical with and without the callback."""
    m0, _ = _fit(tmp_path, [], steps=4)
    after0 = torch.rand(3)
    m1, _ = _fit(tmp_path, [ProcessRewardCallback()], steps=4)
    after1 = torch.rand(3)
    assert torch.equal(m0.logits, m1.logits)
    assert torch.equal(after0, after1)
    for (a, ra, _), (b, rb, _) in zip(m0.seen, m1.seen):
        assert torch.equal(a, b) and torch.equal(ra, rb)


def test_without_tokens_it_refuses_and_training_continues(tmp_path):
    cb = ProcessRewardCallback()
    with pytest.warns(UserWarning, match="tokens"):
        _fit(tmp_path, [cb], steps=2, with_tokens=False)
    assert cb.n_audits == 0 and cb.last_refusal is not None and not cb.last_refusal


def test_a_failing_reading_is_a_refusal_not_a_crash(tmp_path):
    class Broken(TinyRL):
        def credit_terms(self, batch):
            terms = super().credit_terms(batch)
            if not torch.is_grad_enabled():  # only the callback's call (training_step runs with grad)
                raise RuntimeError("no rollout batch cached")
            return terms

    cb = ProcessRewardCallback()
    seed_everything(7, workers=True)
    trainer = Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        callbacks=[cb],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="no rollout batch cached"):
        trainer.fit(Broken())
    assert trainer.global_step == 3 and cb.n_audits == 0
    assert cb.last_refusal is not None and not cb.last_refusal and cb.last_refusal.condition == "reading"


def test_state_dict_round_trip_and_every_n_steps(tmp_path):
    cb = ProcessRewardCallback(every_n_steps=2, log_text_every_n_steps=0)
    _fit(tmp_path, [cb], steps=5)
    assert cb.n_batches == 5 and cb.n_audits == 3
    cb2 = ProcessRewardCallback()
    cb2.load_state_dict(cb.state_dict())
    assert cb2.state_dict() == cb.state_dict()


def test_config_errors():
    with pytest.raises(ValueError, match="every_n_steps"):
        ProcessRewardCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="log_text_every_n_steps"):
        ProcessRewardCallback(log_text_every_n_steps=-1)
    with pytest.raises(ValueError, match="log_figure_every_n_steps"):
        ProcessRewardCallback(log_figure_every_n_steps=True)

    class NoTerms(TinyRL):
        credit_terms = None

    with pytest.raises(TypeError, match="credit_terms"):
        trainer = Trainer(
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            callbacks=[ProcessRewardCallback()],
        )
        trainer.fit(NoTerms())


def test_metric_matches_functional_and_sums_states():
    from lens_callbacks.metrics.process import ProcessRewardMetric, process_reward_stats, readings_to_tensors

    a = audit_groups([([[1, 2], [1, 3]], [1.0, 0.0]), ([[4], [5]], [1.0, 0.0]), ([[], []], [1.0, 1.0])])
    tensors = readings_to_tensors(a.readings)
    m = ProcessRewardMetric()
    m.update(*(t[:1] for t in tensors))
    m.update(*(t[1:] for t in tensors))
    got, fn = m.compute(), process_reward_stats(*tensors)
    for k in fn:
        assert float(got[k]) == pytest.approx(float(fn[k]))
    assert float(got["kill_fraction"]) == pytest.approx(2 / 3)
    # the empty group has no positions: it counts for the kill, not for the means
    assert float(got["mean_divergence_depth"]) == pytest.approx((a.readings[0].mean_divergence_depth + 1.0) / 2)
    assert math.isnan(a.readings[2].mean_divergence_depth)


@pytest.mark.slow
@pytest.mark.timeout(300)  # a collective reached by some ranks only would hang, not fail
def test_ddp_two_ranks_sum_the_groups(tmp_path):
    """Every rank audits its own groups; the logged counts are summed over ranks, without a deadlock."""
    seed_everything(7, workers=True)
    trainer = Trainer(
        max_steps=2,
        accelerator="cpu",
        strategy="ddp_spawn",
        devices=2,
        logger=False,
        callbacks=[ProcessRewardCallback(), DestroyGroupAtExit()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyRL(prompts=3))
    metrics = trainer.callback_metrics
    assert float(metrics["process/n_groups"]) == 6.0  # 3 groups on each of 2 ranks
    assert 0.0 <= float(metrics["process/kill_fraction"]) <= 1.0
    assert float(metrics["process/n_killed"]) == pytest.approx(6.0 * float(metrics["process/kill_fraction"]))
