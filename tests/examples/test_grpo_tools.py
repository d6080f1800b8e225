"""The tool-using GRPO example, its record, and the offline audit (function and console script).

References are independent: the calculator against Python's own sum over the words, log-probabilities
by one forward pass per prefix without padding, the offline audit against the live callback's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lightning.pytorch import Trainer  # noqa: E402

from lens_callbacks.callbacks.records import RunRecordCallback  # noqa: E402
from lens_callbacks.commands.audit import audit_record, load_module, replay_to  # noqa: E402
from lens_callbacks.examples.grpo_tools import GRPOToolsModule, ToolsAdditionDataModule, group_advantages  # noqa: E402
from lens_callbacks.examples.grpo_tools.env import VOCAB  # noqa: E402
from lens_callbacks.io.records import RunRecord  # noqa: E402
from lens_callbacks.io.trust import TrustPolicy  # noqa: E402
from lens_callbacks.refusal import Refusal  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _fit(module, steps, tmp_path, checkpoint_every=0, data=None, **cb):
    trainer = Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
        callbacks=[RunRecordCallback(str(tmp_path / "record"), checkpoint_every=checkpoint_every, **cb)],
    )
    trainer.fit(module, data or ToolsAdditionDataModule(prompts_per_step=2))
    return RunRecord(tmp_path / "record")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    m = GRPOToolsModule(seed=0)
    return m, _fit(m, 4, d, checkpoint_every=0)


def _py_calc(args: str) -> str:
    words = args.split()
    if not words or any(w != "+" and not w.isdigit() for w in words) or not any(w.isdigit() for w in words):
        return "error"
    total = sum(int(w) for w in words if w.isdigit())
    return str(total) if total <= 19 else "error"


def test_episodes_are_multi_turn_with_tool_turns_untrained(run):
    m, rec = run
    trajs = [t for s in rec.steps for t in rec.trajectories(s)]
    assert len(trajs) == 4 * 8
    # the system turn is fixed text, so it does not count towards the episode's turns
    mean_turns = sum(sum(x.role != "system" for x in t.turns) for t in trajs) / len(trajs)
    calling = sum(any(x.tool_call is not None for x in t.turns) for t in trajs)
    calls = sum(t.n_tool_calls for t in trajs)
    print(
        f"\nexcluding the system turn: mean turns {mean_turns:.2f}; {calling} of {len(trajs)} trajectories call "
        f"the tool ({calls} calls); mean reward {sum(t.reward for t in trajs) / len(trajs):.3f}"
    )
    assert mean_turns >= 3
    assert calling >= 2 * len(trajs) / 3  # tool use is the common case, not an accident
    for t in trajs:
        roles = [x.role for x in t.turns]
        assert roles[:3] == ["system", "user", "assistant"] and roles[-1] == "assistant"
        for j, turn in enumerate(t.turns):
            assert turn.trained == (turn.role == "assistant")
            if turn.role == "tool":
                prev = t.turns[j - 1]
                assert prev.role == "assistant" and prev.tool_call is not None and prev.tool_call.name == "calc"
                assert turn.text == _py_calc(prev.tool_call.arguments)
        assert sum(x.tool_call is not None for x in t.turns) == roles.count("tool") <= m.hparams.max_tool_calls


def test_warm_start_is_deterministic_trains_only_in_fit_and_leaves_the_global_stream():
    a, b = GRPOToolsModule(seed=5, warm_start_steps=8), GRPOToolsModule(seed=5, warm_start_steps=8)
    init = {k: v.clone() for k, v in a.state_dict().items()}
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in init.items())  # construction trains nothing
    state = torch.get_rng_state()
    la = a.warm_start()
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(321)  # a different global stream changes nothing
    lb = b.warm_start()
    assert la == lb and len(la) == 8 and la[-1] < la[0]
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert not all(torch.equal(v, a.state_dict()[k]) for k, v in init.items())
    assert all(p.grad is None for p in a.parameters()) and a.policy.training
    assert GRPOToolsModule(seed=5, warm_start_steps=0).warm_start() == []
    with pytest.raises(ValueError, match="`warm_start_steps` must be an int >= 0"):
        GRPOToolsModule(warm_start_steps=-1)


def test_warm_start_loss_against_a_per_prefix_loop():
    """The first step's loss is the mean −log π over the demonstrations' assistant tokens at the initial weights."""
    from lens_callbacks.examples.grpo_tools.env import demonstration
    from lens_callbacks.examples.grpo_tools.module import _WARM_START_STREAM, WARM_START_BATCH

    m = GRPOToolsModule(seed=6, warm_start_steps=1, dtype="float64")
    gen = torch.Generator().manual_seed(6 * 1_000_003 + _WARM_START_STREAM)
    ab = torch.randint(0, 10, (WARM_START_BATCH, 2), generator=gen).tolist()
    nll, n = 0.0, 0
    with torch.no_grad():
        for a, b in ab:
            turns = demonstration(m.tokenizer, a, b, system_prompt=m.hparams.system_prompt)
            assert [t.role for t in turns] == ["system", "user", "assistant", "tool", "assistant"]
            ids = [i for t in turns for i in t.token_ids]
            trained = [t.role == "assistant" for t in turns for _ in t.token_ids]
            for pos in range(1, len(ids)):
                if trained[pos]:
                    logits = m.policy(input_ids=torch.tensor([ids[:pos]])).logits[0, -1]
                    nll -= float(torch.log_softmax(logits, -1)[ids[pos]])
                    n += 1
    (loss,) = m.warm_start()
    assert abs(loss - nll / n) <= 1e-12


def test_sampling_depends_on_seed_and_step_only_and_leaves_the_global_stream(run):
    m, _ = run
    prompts = ToolsAdditionDataModule().prompts()[:2]
    state = torch.get_rng_state()
    a = m.rollout(prompts, step=5)
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(123)
    b = m.rollout(prompts, step=5)
    assert [t.turns for t in a] == [t.turns for t in b]
    assert [t.turns for t in a] != [t.turns for t in m.rollout(prompts, step=6)]


def test_dropout_masks_are_seeded_by_step_and_drawn_again_by_every_evaluation():
    m = GRPOToolsModule(seed=3, dropout=0.3, warm_start_steps=0, dtype="float64")
    m.train()
    prompts = ToolsAdditionDataModule().prompts()[:2]
    state = torch.get_rng_state()
    a = m.rollout(prompts, step=4)
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(99)  # the open stream does not reach the step's sampling or its masks
    b = m.rollout(prompts, step=4)
    assert [t.turns for t in a] == [t.turns for t in b]
    rb = m.make_rollout_batch(a)
    assert rb.dropout_seed == m.dropout_seed(4) != m.dropout_seed(5)
    state = torch.get_rng_state()
    t1, t2 = m.credit_terms(rb).terms, m.credit_terms(m.make_rollout_batch(b)).terms
    assert torch.equal(t1, t2) and torch.equal(state, torch.get_rng_state())
    # dropout is on: another seed draws other masks, and eval mode none
    other = m.credit_terms(dataclasses.replace(rb, dropout_seed=m.dropout_seed(5))).terms
    m.eval()
    plain = m.credit_terms(rb).terms
    assert not torch.equal(t1, other) and not torch.equal(t1, plain)
    with pytest.raises(ValueError, match="`trajectories` must all come from one step"):
        m.make_rollout_batch(a[:1] + m.rollout(prompts, step=5)[:1])


def _assert_replay_from_step_0_meets_every_checkpoint(rec, steps):
    """Replaying from the step-0 policy alone (no later checkpoint) equals each recorded checkpoint, bit for bit."""
    view = RunRecord(rec.run_dir)
    view.manifest["checkpoints"] = [0]
    for s in steps:
        back = replay_to(view, s, progress=False)
        ck = rec.load_policy(s)
        assert all(torch.equal(v, ck[k]) for k, v in back.state_dict().items()), f"step {s}"


def test_dropout_run_replays_bit_for_bit_from_the_record(tmp_path):
    """With dropout the recorded step rebuilds its batch's seed, so replaying from step 0 meets every checkpoint."""
    kw = dict(seed=2, dropout=0.1, optimizer="adam", lr=3e-3, warm_start_steps=0)
    rec = _fit(GRPOToolsModule(**kw), 3, tmp_path, checkpoint_every=1)
    assert [rec.step_meta(s)["dropout_seed"] for s in rec.steps] == [
        GRPOToolsModule(**kw).dropout_seed(s) for s in rec.steps
    ]
    _assert_replay_from_step_0_meets_every_checkpoint(rec, (1, 2, 3))


