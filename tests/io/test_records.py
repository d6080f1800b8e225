"""The run record: schema, round trip bit for bit, the writer/reader, and RunRecordCallback."""

from __future__ import annotations

import json

import pytest
import torch

from lens_callbacks.credit.inputs.trajectories import ToolCall, Trajectory, Turn, batch_from_trajectories, turn_segments
from lens_callbacks.io.records import (
    TRAJECTORY_SCHEMA,
    RunRecord,
    RunRecordWriter,
    read_trajectories,
    step_path,
    trajectory_from_json,
    trajectory_to_json,
    write_trajectories,
)
from lens_callbacks.refusal import Refusal
from tests._spawn_exit import DestroyGroupAtExit


class Chars:
    pad_token_id = 0

    def encode(self, text):
        return [ord(c) for c in text]


def _trajs():
    return [
        Trajectory(
            (
                Turn("system", "tools: calc"),
                Turn("user", "7 + 5 = ?  é✓"),
                Turn("assistant", "calc 7 + 5", (101, 7, 3, 5), tool_call=ToolCall("calc", "7 + 5")),
                Turn("tool", "12"),
                Turn("assistant", "12", (12,)),
            ),
            reward=0.1 + 0.2,  # not a short decimal: the round trip must keep every bit
            group=0,
            rollout=0,
            prompt_id="7+5",
            step=3,
        ),
        Trajectory(
            (Turn("user", "hi"), Turn("assistant", "yo")), reward=-1e-300, group=1, rollout=1, prompt_id="p1", step=3
        ),
    ]


def _tensors(batch, seg):
    return [
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.trained,
        batch.rollout,
        batch.group,
        batch.rewards,
        seg.ids,
    ]


def test_round_trip_rebuilds_the_same_batch_bit_for_bit(tmp_path):
    trajs = _trajs()
    path = write_trajectories(tmp_path / "s.jsonl", trajs, step=3)
    back = read_trajectories(path)
    for side in ("right", "left"):
        a = batch_from_trajectories(Chars(), trajs, padding_side=side)
        b = batch_from_trajectories(Chars(), back, padding_side=side)
        for x, y in zip(_tensors(*a), _tensors(*b)):
            assert x.dtype == y.dtype and torch.equal(x, y)
        assert a[1].roles == b[1].roles and turn_segments(a[1])[1] == turn_segments(b[1])[1]
    assert back[0].reward == 0.1 + 0.2 and back[1].reward == -1e-300
    assert back[0].turns[2].tool_call == ToolCall("calc", "7 + 5")
    assert back[0].turns[1].text == "7 + 5 = ?  é✓"


def test_lines_follow_the_contract_schema(tmp_path):
    write_trajectories(tmp_path / "s.jsonl", _trajs(), step=3)
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    d = lines[0]
    assert d["schema"] == TRAJECTORY_SCHEMA == "lens_callbacks.trajectory/1"
    assert set(d) == {"schema", "step", "group", "rollout", "prompt_id", "reward", "turns"}
    assert [t["role"] for t in d["turns"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert [t["trained"] for t in d["turns"]] == [False, False, True, False, True]
    assert d["turns"][2]["tool_call"] == {"name": "calc", "arguments": "7 + 5"} and d["turns"][3]["tool_call"] is None
    assert set(d["turns"][0]) == {"role", "text", "token_ids", "trained", "tool_call"}


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(schema="other/1"), "`schema` must be"),
        (lambda d: d["turns"][0].update(role="narrator"), "`role` must be one of"),
        (lambda d: d.pop("reward"), "field `reward` is missing"),
        (lambda d: d["turns"][0].update(token_ids=[1, "2"]), "`token_ids` must be a list of ints"),
        (lambda d: d["turns"][0].update(trained="yes"), "`trained` must be true/false"),
        (lambda d: d["turns"][0].update(tool_call="calc"), "`tool_call` must be null"),
        (lambda d: d.update(group="0"), "field `group` must be int"),
    ],
)
def test_bad_lines_are_clear_errors_naming_the_line(tmp_path, edit, match):
    d = trajectory_to_json(_trajs()[0])
    edit(d)
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(trajectory_to_json(_trajs()[1])) + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ValueError, match=match) as err:
        read_trajectories(p)
    assert "bad.jsonl:2" in str(err.value)


def test_non_finite_reward_is_refused_at_write_time():
    t = Trajectory((Turn("user", "a"), Turn("assistant", "b")), reward=float("nan"))
    with pytest.raises(ValueError, match="`reward` must be finite"):
        trajectory_to_json(t)


