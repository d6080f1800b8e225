"""The TRL GRPOTrainer adapter against real GRPOTrainer steps on a tiny Qwen2 (CPU, fp32).

Every reading is held against something the adapter does not compute: ``grad_match`` against the
trainer's own accumulated ``.grad`` (clip coefficient divided out), step conservation against the update
the real SGD step made, bit-identity against a run without the adapter.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch

pytest.importorskip("trl", reason="the `trl` extra is not installed: pip install -e '.[trl]'")
pytest.importorskip("peft", reason="LoRA runs need peft (in the `trl` and `dev` extras)")

from trl import GRPOTrainer  # noqa: E402

from lens_callbacks.credit import CreditReport  # noqa: E402
from lens_callbacks.credit.readings.conservation import ConservationReading  # noqa: E402
from lens_callbacks.examples.trl_grpo import digit_reward, grpo_config, prompt_dataset, save_policy, tiny_tokenizer  # noqa: E402
from lens_callbacks.integrations.trl import LOSS_TYPES, LensGRPOMixin, LensTRLCallback  # noqa: E402
from lens_callbacks.refusal import Refusal  # noqa: E402


class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
    pass


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_policy(str(tmp_path_factory.mktemp("trl_policy") / "policy"))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


# Advantages of a few units (rewards unscaled, weight 1000) give gradients well above max_grad_norm = 0.5,
# so clipping really rescales .grad and the clip coefficient has to be divided out.
HARD = dict(scale_rewards="none", reward_weights=[1000.0])


def _train(policy_dir, tmp_path, *, cls=AuditedGRPO, callbacks=None, lora=True, **overrides):
    args = grpo_config(str(tmp_path / "out"), **overrides)
    trainer = cls(
        model=policy_dir,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tiny_tokenizer(),
        peft_config=_lora() if lora else None,
        callbacks=callbacks or [],
    )
    trainer.train()
    return trainer


def _exact(cb, report, ride):
    """Riding along, the adapter's terms sent TRL's own gradient into the forward's outputs (else the step
    would have fallen back, with the reason); by the separate pass, ``grad_match`` holds them against ``.grad``."""
    if ride:
        assert report.engine == "ghost+training_step" and cb.ride_reason is None, cb.ride_reason
        assert report.grad_match is None
    else:
        assert report.engine.startswith("ghost") and report.engine != "ghost+training_step"
        assert report.grad_match <= 1e-6, report.grad_match


@pytest.mark.parametrize("ride", [False, True], ids=["separate", "ride"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_matches_the_trainers_grad_and_its_step(policy_dir, tmp_path, loss_type, ride):
    # accumulation 2, num_iterations 2, beta 0.1, entropy_coef 0.01, max_grad_norm 0.5, LoRA, gradient
    # checkpointing (TRL's default), SGD: all in grpo_config's defaults or here.
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    cb = LensTRLCallback(capture="training_step" if ride else "separate")
    trainer = _train(policy_dir, tmp_path, callbacks=[cb], loss_type=loss_type, max_steps=4, **HARD, **extra)
    args = trainer.args
    assert (args.gradient_accumulation_steps, args.num_iterations, args.max_grad_norm) == (2, 2, 0.5)
    assert args.beta > 0 and args.entropy_coef > 0 and args.gradient_checkpointing
    assert len(cb.history) == 4 and len(cb.conservation_history) == 4
    for (step, report), (_, reading) in zip(cb.history, cb.conservation_history):
        assert isinstance(report, CreditReport), report.render()
        # 2 micro-batches of 4 rows: one part per rollout, run-wide ids.
        assert report.n_parts == 8, report.part_names
        _exact(cb, report, ride)
        assert report.conservation_error <= 1e-6, (loss_type, step, report.conservation_error)
        assert abs(report.share_sum - 1.0) <= 1e-6, (loss_type, step, report.share_sum)
        assert isinstance(reading, ConservationReading), reading.render()
        assert reading.source == "credit_parts"
        assert reading.relative_error <= 1e-6, (loss_type, step, reading.render())
    # num_iterations = 2: the same rollouts train in two consecutive steps (the second off-policy).
    assert cb.history[0][1].part_names == cb.history[1][1].part_names
    assert cb.history[2][1].part_names == cb.history[3][1].part_names
    assert set(cb.history[0][1].part_names).isdisjoint(cb.history[2][1].part_names)
    # Clipping bit: .grad was rescaled before the callback saw it.
    assert cb.last_clip_coef is not None and cb.last_clip_coef < 0.5
    logged = [h for h in trainer.state.log_history if "credit/share_sum" in h]
    assert len(logged) == 4 and all("conservation/error" in h for h in logged)
    assert [h["step"] for h in logged] == [1, 2, 3, 4]
    assert [h["credit/ride_along"] for h in logged] == [float(ride)] * 4


def test_training_is_bit_identical_with_and_without_the_adapter(policy_dir, tmp_path):
    kw = dict(loss_type="dapo", max_steps=3, **HARD)
    torch.manual_seed(123)
    plain = _train(policy_dir, tmp_path / "plain", cls=GRPOTrainer, lora=False, **kw)
    rng_plain = torch.get_rng_state()
    torch.manual_seed(123)
    cb = LensTRLCallback()
    audited = _train(policy_dir, tmp_path / "audited", callbacks=[cb], lora=False, **kw)
    rng_audited = torch.get_rng_state()
    assert len(cb.history) == 3 and all(isinstance(r, CreditReport) for _, r in cb.history)
    a = dict(plain.model.named_parameters())
    b = dict(audited.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(rng_plain, rng_audited)
    losses = lambda tr: [h["loss"] for h in tr.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(audited) and len(losses(plain)) == 3


class ForgetsAccumulation(AuditedGRPO):
    """Re-derives the terms without TRL's division by the accumulation count."""

    def _lens_micro_terms(self, mb):
        return super()._lens_micro_terms(dataclasses.replace(mb, accumulation=1))


