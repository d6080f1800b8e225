"""The GRPO example: sampling inside the step, group-normalised advantages, and credit terms that ARE the loss.

References are deliberately naive: rewards re-derived from token ids through an independent vocabulary,
advantages in numpy, log-probabilities by one forward pass per prefix with no padding or mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import lightning.pytorch as pl

from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule, RolloutBatch
from lens_callbacks.examples.grpo.task import build_tokenizer, reward

SMALL = dict(n_layer=1, n_embd=16, n_head=2, group_size=4, max_new_tokens=3)


def _trainer(callbacks=(), steps=2, **kw):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kw,
    )


def _ref_reward(a: int, b: int, completion_ids: list[int]) -> float:
    # Independent of the task module: its own vocabulary (digits start at id 3, [EOS] is 1).
    inv = {3 + i: str(i) for i in range(10)}
    inv.update({13: "+", 14: "="})
    ended = len(completion_ids) > 0 and completion_ids[-1] == 1
    body = completion_ids[:-1] if ended else completion_ids
    text = "".join(inv.get(i, "?") for i in body)
    r = 1.0 if text.isdigit() and int(text) == a + b and text == str(int(text)) else 0.0
    return r + (0.1 if ended and text.isdigit() else 0.0)


def test_tokenizer_is_one_token_per_character_and_round_trips():
    tok = build_tokenizer()
    text = "17+3=90"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    expected = [3 + int(c) if c.isdigit() else {"+": 13, "=": 14}[c] for c in text]
    assert ids == expected
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text


@pytest.mark.parametrize(
    "a,b,comp", [(3, 4, [10, 1]), (3, 4, [11, 1]), (9, 9, [4, 11, 1]), (9, 9, [4, 11, 5]), (0, 0, [13, 1]), (2, 2, [])]
)
def test_reward_matches_reference(a, b, comp):
    tok = build_tokenizer()
    ended = bool(comp) and comp[-1] == tok.eos_token_id
    text = tok.decode(comp[:-1] if ended else comp, skip_special_tokens=True)
    assert reward(a, b, text, ended) == pytest.approx(_ref_reward(a, b, comp), abs=0)


def test_rollouts_rewards_and_advantages_against_reference():
    torch.manual_seed(0)
    m = GRPOModule(**SMALL)
    pairs = torch.tensor([[1, 2], [4, 4], [9, 0]])  # [P, 2]
    rb, rollouts = m.sample_rollouts(pairs)
    P, G = 3, 4
    assert rb.input_ids.shape[0] == P * G and len(rollouts) == P * G
    assert rb.group.tolist() == [k // G for k in range(P * G)]
    assert rb.rollout.tolist() == list(range(P * G))
    lp = rb.prompt_len
    for k, ro in enumerate(rollouts):
        a, b = pairs[k // G].tolist()
        assert ro.prompt == f"{a}+{b}=" and ro.group == k // G and ro.rollout == k
        row = rb.input_ids[k].tolist()
        assert list(ro.prompt_ids) == row[:lp]
        # trained positions = the completion up to and including the first [EOS]
        assert list(ro.completion_ids) == rb.input_ids[k][rb.completion_mask[k]].tolist()
        comp = row[lp:]
        n = comp.index(1) + 1 if 1 in comp else len(comp)
        assert list(ro.completion_ids) == comp[:n]
        assert all(t == 0 for t in comp[n:])  # [PAD] after [EOS]
        assert ro.reward == pytest.approx(_ref_reward(a, b, comp[:n]), abs=0)
        assert float(rb.rewards[k]) == pytest.approx(ro.reward, rel=1e-7)  # stored in the policy dtype
    r = np.array([ro.reward for ro in rollouts]).reshape(P, G)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(rb.advantages.numpy(), adv.reshape(-1), rtol=1e-6, atol=1e-6)


def test_credit_terms_equal_a_prefix_by_prefix_reference_loss():
    torch.manual_seed(1)
    m = GRPOModule(**SMALL, dtype="float64").eval()
    rb, _ = m.sample_rollouts(torch.tensor([[2, 3], [5, 1]]))
    # Make sure some advantages are non-zero so the comparison is not 0 == 0.
    rb.advantages = torch.linspace(-1.0, 1.5, rb.batch_size, dtype=torch.float64)
    ct = m.credit_terms(rb)
    B = rb.batch_size
    assert ct.terms.dtype == torch.float64 and ct.terms.shape == rb.input_ids.shape
    assert torch.equal(ct.trained, rb.completion_mask)
    assert torch.all(ct.terms[~ct.trained] == 0)
    assert torch.equal(ct.tokens, rb.input_ids) and torch.equal(ct.rewards, rb.rewards)
    ref = np.zeros(tuple(rb.input_ids.shape))
    with torch.no_grad():
        for k in range(B):
            pos = rb.completion_mask[k].nonzero().flatten().tolist()
            for t in pos:
                logits = m.policy(input_ids=rb.input_ids[k : k + 1, :t]).logits[0, -1]  # [V]
                logp = torch.log_softmax(logits, -1)[rb.input_ids[k, t]].item()
                ref[k, t] = -rb.advantages[k].item() * logp / (len(pos) * B)
    np.testing.assert_allclose(ct.terms.detach().numpy(), ref, rtol=1e-10, atol=1e-13)


def test_dropout_is_replayed_per_batch_and_leaves_the_global_stream_alone():
    torch.manual_seed(2)
    m = GRPOModule(**SMALL, dropout=0.3).train()
    rb, _ = m.sample_rollouts(torch.tensor([[1, 1], [2, 2]]))
    state = torch.get_rng_state()
    t1 = m.credit_terms(rb).terms
    t2 = m.credit_terms(rb).terms
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(t1, t2)
    rb.dropout_seed += 1
    assert not torch.equal(m.credit_terms(rb).terms, t1)  # dropout is really on


def test_seed_fixes_initial_weights_without_touching_the_global_stream():
    state = torch.get_rng_state()
    a, b, c = GRPOModule(**SMALL, seed=3), GRPOModule(**SMALL, seed=3), GRPOModule(**SMALL, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    pa, pb, pc = (torch.cat([p.flatten() for p in x.parameters()]) for x in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert all(p.dtype == torch.float64 for p in GRPOModule(**SMALL, dtype="float64").parameters())


class _LossProbe(pl.Callback):
    """Records the loss the step trained on and what credit_terms(None) adds up to before the update."""

    def __init__(self):
        self.rows = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with torch.no_grad():
            self._terms_sum = pl_module.credit_terms(None).terms.sum()
        self._batch_size = pl_module.last_rollout_batch.batch_size

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pairs = batch[0]
        prompts = [r.prompt for r in pl_module.last_rollouts]
        G = pl_module.group_size
        expected = [f"{a}+{b}=" for a, b in pairs.tolist() for _ in range(G)]
        self.rows.append((outputs["loss"].detach(), self._terms_sum, self._batch_size, prompts == expected))


def test_training_step_loss_is_the_sum_of_credit_terms_with_dropout_on():
    pl.seed_everything(5)
    m = GRPOModule(**SMALL, dropout=0.2)
    probe = _LossProbe()
    _trainer([probe], steps=3).fit(m, AdditionDataModule(batch_size=2))
    assert len(probe.rows) == 3
    for loss, terms_sum, B, same_prompts in probe.rows:
        assert torch.equal(loss, terms_sum)  # same function, same dropout masks: bit for bit
        assert B == 2 * SMALL["group_size"] and same_prompts


@pytest.mark.parametrize(
    "opt,cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)]
)
def test_optimizer_choice(opt, cls):
    m = GRPOModule(**SMALL, optimizer=opt, lr=0.01, momentum=0.5 if opt == "sgd" else 0.0, weight_decay=0.1)
    o = m.configure_optimizers()
    assert type(o) is cls and o.param_groups[0]["lr"] == 0.01 and o.param_groups[0]["weight_decay"] == 0.1
    if opt == "sgd":
        assert o.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"optimizer": "rmsprop"}, "'rmsprop'"),
        ({"dtype": "bfloat16"}, "'bfloat16'"),
        ({"group_size": 1}, "`group_size`"),
        ({"temperature": 0.0}, "`temperature`"),
        ({"n_embd": 30, "n_head": 4}, "n_embd=30"),
        ({"init_std": 0.0}, "`init_std`.*0.0"),
        ({"init_std": "wide"}, "`init_std`.*'wide'"),
    ],
)
def test_module_errors_name_the_bad_value(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        GRPOModule(**{**SMALL, **kw})


def test_init_std_is_the_spread_of_the_initial_weights():
    # GPT-2 draws its embeddings from N(0, initializer_range²): the sample std of the token embedding
    # (15 × n_embd values) follows the option, and the default stays GPT-2's own 0.02.
    for std in (0.02, 0.1):
        kw = {} if std == 0.02 else {"init_std": std}
        wte = GRPOModule(**SMALL, **kw).policy.transformer.wte.weight.detach().double()  # [V, D]
        assert wte.std().item() == pytest.approx(std, rel=0.15), (std, wte.std().item())


def test_datamodule_is_seeded_and_checks_its_arguments():
    a, b = AdditionDataModule(data_seed=1), AdditionDataModule(data_seed=1)
    assert torch.equal(a.pairs, b.pairs) and int(a.pairs.max()) <= 9 and int(a.pairs.min()) >= 0
    assert [x[0].tolist() for x in a.train_dataloader()] == [x[0].tolist() for x in b.train_dataloader()]
    with pytest.raises(ValueError, match="`max_operand`.*12"):
        AdditionDataModule(max_operand=12)


def test_rollout_batch_is_recognised_and_none_uses_the_cached_one():
    torch.manual_seed(3)
    m = GRPOModule(**SMALL).eval()
    with pytest.raises(RuntimeError, match="rollout batch"):
        m.credit_terms(None)
    rb, _ = m.sample_rollouts(torch.tensor([[1, 2]]))
    m.last_rollout_batch = rb
    assert isinstance(rb, RolloutBatch)
    assert torch.equal(m.credit_terms(None).terms, m.credit_terms(rb).terms)
    assert torch.equal(m.credit_terms({"not": "a rollout batch"}).terms, m.credit_terms(rb).terms)


def test_task_and_module_doctests():
    import doctest

    import lens_callbacks.examples.grpo.module as module
    import lens_callbacks.examples.grpo.task as task

    res = doctest.testmod(task)
    assert res.attempted >= 2 and res.failed == 0
    res = doctest.testmod(module)  # grpo_advantages, against a hand value
    assert res.attempted >= 1 and res.failed == 0