def test_writer_and_reader(tmp_path):
    w = RunRecordWriter(tmp_path / "run", checkpoint_every=2)
    w.write_manifest(module="pkg.M", init_args={"lr": 0.5, "betas": (0.9, 0.99)})
    state = {"w": torch.arange(3.0), "b": torch.tensor([1.5], dtype=torch.float64)}
    w.write_policy(0, state)
    for s in range(3):
        w.write_step(s, _trajs())
    assert [w.wants_checkpoint(s) for s in range(5)] == [True, False, True, False, True]
    r = RunRecord(tmp_path / "run")
    assert r.steps == [0, 1, 2] and r.checkpoints == [0]
    assert r.manifest["init_args"] == {"lr": 0.5, "betas": [0.9, 0.99]}
    loaded = r.load_policy(0)
    assert set(loaded) == {"w", "b"} and all(
        torch.equal(loaded[k], state[k]) and loaded[k].dtype == state[k].dtype for k in state
    )
    assert r.nearest_checkpoint(2) == 0
    assert step_path(tmp_path / "run", 2).name == "step_000002.jsonl"
    assert [t.step for t in r.trajectories(1)] == [1, 1]
    with pytest.raises(ValueError, match="`step` must be a recorded step"):
        r.trajectories(9)
    with pytest.raises(ValueError, match="no policy checkpoint at step 1"):
        r.load_policy(1)
    with pytest.raises(ValueError, match="`run_dir` must hold a run record"):
        RunRecord(tmp_path / "nothing")
    with pytest.raises(ValueError, match="already holds a record"):
        RunRecordWriter(tmp_path / "run", overwrite=False)


def test_from_json_keeps_unset_token_ids_unset():
    d = trajectory_to_json(_trajs()[0])
    t = trajectory_from_json(d)
    assert t.turns[0].token_ids is None and t.turns[2].token_ids == (101, 7, 3, 5)


