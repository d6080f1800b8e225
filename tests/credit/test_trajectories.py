"""batch_from_trajectories, turn_segments and the turn partitions against obviously-correct loops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_callbacks.credit.inputs.terms import CreditTerms
from lens_callbacks.credit.inputs.trajectories import (
    ROLES,
    ToolCall,
    Trajectory,
    Turn,
    batch_from_trajectories,
    by_role,
    by_turn,
    encode_text,
    turn_claim_support,
    turn_segments,
)
from lens_callbacks.refusal import Refusal


class Chars:
    """Any object with an encode-style call: one id per character."""

    pad_token_id = 0

    def encode(self, text):
        return [ord(c) for c in text]


def _traj(*turns, **kw):
    return Trajectory(tuple(Turn(r, t) for r, t in turns), **kw)


# --------------------------------------------------------------------------------------- basics
def test_turns_are_tokenised_on_their_own_and_masked_by_role():
    t = _traj(
        ("system", "s"),
        ("user", "ab"),
        ("assistant", "cd"),
        ("tool", "e"),
        ("assistant", "f"),
        rollout=7,
        group=3,
        reward=0.5,
    )
    batch, seg = batch_from_trajectories(Chars(), [t])
    assert batch.input_ids.tolist() == [[ord(c) for c in "sabcdef"]]
    assert seg.ids.tolist() == [[0, 1, 1, 2, 2, 3, 4]]
    assert batch.trained.tolist() == [[False, False, False, True, True, False, True]]
    assert seg.roles == (("system", "user", "assistant", "tool", "assistant"),)
    assert seg.spans == (((0, 1), (1, 3), (3, 5), (5, 6), (6, 7)),)
    assert batch.rollout.tolist() == [7] and batch.group.tolist() == [3] and batch.rewards.tolist() == [0.5]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_side_moves_rows_not_their_masks(side):
    short = _traj(("user", "a"), ("assistant", "b"))
    long = _traj(("user", "abc"), ("assistant", "de"), ("tool", "f"), ("assistant", "g"))
    batch, seg = batch_from_trajectories(Chars(), [short, long], padding_side=side, pad_token_id=-5)
    assert batch.shape == (2, 7)
    row = batch.attention_mask[0].bool()
    assert row.sum() == 2
    assert (
        (row.nonzero().flatten().tolist() == [0, 1])
        if side == "right"
        else (row.nonzero().flatten().tolist() == [5, 6])
    )
    assert batch.input_ids[0][row].tolist() == [ord("a"), ord("b")]
    assert batch.input_ids[0][~row].eq(-5).all()
    assert batch.trained[0][row].tolist() == [False, True] and not batch.trained[0][~row].any()
    assert seg.ids[0][~row].eq(-1).all()
    assert batch.position_ids[0][row].tolist() == [0, 1]


def test_recorded_token_ids_win_over_text_unless_told_otherwise():
    t = Trajectory((Turn("user", "ab"), Turn("assistant", "cd", token_ids=(1, 2, 3))))
    b, _ = batch_from_trajectories(Chars(), [t])
    assert b.input_ids.tolist() == [[97, 98, 1, 2, 3]]
    b2, _ = batch_from_trajectories(Chars(), [t], use_token_ids=False)
    assert b2.input_ids.tolist() == [[97, 98, 99, 100]]


def test_train_roles_and_per_turn_flags():
    t = Trajectory((Turn("user", "a"), Turn("assistant", "b"), Turn("tool", "c", trained=True)))
    b, _ = batch_from_trajectories(Chars(), [t])
    assert b.trained.tolist() == [[False, True, True]]
    b2, _ = batch_from_trajectories(Chars(), [t], train_roles=("assistant",))
    assert b2.trained.tolist() == [[False, True, False]]


def test_works_with_transformers_and_tokenizers_objects():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<pad>": 0, "hi": 1, "there": 2, "yo": 3}, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>")
    t = _traj(("user", "hi there"), ("assistant", "yo"))
    b1, _ = batch_from_trajectories(fast, [t])
    b2, _ = batch_from_trajectories(raw, [t], pad_token_id=0)
    assert b1.input_ids.tolist() == b2.input_ids.tolist() == [[1, 2, 3]]
    assert encode_text(raw, "there hi") == [2, 1]


# --------------------------------------------------------------------------------------- the merge trap
def _bpe():
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))  # no pre-tokenizer: merges may span anything
    trainer = trainers.BpeTrainer(vocab_size=48, special_tokens=["<pad>", "<unk>"], show_progress=False)
    tok.train_from_iterator(["2+2=4", "3+1=4", "1+3=4", "2+1=3", "=4", "=3"] * 50, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def test_merge_trap_joined_string_merges_across_turns_per_turn_does_not():
    tok = _bpe()
    user, assistant = "2+2=", "4"
    boundary = len(user)
    joined = tok(user + assistant, add_special_tokens=False, return_offsets_mapping=True)
    crossing = [(s, e) for s, e in joined["offset_mapping"] if s < boundary < e]
    assert crossing, f"the BPE should merge across the boundary, got {tok.convert_ids_to_tokens(joined['input_ids'])}"
    # A turn decomposition on the joined ids gives the merged token to the turn it starts in (user):
    # the assistant's answer would carry no trained position at all.
    starts_in_assistant = [s >= boundary for s, _ in joined["offset_mapping"]]
    assert not any(starts_in_assistant)

    batch, seg = batch_from_trajectories(tok, [_traj(("user", user), ("assistant", assistant))])
    ids = batch.input_ids[0].tolist()
    u_ids = tok.encode(user, add_special_tokens=False)
    a_ids = tok.encode(assistant, add_special_tokens=False)
    assert ids == u_ids + a_ids != joined["input_ids"]
    # every token lies inside its own turn: the pieces at each turn's positions spell that turn's text
    for j, text in enumerate((user, assistant)):
        assert "".join(tok.convert_ids_to_tokens([i for i, s in zip(ids, seg.ids[0].tolist()) if s == j])) == text
    assert batch.trained[0].tolist() == [False] * len(u_ids) + [True] * len(a_ids)


# --------------------------------------------------------------------------------------- errors
def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="`role` must be one of"):
        Turn("narrator", "x")
    with pytest.raises(ValueError, match="at least one trajectory"):
        batch_from_trajectories(Chars(), [])
    with pytest.raises(ValueError, match="has no turns"):
        batch_from_trajectories(Chars(), [Trajectory(())])
    with pytest.raises(ValueError, match="tokenises to nothing"):
        batch_from_trajectories(Chars(), [_traj(("user", "a"), ("assistant", ""))])
    with pytest.raises(ValueError, match="starts with a trained token"):
        batch_from_trajectories(Chars(), [_traj(("assistant", "a"), ("user", "b"))])
    with pytest.raises(ValueError, match="over max_length=3"):
        batch_from_trajectories(Chars(), [_traj(("user", "ab"), ("assistant", "cd"))], max_length=3)
    with pytest.raises(ValueError, match="`padding_side` must be one of"):
        batch_from_trajectories(Chars(), [_traj(("user", "a"), ("assistant", "b"))], padding_side="middle")
    with pytest.raises(ValueError, match="`truncation` must be one of"):
        batch_from_trajectories(Chars(), [_traj(("user", "a"), ("assistant", "b"))], truncation="drop")

    class NoPad:
        def encode(self, text):
            return [1] * len(text)

    with pytest.raises(ValueError, match="`pad_token_id` must be given"):
        batch_from_trajectories(NoPad(), [_traj(("user", "a"), ("assistant", "b"))])
    with pytest.raises(TypeError, match="`tokenizer` must have an `encode"):
        batch_from_trajectories(object(), [_traj(("user", "a"), ("assistant", "b"))], pad_token_id=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_cuts_tokens_mask_and_turns_together(side):
    t = _traj(("user", "abc"), ("assistant", "de"), ("tool", "f"), ("assistant", "gh"))
    full, fseg = batch_from_trajectories(Chars(), [t])
    cut, cseg = batch_from_trajectories(Chars(), [t], max_length=6, truncation=side)
    sl = slice(2, 8) if side == "left" else slice(0, 6)
    assert cut.input_ids[0].tolist() == full.input_ids[0, sl].tolist()
    assert cut.trained[0].tolist() == full.trained[0, sl].tolist()
    assert cseg.ids[0].tolist() == fseg.ids[0, sl].tolist()
    assert cseg.truncated == (2,)
    for j, (a, b) in enumerate(cseg.spans[0]):  # each span covers exactly its turn's surviving positions
        where = (cseg.ids[0] == j).nonzero().flatten().tolist()
        assert list(range(a, b)) == where


# --------------------------------------------------------------------------------------- properties
_turn = st.tuples(st.sampled_from(ROLES), st.lists(st.integers(1, 50), min_size=1, max_size=4))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.lists(_turn, min_size=1, max_size=5), min_size=1, max_size=4),
    side=st.sampled_from(["left", "right"]),
)
def test_batch_matches_a_plain_loop(rows, side):
    trajs = []
    for k, turns in enumerate(rows):
        turns = [("user", [9])] + turns  # open with an untrained turn
        trajs.append(Trajectory(tuple(Turn(r, "x", tuple(ids)) for r, ids in turns), rollout=k))
    batch, seg = batch_from_trajectories(Chars(), trajs, padding_side=side)
    T = max(sum(len(t.token_ids) for t in tr.turns) for tr in trajs)
    assert batch.shape == (len(trajs), T)
    for k, tr in enumerate(trajs):
        ids, trained, turn = [], [], []
        for j, t in enumerate(tr.turns):
            ids += list(t.token_ids)
            trained += [t.role == "assistant"] * len(t.token_ids)
            turn += [j] * len(t.token_ids)
        real = batch.attention_mask[k].bool()
        assert batch.input_ids[k][real].tolist() == ids
        assert batch.trained[k][real].tolist() == trained
        assert seg.ids[k][real].tolist() == turn
        assert not batch.trained[k][~real].any() and seg.ids[k][~real].eq(-1).all()
        for j, (s, e) in enumerate(seg.spans[k]):
            assert seg.ids[k, s:e].eq(j).all() and e - s == len(tr.turns[j].token_ids)
    # turn_segments(by="turn") names every turn once and keeps each position's turn
    segment, names = turn_segments(seg, "turn", rollout=batch.rollout)
    assert len(names) == sum(len(t.turns) for t in trajs) == len(set(names))
    for k, tr in enumerate(trajs):
        for j, t in enumerate(tr.turns):
            n = names.index(f"rollout_{k}/turn_{j}:{t.role}")
            assert segment[k][seg.ids[k] == j].eq(n).all()


# --------------------------------------------------------------------------------------- partitions
def _terms(trajs, by):
    batch, seg = batch_from_trajectories(Chars(), trajs)
    segment, names = turn_segments(seg, by, rollout=batch.rollout)
    terms = torch.where(batch.trained, torch.ones(batch.shape), torch.zeros(batch.shape))
    return CreditTerms(terms, batch.trained, batch.rollout, batch.group, segment, names)


def test_by_turn_names_untrained_turns_as_empty_parts():
    trajs = [
        _traj(("system", "s"), ("user", "ab"), ("assistant", "c"), ("tool", "d"), ("assistant", "ef"), rollout=0),
        _traj(("user", "g"), ("assistant", "h"), rollout=1),
    ]
    terms = _terms(trajs, "turn")
    p = by_turn(terms)
    p.check_covers(terms.trained)
    assert p.names == (
        "rollout_0/turn_0:system",
        "rollout_0/turn_1:user",
        "rollout_0/turn_2:assistant",
        "rollout_0/turn_3:tool",
        "rollout_0/turn_4:assistant",
        "rollout_1/turn_0:user",
        "rollout_1/turn_1:assistant",
    )
    sizes = [int(p.mask(i).sum()) for i in range(p.n_parts)]
    assert sizes == [0, 0, 1, 0, 2, 0, 1]
    r = by_role(terms)
    r.check_covers(terms.trained)
    assert r.names == ("system", "user", "assistant", "tool")
    assert [int(r.mask(i).sum()) for i in range(r.n_parts)] == [0, 0, 4, 0]
    # by="role" segments give the same role partition
    assert torch.equal(by_role(_terms(trajs, "role")).ids, r.ids)
    ti = _terms(trajs, "turn_index")
    assert ti.segment_names == tuple(f"turn_{j}" for j in range(5))


def test_by_turn_needs_segments():
    t = CreditTerms(torch.zeros(1, 2), torch.tensor([[False, True]]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="`by_turn` needs"):
        by_turn(t)


def test_turn_claim_support_refuses_a_two_turn_record():
    two = [_traj(("user", "a"), ("assistant", "b"), rollout=k) for k in range(4)]
    r = turn_claim_support(two)
    assert isinstance(r, Refusal) and r.condition == "single_trained_turn"
    assert r.numbers["mean_turns"] == 2.0 and r.numbers["n_tool_calls"] == 0
    multi = two + [
        Trajectory(
            (
                Turn("user", "a"),
                Turn("assistant", "b", tool_call=ToolCall("calc", "1")),
                Turn("tool", "1"),
                Turn("assistant", "c"),
            )
        )
    ]
    ok, reason = turn_claim_support(multi)
    assert ok is True and "1 of 5" in reason


def test_left_truncation_never_leaves_a_trained_token_without_context():
    t = _traj(("user", "abc"), ("assistant", "de"), ("tool", "f"), ("assistant", "gh"))
    with pytest.raises(ValueError, match="starts with a trained token"):
        batch_from_trajectories(Chars(), [t], max_length=5, truncation="left")