def test_credit_terms_against_a_per_prefix_loop(run):
    """terms[k, t] = −A_k log π(y_t | y_<t) / N on trained positions, by one unpadded forward per prefix."""
    m, rec = run
    m = load_module(rec, 0)
    m.policy.double()
    trajs = rec.trajectories(0)
    rb = m.make_rollout_batch(trajs)
    terms = m.credit_terms(rb)
    adv = group_advantages(
        torch.tensor([t.reward for t in trajs], dtype=torch.float64), torch.tensor([t.group for t in trajs])
    )
    n = sum(len(x.token_ids) for t in trajs for x in t.turns if x.role == "assistant")
    assert terms.n_trained == n
    with torch.no_grad():
        for k, t in enumerate(trajs):
            ids = [i for x in t.turns for i in x.token_ids]
            trained = [x.role == "assistant" for x in t.turns for _ in x.token_ids]
            for pos in range(len(ids)):
                if not trained[pos]:
                    assert terms.terms[k, pos] == 0
                    continue
                logits = m.policy(input_ids=torch.tensor([ids[:pos]])).logits[0, -1]
                ref = -adv[k] * torch.log_softmax(logits, -1)[ids[pos]] / n
                assert abs(float(terms.terms[k, pos]) - float(ref)) <= 1e-12
            assert not terms.terms[k, len(ids) :].any()
    assert len(VOCAB) == m.policy.config.vocab_size