# --------------------------------------------------------------------------------------- the callback
def test_callback_writes_every_step_and_the_step0_policy(tmp_path):
    pytest.importorskip("transformers")
    from lightning.pytorch import Trainer

    from lens_callbacks.callbacks.records import RunRecordCallback
    from lens_callbacks.examples.grpo_tools import GRPOToolsModule, ToolsAdditionDataModule

    torch.manual_seed(0)
    m = GRPOToolsModule(seed=3)
    fresh = GRPOToolsModule(seed=3)  # the same seed builds the same initial policy and warm start
    fresh.warm_start()
    fresh = fresh.state_dict()
    cb = RunRecordCallback(str(tmp_path / "rec"), checkpoint_every=2)
    trainer = Trainer(
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    trainer.callbacks.append(cb)
    trainer.fit(m, ToolsAdditionDataModule(prompts_per_step=1))
    rec = RunRecord(tmp_path / "rec")
    assert rec.steps == [0, 1, 2] and rec.checkpoints == [0, 2]
    assert rec.manifest["module"] == "lens_callbacks.examples.grpo_tools.module.GRPOToolsModule"
    assert rec.manifest["init_args"]["seed"] == 3
    assert rec.manifest["optimizer"][0]["class"] == "torch.optim.sgd.SGD"
    assert rec.manifest["trainer"]["accumulate_grad_batches"] == 1
    p0 = rec.load_policy(0)
    assert set(p0) == set(fresh) and all(torch.equal(p0[k], fresh[k]) for k in fresh)
    last = rec.trajectories(2)
    assert len(last) == m.hparams.group_size and all(t.step == 2 for t in last)
    assert [t.turns for t in last] == [t.turns for t in m.last_trajectories]
    assert [t.reward for t in last] == [t.reward for t in m.last_trajectories]


def test_callback_reads_single_turn_rollouts():
    from lens_callbacks.callbacks.records import trajectories_of

    class M:
        last_rollouts = [
            {
                "prompt": "1 + 2 =",
                "completion": "3",
                "prompt_ids": [4, 5],
                "completion_ids": torch.tensor([6]),
                "reward": 1.0,
                "group": 2,
                "rollout": 5,
            },
        ]

    (t,) = trajectories_of(M(), 7)
    assert [x.role for x in t.turns] == ["user", "assistant"]
    assert t.turns[0].token_ids == (4, 5) and t.turns[1].token_ids == (6,)
    assert (t.group, t.rollout, t.step, t.reward) == (2, 5, 7, 1.0)


def test_callback_warns_once_when_the_module_exposes_no_rollouts(tmp_path):
    from lightning.pytorch import LightningModule, Trainer

    from lens_callbacks.callbacks.records import RunRecordCallback

    class Plain(LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - 1.0).pow(2).sum()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = RunRecordCallback(str(tmp_path / "rec"))
    trainer = Trainer(
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[cb],
        default_root_dir=str(tmp_path),
    )
    with pytest.warns(UserWarning, match="neither `last_trajectories` nor `last_rollouts`") as caught:
        trainer.fit(Plain())
    assert sum("last_trajectories" in str(w.message) for w in caught) == 1  # once, not every step
    assert trainer.global_step == 3 and cb.steps_written == 0 and RunRecord(tmp_path / "rec").steps == []


def test_callback_refuses_gradient_accumulation():
    from lightning.pytorch import Trainer

    from lens_callbacks.callbacks.records import RunRecordCallback

    trainer = Trainer(accumulate_grad_batches=2, logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.raises(ValueError, match="`accumulate_grad_batches` must be 1"):
        RunRecordCallback("x").setup(trainer, None, "fit")
    with pytest.raises(ValueError, match="`checkpoint_every` must be an int"):
        RunRecordCallback("x", checkpoint_every=-1)


def _ddp_fit(run_dir):
    from lightning.pytorch import Trainer

    from lens_callbacks.callbacks.records import RunRecordCallback
    from lens_callbacks.examples.grpo_tools import GRPOToolsModule, ToolsAdditionDataModule

    trainer = Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        default_root_dir=str(run_dir),
        callbacks=[RunRecordCallback(str(run_dir / "rec")), DestroyGroupAtExit()],
    )
    trainer.fit(GRPOToolsModule(seed=0, group_size=2), ToolsAdditionDataModule(prompts_per_step=1))


@pytest.mark.slow
@pytest.mark.timeout(300)  # a collective reached by some ranks only would hang, not fail
def test_callback_under_ddp_gathers_every_rank(tmp_path):
    pytest.importorskip("transformers")
    _ddp_fit(tmp_path)
    rec = RunRecord(tmp_path / "rec")
    assert rec.steps == [0, 1] and rec.manifest["trainer"]["world_size"] == 2
    for s in rec.steps:
        trajs = rec.trajectories(s)
        # 2 ranks x 1 prompt x group_size 2, renumbered so ids stay unique within the step
        assert [t.rollout for t in trajs] == [0, 1, 2, 3] and [t.group for t in trajs] == [0, 0, 1, 1]
    from lens_callbacks.commands.audit import audit_record

    r = audit_record(rec.run_dir, 1, progress=False)
    assert isinstance(r, Refusal) and r.condition == "world_size"


def test_merge_ranks_renumbers():
    from lens_callbacks.callbacks.records import _merge_ranks

    t = lambda g, r: Trajectory((Turn("user", "a"), Turn("assistant", "b")), group=g, rollout=r)  # noqa: E731
    out = _merge_ranks([[t(0, 0), t(1, 1)], [], [t(0, 0)]])
    assert [(x.group, x.rollout) for x in out] == [(0, 0), (1, 1), (2, 2)]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_turn = st.builds(
    Turn,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    text=st.text(min_size=1, max_size=8),
    token_ids=st.one_of(st.none(), st.lists(st.integers(0, 2**31), min_size=1, max_size=4).map(tuple)),
    trained=st.one_of(st.none(), st.booleans()),
    tool_call=st.one_of(st.none(), st.builds(ToolCall, st.text(max_size=5), st.text(max_size=10))),
)


@settings(max_examples=25, deadline=None)
@given(
    trajs=st.lists(
        st.builds(
            Trajectory,
            turns=st.lists(_turn, min_size=1, max_size=5).map(tuple),
            reward=st.floats(allow_nan=False, allow_infinity=False),
            group=st.integers(0, 5),
            rollout=st.integers(0, 100),
            prompt_id=st.text(max_size=6),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_trajectory_round_trips_exactly(tmp_path_factory, trajs):
    path = write_trajectories(tmp_path_factory.mktemp("rt") / "s.jsonl", trajs, step=4)
    back = read_trajectories(path)
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back):
        assert (b.reward, b.group, b.rollout, b.prompt_id, b.step) == (a.reward, a.group, a.rollout, a.prompt_id, 4)
        for x, y in zip(a.turns, b.turns, strict=True):
            resolved = x.trained if x.trained is not None else x.role == "assistant"
            assert (y.role, y.text, y.token_ids, y.trained, y.tool_call) == (
                x.role,
                x.text,
                x.token_ids,
                resolved,
                x.tool_call,
            )
