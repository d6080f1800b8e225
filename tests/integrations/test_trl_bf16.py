"""TRL's default precision (bf16=True) with plain SGD and LoRA: step conservation on real GRPOTrainer steps.

The parts are computed under the trainer's bfloat16 autocast, so they add up to ``g_full`` only to bfloat16's
resolution (the audit's ``conservation_error``, ~2e-3); that rounding is part of the conservation floor. A
correct re-derivation of the loss therefore never reads violated, and a wrong normaliser (luspo's per-row sum
for a grpo loss, which the trainer did not use) still does, in words, once. The reference for "correct" and
"wrong" is the trainer's own loss: ``grad_match`` against its ``.grad`` says which is which independently.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("trl", reason="the `trl` extra is not installed: pip install 'lens-callbacks[trl]'")
pytest.importorskip("peft", reason="LoRA runs need peft (in the `trl` and `dev` extras)")

from trl import GRPOTrainer  # noqa: E402

from lens_callbacks.credit import CreditReport  # noqa: E402
from lens_callbacks.credit.readings.conservation import UNIT_ROUNDOFF, ConservationReading  # noqa: E402
from lens_callbacks.examples.trl_grpo import digit_reward, grpo_config, prompt_dataset, save_policy, tiny_tokenizer  # noqa: E402
from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback  # noqa: E402

pytestmark = pytest.mark.slow


class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
    pass


class WrongNormaliser(AuditedGRPO):
    lens_loss_type = "luspo"  # grpo takes each row's token mean; luspo's per-row sum is another normaliser


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_policy(str(tmp_path_factory.mktemp("trl_policy") / "policy"))


def _train(policy_dir, tmp_path, cls):
    from peft import LoraConfig

    cb = LensTRLCallback()
    args = grpo_config(
        str(tmp_path / "out"), bf16=True, max_steps=2, loss_type="grpo", scale_rewards="none", reward_weights=[1000.0]
    )
    cls(
        model=policy_dir,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tiny_tokenizer(),
        callbacks=[cb],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    ).train()
    return cb


def test_bf16_lora_sgd_correct_loss_never_reads_violated(policy_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lens_callbacks"):
        cb = _train(policy_dir, tmp_path, AuditedGRPO)
    assert len(cb.conservation_history) == 2
    for (_, report), (_, reading) in zip(cb.history, cb.conservation_history):
        assert isinstance(report, CreditReport) and report.grad_match <= 1e-6  # the terms are the loss
        # bfloat16 parts: they add up to g_full only to bf16's resolution, far above float32's
        assert 1e-5 < report.conservation_error < 8 * UNIT_ROUNDOFF[torch.bfloat16]
        assert isinstance(reading, ConservationReading) and reading.source == "credit_parts"
        assert not reading.violated, reading.render()
        assert reading.parts_floor == pytest.approx(report.conservation_error / (1 - report.conservation_error))
        assert reading.relative_error <= reading.update_precision_floor  # limited by precision, not violated
        assert reading.status in ("holds", "holds within precision")
    assert not [r for r in caplog.records if "violated" in r.getMessage() or "not the loss" in r.getMessage()]


def test_bf16_lora_sgd_wrong_normaliser_reads_violated_once_in_words(policy_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lens_callbacks"):
        cb = _train(policy_dir, tmp_path, WrongNormaliser)
    for (_, report), (_, reading) in zip(cb.history, cb.conservation_history):
        assert report.grad_match > 0.1  # the trainer's .grad says the terms are not its loss
        assert isinstance(reading, ConservationReading) and reading.violated, reading.render()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "step conservation violated" in m]) == 1, said
    assert len([m for m in said if "the audited terms are not the loss" in m]) == 1, said