def test_replay_from_step0_reaches_the_weights_training_had(tmp_path):
    """Momentum SGD (a stateful optimizer): the replay starts at step 0 and meets a second, shorter run."""
    kw = dict(seed=1, optimizer="sgd", momentum=0.9, lr=0.05)
    rec = _fit(GRPOToolsModule(**kw), 3, tmp_path / "a", checkpoint_every=1)
    short = GRPOToolsModule(**kw)
    _fit(short, 2, tmp_path / "b")
    rec.manifest["checkpoints"] = [0, 1]  # a checkpoint after 0 must not be used with momentum
    back = replay_to(rec, 2, progress=False)
    assert all(torch.equal(v, short.state_dict()[k]) for k, v in back.state_dict().items())


class _Unseeded(GRPOToolsModule):
    """The example as a module that does not keep its batches' dropout seed (masks from the open stream)."""

    def make_rollout_batch(self, trajectories):
        return dataclasses.replace(super().make_rollout_batch(trajectories), dropout_seed=None)


def test_audit_refuses_what_it_cannot_replay(tmp_path):
    m = _Unseeded(seed=1, dropout=0.1)
    rec = _fit(m, 2, tmp_path)
    assert all("dropout_seed" not in rec.step_meta(s) for s in rec.steps)
    trust = TrustPolicy(allow_modules=(_Unseeded.__module__,))
    r = audit_record(rec.run_dir, 1, "by_turn", progress=False, module=_Unseeded(seed=1, dropout=0.1), trust=trust)
    assert isinstance(r, Refusal) and r.condition == "dropout"
    # at a checkpointed step nothing needs replaying
    ok = audit_record(rec.run_dir, 0, "by_role", "float64", progress=False, trust=trust)
    assert not isinstance(ok, Refusal) and ok.share("tool" if "tool" in ok.part_names else "user") == 0.0
    with pytest.raises(ValueError, match="`step` must be a recorded step"):
        audit_record(rec.run_dir, 7, progress=False, trust=trust)


def test_single_turn_example_records_and_replays_bit_for_bit(tmp_path):
    """lens_callbacks.examples.grpo (Adam, dropout) through RunRecordCallback: replaying from step 0 meets every checkpoint."""
    from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule

    torch.manual_seed(0)
    m = GRPOModule(n_layer=1, n_embd=16, n_head=2, dropout=0.1, optimizer="adam", lr=3e-3)
    rec = _fit(
        m,
        3,
        tmp_path,
        checkpoint_every=1,
        data=AdditionDataModule(batch_size=2),
        batch_builder="lens_callbacks.examples.grpo_tools.single_turn.grpo_rollout_batch",
    )
    assert all("dropout_seed" in rec.step_meta(s) for s in rec.steps)
    t = rec.trajectories(1)[0]
    assert [x.role for x in t.turns] == ["user", "assistant"] and t.turns[1].trained
    _assert_replay_from_step_0_meets_every_checkpoint(rec, (1, 2, 3))
    with pytest.raises(ValueError, match="`by_turn` needs"):  # the single-turn module reports no turn segments
        audit_record(rec.run_dir, 2, "by_turn", "float64", progress=False)
    r = audit_record(rec.run_dir, 2, "by_rollout", "float64", progress=False)
    assert r.n_parts == 8 and (not r.ok or r.conservation_error <= 1e-14)