class IgnoresClipping(AuditedGRPO):
    """Compares with the clipped .grad as if nothing had been clipped."""

    def lens_clip_coefficient(self):
        return 1.0


@pytest.mark.parametrize("wrong", ["luspo_normaliser", "no_accumulation_scaling", "clip_ignored"])
def test_a_wrong_normaliser_is_caught_by_grad_match(policy_dir, tmp_path, wrong):
    cb = LensTRLCallback(conservation=False, capture="separate")
    if wrong == "luspo_normaliser":
        # grpo takes each row's token mean; luspo's per-row sum is a wrong normaliser for it.
        cls = type("WrongNormaliser", (AuditedGRPO,), {"lens_loss_type": "luspo"})
    elif wrong == "clip_ignored":
        cls = IgnoresClipping
    else:
        cls = ForgetsAccumulation
    _train(policy_dir, tmp_path, cls=cls, callbacks=[cb], loss_type="grpo", max_steps=1, **HARD)
    ((step, report),) = cb.history
    assert isinstance(report, CreditReport)
    assert report.grad_match > 0.1, report.grad_match
    # the parts still add up to the (wrong) objective: only grad_match can catch this
    assert report.conservation_error <= 1e-6


def test_readings_reach_tensorboard_and_adam_is_refused_by_conservation(policy_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = LensTRLCallback(capture="separate")  # the separate pass: grad_match reaches TensorBoard too
    trainer = _train(
        policy_dir,
        tmp_path,
        callbacks=[cb],
        max_steps=2,
        optim="adamw_torch",
        learning_rate=1e-3,
        report_to=["tensorboard"],
        **HARD,
    )
    logdir = tmp_path / "out" / "runs"
    assert all(isinstance(r, CreditReport) and r.grad_match <= 1e-6 for _, r in cb.history)
    assert all(isinstance(c, Refusal) and c.condition == "optimizer" for _, c in cb.conservation_history)
    files = list(logdir.rglob("events.out.tfevents.*"))
    assert files, list(logdir.rglob("*"))
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # transformers' TensorBoard integration puts training logs under `train/`.
    assert {"train/credit/grad_match", "train/credit/share_sum", "train/conservation/refused"} <= tags, sorted(tags)
    shares = acc.Scalars("train/credit/share_sum")
    assert [e.step for e in shares] == [1, 2]
    for e, (_, r) in zip(shares, cb.history):
        assert math.isclose(e.value, r.share_sum, rel_tol=1e-6)
    assert trainer.state.global_step == 2


def test_unsupported_configurations_are_named_refusals(policy_dir, tmp_path):
    trainer = AuditedGRPO(
        model=policy_dir,
        reward_funcs=digit_reward,
        args=grpo_config(str(tmp_path / "out"), max_steps=1),
        train_dataset=prompt_dataset(),
        processing_class=tiny_tokenizer(),
    )
    assert trainer.lens_setup_refusal() is None
    cases = {
        "vllm": ("use_vllm", True),
        "loss_type": ("lens_loss_type", "ppo"),
    }
    for condition, (attr, value) in cases.items():
        old = getattr(trainer, attr)
        setattr(trainer, attr, value)
        try:
            ref = trainer.lens_setup_refusal()
            assert isinstance(ref, Refusal) and ref.condition == condition, ref
            assert ref.reason and "REFUSED" in ref.render()
        finally:
            setattr(trainer, attr, old)
    # Several processes read the global step (tests/integrations/test_trl_ddp.py); sharded ones are refused,
    # and so are several processes without a process group to combine them over.
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    real = trainer.accelerator
    try:
        for kind, n, condition in (
            (DistributedType.DEEPSPEED, 2, "sharded"),
            (DistributedType.FSDP, 2, "sharded"),
            (DistributedType.MULTI_CPU, 2, "distributed"),
            (DistributedType.MULTI_GPU, 1, None),
        ):
            trainer.accelerator = SimpleNamespace(distributed_type=kind, num_processes=n)
            ref = trainer.lens_setup_refusal()
            assert (ref.condition if ref is not None else None) == condition, (kind, ref)
    finally:
        trainer.accelerator = real
    from lens_callbacks.integrations.trl import MicroBatch

    base = {"lens_rollout": torch.arange(2)}
    mm = [MicroBatch({**base, "pixel_values": torch.zeros(2, 3)}, 1, 0.0)]
    assert trainer.lens_step_refusal(mm).condition == "multimodal"
    vis = [MicroBatch({**base, "importance_sampling_ratio": torch.ones(2, 1)}, 1, 0.0)]
    assert trainer.lens_step_refusal(vis).condition == "vllm_importance_sampling"
    assert trainer.lens_step_refusal([]).condition == "no_micro_batches"
    assert trainer.lens_step_refusal([MicroBatch(base, 1, 0.0)] * 3).condition == "micro_batches"
    assert trainer.lens_step_refusal([MicroBatch({}, 1, 0.0)] * 2).condition == "no_rollout_ids"


def test_callback_arguments_are_checked():
    with pytest.raises(ValueError, match="every_n_steps"):
        LensTRLCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="tolerance"):
        LensTRLCallback(tolerance=-1)
    assert LensTRLCallback(tolerance=0).tolerance == 0.0  # as ConservationCheckCallback takes it
    with pytest.raises(ValueError, match="capture"):
        LensTRLCallback(capture="later")


