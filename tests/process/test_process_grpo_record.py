"""The instrument over every group of a run record written by the GRPO example.

What it found (seed 0, 12 steps, 4 prompts x 4 rollouts = 48 groups, measured when this test was
written): the kill condition fires on 40 of 48 groups, not on all. 20 of the killed groups have four equal
outcomes (the induced function is identically zero); the other 20 never share a prefix between rollouts
with different outcomes. On the 8 readable groups a shared first token carries mixed outcomes
(informative_fraction up to 0.417); mean divergence depth runs from 1.00 to 2.00; 74.83% of trained
positions carry zero process reward, averaged over the groups. The example's vocabulary is a few digits, so
its sampler does revisit short prefixes. The specification's reference record (400 of 400 killed) never
shares a first token: the kill is a property of the sampler, not of the code. The assertions below keep
the shape of this finding (some groups of each kind), each kill checked against a brute-force criterion."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lens_callbacks.callbacks.process import ProcessRewardCallback
from lens_callbacks.callbacks.records import RunRecordCallback
from lens_callbacks.process import audit_groups, groups_from_record

warnings.filterwarnings("ignore", ".*does not have many workers.*")

STEPS, PROMPTS, G = 12, 4, 4


class _Collect(Callback):
    """The groups as the module held them in memory, step by step (the reference for the JSONL parser)."""

    def __init__(self):
        self.groups = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        for ro in pl_module.last_rollouts:
            comps, rewards = self.groups.setdefault((step, ro.group), ([], []))
            comps.append(tuple(ro.completion_ids))
            rewards.append(ro.reward)


def _informative_somewhere(completions, rewards) -> bool:
    """Brute force: some non-final prefix is shared by two rollouts with different outcomes."""
    for k, c in enumerate(completions):
        for t in range(1, len(c)):
            through = [j for j, d in enumerate(completions) if d[:t] == c[:t]]
            if len(through) >= 2 and len({rewards[j] for j in through}) > 1:
                return True
    return False


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("grpo") / "record"
    seed_everything(0)
    collect, process = _Collect(), ProcessRewardCallback(log_text_every_n_steps=0)
    trainer = Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[RunRecordCallback(run_dir=str(run_dir)), collect, process],
    )
    trainer.fit(GRPOModule(group_size=G, max_new_tokens=3, seed=0), AdditionDataModule(batch_size=PROMPTS, data_seed=0))
    return run_dir, collect.groups, process


def test_every_group_of_the_record_is_audited(record):
    run_dir, in_memory, process = record
    groups = groups_from_record(run_dir)
    audit = audit_groups(groups, source=str(run_dir))
    print("\n" + audit.render())
    assert audit.n_groups == STEPS * PROMPTS == len(in_memory)
    # the JSONL parser against what the module held in memory
    for g in groups:
        step, grp = (int(x) for x in g.key.replace("step", "").split("/group"))
        comps, rewards = in_memory[(step, grp)]
        assert g.completions == tuple(comps) and g.rewards == tuple(rewards)
    # the in-training callback saw the same groups and the same kills
    assert process.n_groups_total == audit.n_groups and process.n_killed_total == audit.n_killed
    # each group's kill against the brute-force criterion
    for g, r in zip(groups, audit.readings):
        assert r.kill == (not _informative_somewhere(g.completions, g.rewards)), g.key
        if len(set(g.rewards)) == 1:
            assert r.kill and r.zero_reward_fraction == 1.0

    # What it found (see the module docstring): the kill fires on most groups, not all.
    killed_equal = sum(1 for g, r in zip(groups, audit.readings) if r.kill and len(set(g.rewards)) == 1)
    killed_mixed = audit.n_killed - killed_equal
    assert 0 < audit.n_killed < audit.n_groups
    assert killed_equal > 0 and killed_mixed > 0
    readable = [r for r in audit.readings if not r.kill]
    for r in readable:  # the non-degenerate function: some process reward past the first token is non-zero
        assert r.informative_fraction > 0
        assert any(x != 0.0 for row in r.process_rewards for x in row[1:])
    lo, hi = audit.mean_divergence_depth_range
    assert lo == 1.0 < hi  # some group never shares a first token; others do
    assert audit.informative_fraction_max == max(r.informative_fraction for r in audit.readings) > 0
    assert audit.zero_reward_fraction == pytest.approx(
        math.fsum(r.zero_reward_fraction for r in audit.readings) / audit.n_groups
    )
    decision, reason = audit.verdict()
    assert decision is False and f"{audit.n_killed} of {audit.n_groups}" in reason


def test_process_command_on_the_record(record, capsys):
    from lens_callbacks.cli import main

    run_dir, _, _ = record
    audit = audit_groups(groups_from_record(run_dir))
    assert main(["process", str(run_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"on {audit.n_killed} of {audit.n_groups}" in out and "Across the 48 groups" in out