@pytest.mark.slow
def test_yaml_run_then_offline_audit_matches_the_live_audit(tmp_path, run_cli):
    run_cli(
        "fit",
        "--config",
        ROOT / "cli_configs" / "grpo_tools_turns.yaml",
        "--trainer.max_steps=3",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
        check=True,
    )
    version = tmp_path / "runs" / "grpo_tools" / "version_0"
    live = (version / "credit_last.txt").read_text()
    assert live.startswith("step 2\n")
    # by name, as a user types it (the registered partition is the same function as the import path)
    a = run_cli("audit", version / "record", "--step", "2", "--partition", "by_turn", "--no-progress", check=True)
    # the per-part rows of the offline table are the live ones: same weights (replayed), same batch (recorded)
    rows = lambda text: [ln for ln in text.splitlines() if ln.startswith("turn_")]  # noqa: E731
    assert rows(a.stdout) and rows(a.stdout) == rows(live)


class _Scheduled(GRPOToolsModule):
    """The example with a step-wise LR schedule (halves the rate after every step)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"},
        }


def test_replay_uses_the_recorded_learning_rates(tmp_path):
    rec = _fit(_Scheduled(seed=2, lr=0.2), 3, tmp_path, checkpoint_every=1)
    assert [rec.step_meta(s)["lr"] for s in rec.steps] == [[0.2], [0.1], [0.05]]
    view = RunRecord(rec.run_dir)
    view.manifest["checkpoints"] = [0]
    back = replay_to(view, 3, _Scheduled(seed=2, lr=0.2), progress=False)
    ck = rec.load_policy(3)
    assert all(torch.equal(v, ck[k]) for k, v in back.state_dict().items())


def test_audit_console_script_prints_the_report(run, capsys, monkeypatch):
    from lens_callbacks.cli import main

    _, rec = run
    monkeypatch.chdir(ROOT)
    assert (
        main(
            ["audit", str(rec.run_dir), "--step", "2", "--partition", "by_role", "--dtype", "float64", "--no-progress"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "credit by by_role" in out and "assistant" in out and "conservation_error" in out
    assert main(["audit", str(rec.run_dir), "--partition", "by_turn", "--json", "--no-progress"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["credit/share_sum"] == pytest.approx(1.0, abs=1e-5)
    shares = {k: v for k, v in d.items() if k.startswith("credit/projected_share/")}
    assert shares and all(v == 0.0 for k, v in shares.items() if not k.endswith(":assistant"))
    assert main(["audit", str(rec.run_dir), "--step", "99", "--no-progress"]) == 2
    assert "`step` must be a recorded step" in capsys.readouterr().err
    # not a record at all: the message names the directory and how to write one, no traceback
    assert main(["audit", str(ROOT / "docs"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lens-callbacks audit: ") and "RunRecordCallback" in err


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_replay_clips_gradients_as_the_trainer_did(tmp_path, algorithm):
    m = GRPOToolsModule(seed=4, lr=0.5)
    trainer = Trainer(
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        gradient_clip_val=0.01,
        gradient_clip_algorithm=algorithm,
        callbacks=[RunRecordCallback(str(tmp_path / "record"), checkpoint_every=1)],
    )
    trainer.fit(m, ToolsAdditionDataModule(prompts_per_step=2))
    rec = RunRecord(tmp_path / "record")
    assert rec.manifest["trainer"]["gradient_clip_algorithm"] == algorithm
    view = RunRecord(rec.run_dir)
    view.manifest["checkpoints"] = [0]
    back = replay_to(view, 3, progress=False)
    ck = rec.load_policy(3)
    assert all(torch.equal(v, ck[k]) for k, v in back.state_dict().items())
    # and the clip mattered: without it the replay lands elsewhere
    view.manifest["trainer"] = dict(view.manifest["trainer"], gradient_clip_val=None)
    loose = replay_to(view, 3, progress=False)
    assert not all(torch.equal(v, ck[k]) for k, v in loose.state_dict().items())


def test_env_doctests():
    """The calculator's and the demonstration's documented examples."""
    import doctest

    import lens_callbacks.examples.grpo_tools.env as env

    res = doctest.testmod(env)
    assert res.attempted >= 2 and res.failed == 0