def test_old_option_names_warn_and_map_to_the_shared_ones():
    with pytest.warns(FutureWarning, match="`ride_along` is deprecated.*use `capture`"):
        assert LensTRLCallback(ride_along=False).capture == "separate"
    with pytest.warns(FutureWarning, match="`max_parts` is deprecated.*use `max_logged_parts`"):
        assert LensTRLCallback(max_parts=3).max_logged_parts == 3
    with pytest.raises(ValueError, match="give only `capture`"):
        LensTRLCallback(ride_along=True, capture="separate")
    assert LensTRLCallback(engine=None).engine == "auto"


def test_the_example_runs_offline_with_the_audit(tmp_path, capsys):
    from lens_callbacks.examples.trl_grpo import main

    trainer = main(["--steps", "2", "--lora", "--loss-type", "bnpo", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "credit by by_rollout" in out and "step conservation" in out
    assert trainer.state.global_step == 2


def test_bf16_audit_repeats_the_training_arithmetic_and_reads_at_the_bf16_floor(policy_dir, tmp_path):
    # bf16=True: accelerate wraps the model's forward in autocast, so the audit's forward is the training one.
    cb = LensTRLCallback(conservation=False)
    _train(policy_dir, tmp_path, callbacks=[cb], lora=False, bf16=True, max_steps=1, **HARD)
    ((_, report),) = cb.history
    assert isinstance(report, CreditReport)
    assert report.grad_match <= 1e-6, report.grad_match
    # Each part's backward runs through bf16 matmuls: the parts add up to g_full only to bf16's resolution
    # (unit roundoff 2^-8 ≈ 3.9e-3), far above fp32's ~1e-7.
    assert 1e-5 < report.conservation_error < 2.0**-8, report.conservation_error


@pytest.mark.parametrize("ride", [False, True], ids=["separate", "ride"])
def test_the_less_common_loss_options_are_re_derived_too(policy_dir, tmp_path, ride):
    # high-entropy token mask, off-policy sequence mask, two-sided delta clip, bias-corrected KL and
    # adaptive entropy control (its coefficient moves after each step's last micro-batch).
    cb = LensTRLCallback(capture="training_step" if ride else "separate")
    trainer = _train(
        policy_dir,
        tmp_path,
        callbacks=[cb],
        loss_type="grpo",
        max_steps=4,
        top_entropy_quantile=0.5,
        off_policy_mask_threshold=1e-4,
        delta=1.05,
        use_bias_correction_kl=True,
        use_adaptive_entropy=True,
        entropy_target=10.0,
        entropy_coef_delta=0.05,
        **HARD,
    )
    assert trainer.entropy_coef > trainer.args.entropy_coef  # the controller did move it
    for (step, report), (_, reading) in zip(cb.history, cb.conservation_history):
        assert isinstance(report, CreditReport), report.render()
        _exact(cb, report, ride)
        assert report.conservation_error <= 1e-6 and abs(report.share_sum - 1) <= 1e-6
        assert isinstance(reading, ConservationReading) and reading.relative_error <= 1e-6, reading


@pytest.mark.parametrize("ride", [False, True], ids=["separate", "ride"])
def test_groups_and_rewards_survive_the_shuffle_and_split(policy_dir, tmp_path, ride):
    # steps_per_generation = accumulation: each step trains one whole shuffled generation batch, so a group's
    # rows lie in both micro-batches (riding along, the step is read once after the second backward).
    cb = LensTRLCallback(partition="by_group", capture="training_step" if ride else "separate")
    trainer = _train(policy_dir, tmp_path, callbacks=[cb], loss_type="grpo", max_steps=1, num_iterations=1, **HARD)
    ((_, report),) = cb.history
    assert isinstance(report, CreditReport)
    _exact(cb, report, ride)
    assert report.conservation_error <= 1e-6 and abs(report.share_sum - 1) <= 1e-6
    assert report.n_parts == 2, report.part_names  # 8 rows = 2 prompts x 4 generations
    micro = trainer._lens_micro
    assert len(micro) == 2
    rows = {
        k: torch.cat([mb.inputs[k] for mb in micro])
        for k in ("lens_rollout", "lens_group", "lens_reward", "advantages")
    }
    completions = torch.cat([mb.inputs["completion_ids"] for mb in micro])
    prompts = torch.cat([mb.inputs["prompt_ids"] for mb in micro])
    assert sorted(rows["lens_rollout"].tolist()) == list(range(8))
    assert set(micro[0].inputs["lens_group"].tolist()) & set(micro[1].inputs["lens_group"].tolist())  # a group in both
    tok = tiny_tokenizer()
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    # the reward each row carries is the reward function on that row's own completion
    expected = torch.tensor(digit_reward(texts)) * 1000.0
    torch.testing.assert_close(rows["lens_reward"], expected, rtol=1e-6, atol=1e-4)
    for g in rows["lens_group"].unique():
        sel = rows["lens_group"] == g
        # one prompt per group, and TRL's advantage is the reward minus the group's mean (scale_rewards="none")
        assert len({tuple(p.tolist()) for p in prompts[sel]}) == 1
        torch.testing.assert_close(rows["advantages"][sel], rows["lens_reward"][sel] - rows["lens_reward"][sel].mean())


def test_a_refused_audit_is_logged_and_training_goes_on(policy_dir, tmp_path):
    # A loss type the adapter does not know: the audit is refused at every step, the run completes, and
    # the conservation check falls back to holding the update against .grad (clipped, as the optimizer got it).
    cls = type("UnknownLoss", (AuditedGRPO,), {"lens_loss_type": "not_a_loss"})
    cb = LensTRLCallback()
    trainer = _train(policy_dir, tmp_path, cls=cls, callbacks=[cb], max_steps=2, **HARD)
    assert trainer.state.global_step == 2
    assert [r.condition for _, r in cb.history] == ["loss_type", "loss_type"]
    for _, reading in cb.conservation_history:
        assert isinstance(reading, ConservationReading) and reading.source == "grad"
        assert reading.relative_error <= 1e-6, reading.render()
    logged = [h for h in trainer.state.log_history if "credit/refused" in h]
    assert [h["credit/refused"] for h in logged] == [1.0, 1.0]
    assert all(h["conservation/refused"] == 0.0 for h in logged)


def test_engine_is_passed_only_to_a_disintegrate_that_takes_it(policy_dir, tmp_path, monkeypatch, caplog):
    import lens_callbacks.integrations.trl as adapter

    real = adapter.disintegrate
    seen = []

    def with_engine(module, batch, partition="by_rollout", *, engine="reference", **kw):
        seen.append(engine)
        return real(module, batch, partition, **kw)  # the reference engine, whatever was asked

    import inspect

    if "engine" not in inspect.signature(real).parameters:
        # a disintegrate without engines: the reference engine runs and the request is noted once
        cb_old = LensTRLCallback(engine="ghost", conservation=False, capture="separate")
        _train(policy_dir, tmp_path / "a", callbacks=[cb_old], max_steps=1, **HARD)
        assert isinstance(cb_old.history[0][1], CreditReport)
        assert any("engine='ghost' ignored" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(adapter, "disintegrate", with_engine)
    cb_new = LensTRLCallback(engine="auto", conservation=False, capture="separate")
    _train(policy_dir, tmp_path / "b", callbacks=[cb_new], max_steps=1, **HARD)
    assert seen == ["auto"] and cb_new.history[0][1].grad_match <= 1e-6


def test_a_moe_policy_with_an_aux_loss_is_refused_and_trains_on(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = tiny_tokenizer()
    config = Qwen2MoeConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    path = str(tmp_path / "moe")
    Qwen2MoeForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    cb = LensTRLCallback()
    trainer = _train(path, tmp_path, callbacks=[cb], lora=False, max_steps=1)
    assert trainer.state.global_step == 1
    ((_, refusal),) = cb.history
    assert isinstance(refusal, Refusal) and refusal.condition == "moe_aux_loss"
    assert refusal.numbers["router_aux_loss_coef"] == 0.01
    ((_, reading),) = cb.conservation_history  # held against .grad, which carries the aux loss
    assert isinstance(reading, ConservationReading) and reading.source == "grad"


# --- riding on TRL's own forward and backward ---------------------------------------------------------


def _same_readings(a, b, tol=1e-6):
    assert a.part_names == b.part_names and a.n_trained == b.n_trained
    for x, y in ((a.projected_share, b.projected_share), (a.norm_share, b.norm_share), (a.part_norm, b.part_norm)):
        assert max(abs(u - v) / max(1.0, abs(v)) for u, v in zip(x, y)) <= tol, (x, y)
    assert abs(a.cancellation - b.cancellation) <= tol * b.cancellation
    assert abs(a.full_grad_norm - b.full_grad_norm) <= tol * b.full_grad_norm
    assert a.conservation_error <= 1e-6 and b.conservation_error <= 1e-6
    if b.gram is None:  # the reference engine forms the Gram only when it keeps the parts
        assert b.engine == "reference"
        return
    ga, gb = torch.tensor(a.gram, dtype=torch.float64), torch.tensor(b.gram, dtype=torch.float64)
    assert torch.allclose(ga, gb, rtol=tol, atol=tol * float(gb.abs().max()))


def _ride_and_separate(policy_dir, tmp_path, separate=None, **kw):
    """The same run twice from the same seed, riding along and by the separate pass (``separate``: the
    separate callback's other arguments): ``(callback, trainer)`` each."""
    runs = []
    for ride in (True, False):
        cb = LensTRLCallback(capture="training_step" if ride else "separate", **({} if ride else separate or {}))
        torch.manual_seed(7)
        runs.append((cb, _train(policy_dir, tmp_path / str(ride), callbacks=[cb], **kw)))
    return runs


@pytest.mark.parametrize(
    ("loss_type", "accum"), [("grpo", 1), ("luspo", 1), ("grpo", 2)]
)  # dapo: the bit-identity test
def test_riding_along_reads_what_the_separate_pass_reads(policy_dir, tmp_path, loss_type, accum):
    # LoRA (the fused LM head is frozen), beta 0.1, entropy bonus, clipping, SGD; at accumulation 2 each
    # micro-batch is captured on its own backward and the step is read once after the last one.
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    kw = dict(
        loss_type=loss_type,
        max_steps=2,
        gradient_accumulation_steps=accum,
        per_device_train_batch_size=8 // accum,
        **HARD,
        **extra,
    )
    (rode, tr), (sep, _) = _ride_and_separate(policy_dir, tmp_path, **kw)
    assert rode.ride_reason is None and sep.ride_reason == "capture='separate'"
    assert len(rode.history) == 2 == len(sep.history)
    for (_, a), (_, b) in zip(rode.history, sep.history):
        assert isinstance(a, CreditReport) and isinstance(b, CreditReport)
        assert a.engine == "ghost+training_step" and b.engine.startswith("ghost")
        # the separate pass runs TRL's forward once per micro-batch; `batch_rows` stacks the calls: no fallback
        assert "fallback" not in dict(b.coverage), b.coverage
        assert a.n_parts == 8
        _same_readings(a, b)
    # step conservation holds the update against the ride-along parts' sum
    for (_, x), (_, y) in zip(rode.conservation_history, sep.conservation_history):
        assert isinstance(x, ConservationReading) and x.source == "credit_parts"
        assert x.relative_error <= 1e-6 and abs(x.relative_error - y.relative_error) <= 1e-6
    logged = [h["credit/ride_along"] for h in tr.state.log_history if "credit/ride_along" in h]
    assert logged == [1.0, 1.0]


@pytest.fixture(scope="module")
def tied_policy_dir(tmp_path_factory):
    return save_policy(str(tmp_path_factory.mktemp("trl_tied") / "policy"), tie=True)


@pytest.mark.parametrize(
    ("accum", "tied", "engine"),
    [(1, False, "reference"), (1, True, "reference"), (2, True, "reference"), (1, True, "ghost"), (2, True, "ghost")],
)
def test_full_fine_tuning_rides_along_the_fused_lm_head(policy_dir, tied_policy_dir, tmp_path, accum, tied, engine):
    # The head is trained and TRL's fused LM head reads it outside the layer: its use is recorded by the
    # fused-head capture (tied: beside the embedding's use of the same weight). Held against the reference
    # engine (one backward per part, no capture: independent of the head's recorded pieces), and against the
    # one-pass separate pass, whose capture records the head the same way (at accumulation 2: once per
    # micro-batch, each call under its micro-batch's `batch_rows` span, stacked into one).
    policy_dir = tied_policy_dir if tied else policy_dir
    kw = dict(
        lora=False,
        gradient_accumulation_steps=accum,
        per_device_train_batch_size=8 // accum,
        loss_type="grpo",
        max_steps=2,
        **HARD,
    )
    (rode, tr), (sep, _) = _ride_and_separate(policy_dir, tmp_path, separate={"engine": engine}, **kw)
    assert rode.ride_reason is None, rode.ride_reason
    assert (tr.model.get_output_embeddings().weight is tr.model.get_input_embeddings().weight) == tied
    head = "embedding+fused_lm_head" if tied else "fused_lm_head"  # tied: one weight, both uses read together
    for (_, a), (_, b) in zip(rode.history, sep.history):
        assert isinstance(a, CreditReport) and a.engine == "ghost+training_step", a
        assert isinstance(b, CreditReport) and b.engine == engine and b.grad_match <= 1e-6
        assert dict(a.coverage)[head] > 0, a.coverage
        if engine == "ghost":
            assert dict(b.coverage)[head] > 0 and "fallback" not in dict(b.coverage), b.coverage
        assert a.n_parts == 8
        _same_readings(a, b)
    for (_, x), (_, y) in zip(rode.conservation_history, sep.conservation_history):
        # a full model's float32 update rounds at ~3e-6 of itself (its precision floor); LoRA's at ~1e-7
        assert x.holds and x.relative_error <= x.update_precision_floor, x.render()
        assert abs(x.relative_error - y.relative_error) <= 1e-6


@pytest.mark.parametrize("capture", ["training_step", "separate"])
def test_reading_keeps_no_capture_alive_after_the_step(policy_dir, tmp_path, capture):
    # The fused head's tile callback, the ride's gradient hooks and the one-pass engine's hooks sit in the
    # graph; none may keep a capture (its inputs activation-sized) or a ride alive once the step is read.
    def live() -> int:
        gc.collect()
        return sum(type(o).__name__ in ("_Use", "_Ride", "RideAlong", "RowCapture") for o in gc.get_objects())

    before = live()
    cb = LensTRLCallback(capture=capture, engine="ghost")
    torch.manual_seed(7)
    _train(policy_dir, tmp_path, callbacks=[cb], lora=False, loss_type="grpo", max_steps=2, **HARD)
    assert all(isinstance(r, CreditReport) and r.engine.startswith("ghost") for _, r in cb.history), cb.history
    assert len(cb.history) == 2 and cb.ride_reason == (None if capture == "training_step" else "capture='separate'")
    assert live() == before


@pytest.mark.parametrize("accum", [1, 2])
def test_full_fine_tuning_riding_along_is_bit_identical_to_training_without_the_adapter(policy_dir, tmp_path, accum):
    kw = dict(
        lora=False,
        loss_type="dapo",
        max_steps=2,
        gradient_accumulation_steps=accum,
        per_device_train_batch_size=8 // accum,
        **HARD,
    )
    torch.manual_seed(123)
    plain = _train(policy_dir, tmp_path / "plain", cls=GRPOTrainer, **kw)
    torch.manual_seed(123)
    cb = LensTRLCallback()
    audited = _train(policy_dir, tmp_path / "audited", callbacks=[cb], **kw)
    assert cb.ride_reason is None and all(r.engine == "ghost+training_step" for _, r in cb.history)
    a, b = dict(plain.model.named_parameters()), dict(audited.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    losses = lambda tr: [h["loss"] for h in tr.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(audited) and len(losses(plain)) == 2


def test_a_micro_batch_that_cannot_ride_sends_the_whole_step_to_the_separate_pass(policy_dir, tmp_path, monkeypatch):
    # The second micro-batch's terms fail in the training forward: nothing of the first is read alone.
    calls = []
    real = AuditedGRPO._lens_micro_terms

    def second_fails(self, mb):
        calls.append(len(self._lens_micro))
        if self._lens_given_forward is not None and len(self._lens_micro) == 2:
            raise RuntimeError("no terms for this micro-batch")
        return real(self, mb)

    monkeypatch.setattr(AuditedGRPO, "_lens_micro_terms", second_fails)
    cb = LensTRLCallback()
    tr = _train(
        policy_dir,
        tmp_path,
        callbacks=[cb],
        loss_type="grpo",
        max_steps=1,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        **HARD,
    )
    ((_, report),) = cb.history
    assert isinstance(report, CreditReport) and report.engine == "ghost" and report.grad_match <= 1e-6
    assert "no terms for this micro-batch" in cb.ride_reason, cb.ride_reason
    assert tr._lens_rides == []  # the first micro-batch's captures were let go


@pytest.mark.parametrize("accum", [1, 2])
def test_training_riding_along_is_bit_identical_to_training_without_the_adapter(policy_dir, tmp_path, accum):
    kw = dict(
        loss_type="dapo", max_steps=3, gradient_accumulation_steps=accum, per_device_train_batch_size=8 // accum, **HARD
    )
    torch.manual_seed(123)
    plain = _train(policy_dir, tmp_path / "plain", cls=GRPOTrainer, **kw)
    rng_plain = torch.get_rng_state()
    torch.manual_seed(123)
    cb = LensTRLCallback()
    audited = _train(policy_dir, tmp_path / "audited", callbacks=[cb], **kw)
    rng_audited = torch.get_rng_state()
    assert cb.ride_reason is None and all(r.engine == "ghost+training_step" for _, r in cb.history)
    a = dict(plain.model.named_parameters())
    b = dict(audited.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(rng_plain, rng_audited)
    losses = lambda tr: [h["loss"] for h in tr.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(audited) and len(losses(plain)) == 3


def test_a_wrong_normaliser_stops_the_ride_and_grad_match_catches_it(policy_dir, tmp_path):
    # grpo's per-row token mean read with luspo's per-row sum: the terms' gradient at the log-probabilities
    # is not the one TRL's loss sent there, so the step is read by the separate pass, where grad_match shows it.
    cls = type("WrongNormaliser", (AuditedGRPO,), {"lens_loss_type": "luspo"})
    cb = LensTRLCallback(conservation=False)
    _train(
        policy_dir,
        tmp_path,
        cls=cls,
        callbacks=[cb],
        loss_type="grpo",
        max_steps=1,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=8,
        **HARD,
    )
    ((_, report),) = cb.history
    assert "differs from TRL's loss gradient" in cb.ride_reason, cb.ride_reason
    assert report.engine == "ghost" and report.grad_match > 0.1
