"""A dumped SkyRL step audited by rollout and by group with a tiny policy: the audit closes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from skyrl_fixtures import CURRENT, FIX, LEGACY  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel

from lens_callbacks.credit import disintegrate
from lens_callbacks.io import read_skyrl_dump
from lens_callbacks.io.skyrl_credit import (
    SkyRLCreditSource,
    audit_skyrl_dump,
    compact_vocabulary,
    skyrl_credit_batch,
)

DUMPS = {"current": CURRENT, "legacy": LEGACY}
pytestmark = pytest.mark.skipif(not FIX.is_dir(), reason=f"SkyRL fixtures not found at {FIX}")


def _policy(vocab: int) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=vocab,
        n_layer=2,
        n_embd=16,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):  # seeded weights, the suite's random stream left alone
        torch.default_generator.manual_seed(0)
        return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module", params=["current", "legacy"])
def setup(request):
    torch.set_num_threads(1)
    dump = read_skyrl_dump(DUMPS[request.param])
    vocab = compact_vocabulary(dump)
    return dump, vocab, _policy(len(vocab))


@pytest.mark.parametrize("partition", ["by_rollout", "by_group"])
def test_conservation_float64_and_float32(setup, partition):
    dump, vocab, policy = setup
    r64 = audit_skyrl_dump(policy, dump, partition, dtype="float64", token_map=vocab)
    r32 = audit_skyrl_dump(policy, dump, partition, dtype="float32", token_map=vocab)
    assert r64.dtype == "float64" and r32.dtype == "float32"
    assert r64.conservation_error <= 1e-14, r64.render()
    assert r32.conservation_error <= 1e-6, r32.render()
    n_parts = 12 if partition == "by_rollout" else 3
    assert r64.n_parts == n_parts and r64.share_sum == pytest.approx(1.0, abs=1e-12)
    assert r64.n_trained == int(dump.batch["loss_mask"].sum())  # row 9's observation tokens are not trained
    # prompt B's rows (4-7) have zero advantage: no credit at all
    zero_parts = [f"rollout_{k}" for k in range(4, 8)] if partition == "by_rollout" else ["group_1"]
    for name in zero_parts:
        assert r64.share(name) == 0.0 and r64.part_norm[r64.part_names.index(name)] == 0.0


def test_terms_equal_an_unpadded_per_row_loop(setup):
    """The batched, padded objective against one forward per row over its real tokens only."""
    dump, vocab, policy = setup
    policy = copy.deepcopy(policy).double()
    source = SkyRLCreditSource(policy, "token_mean")
    batch = skyrl_credit_batch(dump, vocab)
    with torch.no_grad():
        terms = source.credit_terms(batch)
        S, R = dump.sequence_width, dump.response_width
        per_row, n_trained = [], float(dump.batch["loss_mask"].sum())
        for k in range(dump.n_rows):
            row = []
            att = dump.batch["attention_mask"][k]
            cols = [c for c in range(S) if att[c] == 1]  # real columns, in order
            ids = torch.tensor([[vocab[int(dump.batch["sequences"][k, c])] for c in cols]])
            logits = policy(input_ids=ids).logits[0].double()  # [n_real, V]
            lp = torch.log_softmax(logits, -1)
            for j in range(R):
                if dump.batch["loss_mask"][k, j] == 1:
                    i = cols.index(S - R + j)  # the response token's place among the real tokens
                    a = float(dump.batch["advantages"][k, j])
                    row.append(-a * float(lp[i - 1, ids[0, i]]) / n_trained)
            per_row.append(math.fsum(row))
    # row by row, so a term moved to another row (a misaligned response window) cannot cancel out
    assert terms.terms.sum(dim=1).tolist() == pytest.approx(per_row, abs=1e-12)
    assert terms.trained.sum() == int(n_trained)
    assert torch.equal(terms.tokens, dump.response_tokens())
    assert torch.equal(terms.rewards, dump.advantages_per_row())


def test_reductions_and_rows(setup):
    dump, vocab, policy = setup
    batch = skyrl_credit_batch(dump, vocab, rows=range(4))
    assert batch.group.tolist() == [0, 0, 0, 0] and batch.rollout.tolist() == [0, 1, 2, 3]
    src = SkyRLCreditSource(policy, "sequence_mean")
    r = disintegrate(src, batch, "by_rollout", dtype="float64")
    assert r.conservation_error <= 1e-14 and r.n_parts == 4
    with pytest.raises(ValueError, match="loss_reduction"):
        SkyRLCreditSource(policy, "mean")
    with pytest.raises(ValueError, match="token_map"):
        skyrl_credit_batch(dump, {1: 0})


def test_token_ids_beyond_the_policys_vocabulary_are_an_error_naming_the_id(setup):
    dump, _, policy = setup
    with pytest.raises(ValueError, match=r"token id 151645 .* outside the policy's vocabulary 0\.\.") as err:
        audit_skyrl_dump(policy, dump, "by_rollout")  # the dump's raw Qwen ids, no token_map
    assert "compact_vocabulary" in str(err.value)
