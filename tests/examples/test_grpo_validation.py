"""The GRPO example's validation set: greedy accuracy against a one-prompt-at-a-time loop, and no effect on training."""

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lens_callbacks.examples.grpo import AdditionDataModule, GRPOModule


def _greedy_reference(m: GRPOModule, a: int, b: int) -> str:
    """Obviously correct: one prompt, no padding, the full forward at every token, argmax over allowed tokens."""
    ids = m.tokenizer(f"{a}+{b}=")["input_ids"]
    out = []
    m.policy.eval()
    with torch.no_grad():
        for _ in range(m.max_new_tokens):
            logits = m.policy(input_ids=torch.tensor([ids])).logits[0, -1].double()
            allowed = [i for i in range(logits.shape[0]) if i not in (m.pad_id, m.unk_id)]
            nxt = max(allowed, key=lambda i: (float(logits[i]), -i))
            if nxt == m.eos_id:
                break
            ids.append(nxt)
            out.append(nxt)
    m.policy.train()
    return m.tokenizer.decode(out, skip_special_tokens=True)


def _fit(num_val, steps=4, val_every=None):
    seed_everything(0, verbose=False)
    m, d = GRPOModule(dropout=0.1), AdditionDataModule(num_val_prompts=num_val)
    kw = {} if val_every is None else {"val_check_interval": val_every, "check_val_every_n_epoch": None}
    t = Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kw,
    )
    t.fit(m, d)
    return m, d, t


def test_val_accuracy_is_the_greedy_accuracy_and_training_is_unchanged():
    ref, _, _ = _fit(0)
    m, d, t = _fit(24, val_every=2)
    # validating (twice, plus the sanity check) draws no random number: the trained weights are bitwise the same
    assert all(torch.equal(x, y) for x, y in zip(ref.state_dict().values(), m.state_dict().values()))
    pairs = d.val_pairs.tolist()
    assert len(pairs) == 24
    got = m.greedy_answers(d.val_pairs)
    want = [_greedy_reference(m, a, b) for a, b in pairs]
    assert got == want
    acc = sum(ans == str(a + b) for ans, (a, b) in zip(want, pairs)) / len(pairs)
    assert float(t.callback_metrics["val/accuracy"]) == pytest.approx(acc, abs=1e-7)


def test_no_validation_by_default_and_a_bad_size_is_an_error():
    from lightning.pytorch.utilities.model_helpers import is_overridden

    assert not is_overridden("val_dataloader", AdditionDataModule())
    assert is_overridden("val_dataloader", AdditionDataModule(num_val_prompts=4))
    with pytest.raises(ValueError, match="num_val_prompts"):
        AdditionDataModule(num_val_prompts=-1)
