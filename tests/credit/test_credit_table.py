"""The credit table (credit/table.py) against plain references.

References: the order by ``numpy.argsort`` of ``-|share|`` (stable), the omitted shares summed by
``math.fsum`` over the parts the reference order leaves out, and each part's columns by a slow loop
over the rows of plain Python lists.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from lens_callbacks.credit import CreditTerms, Partition, by_group, by_rollout
from lens_callbacks.credit.readings.table import credit_table, module_decoder, part_context
from lens_callbacks.credit.report import CreditReport

B, T, G = 12, 6, 3


def _terms(seed: int = 0, text=None) -> CreditTerms:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T, (B,), generator=g)  # [B]
    trained = torch.arange(T)[None, :] >= (T - lengths)[:, None]  # [B, T]
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    terms = torch.where(trained, values, torch.zeros_like(values))  # [B, T]
    rewards = torch.randint(0, 3, (B,), generator=g).double() / 2  # [B]
    adv = torch.randn(B, generator=g, dtype=torch.float64)  # [B]
    tokens = torch.randint(3, 13, (B, T), generator=g)  # [B, T]
    return CreditTerms(
        terms,
        trained,
        torch.arange(B),
        torch.arange(B) // (B // G),
        rewards=rewards,
        tokens=tokens,
        advantages=adv,
        text=text,
    )


def _report(names, seed=0, ok=True) -> CreditReport:
    rng = np.random.default_rng(seed)
    m = len(names)
    share = rng.normal(0, 0.3, m)
    share[m // 2] = 0.0  # a zero-share part (a group with equal rewards) among the rest
    share = share - (share.sum() - 1.0) / m  # sums to 1
    norm = np.abs(rng.normal(0, 1, m))
    if not ok:
        share = np.full(m, np.nan)
    return CreditReport(
        tuple(names),
        tuple(share.tolist()),
        tuple((norm / norm.sum()).tolist()),
        tuple(norm.tolist()),
        2.0,
        1e-9,
        None,
        "float64",
        40,
        1.0,
        0.5,
        "by_rollout",
        reason=None if ok else "the full gradient is zero (e.g. every advantage is 0); shares are undefined this step.",
    )


@pytest.mark.parametrize("top_k,bottom_k", [(3, 2), (0, 4), (5, 0), (1, 1), (6, 6), (20, 3)])
def test_parts_sorted_by_abs_share_top_bottom_shown_rest_summed(top_k, bottom_k):
    terms = _terms()
    part = by_rollout(terms)
    rep = _report(part.names)
    t = credit_table(rep, terms, part, top_k=top_k, bottom_k=bottom_k)
    share = np.array(rep.projected_share)
    order = np.argsort(-np.abs(share), kind="stable")
    assert [r.part for r in t.rows] == [rep.part_names[i] for i in order]
    top, rest, bottom = t.split()
    m = len(order)
    if top_k + bottom_k >= m:
        want_top, want_rest, want_bottom = list(order), [], []
    else:
        want_top, want_rest, want_bottom = (
            list(order[:top_k]),
            list(order[top_k : m - bottom_k]),
            list(order[m - bottom_k :]),
        )
    assert [r.part for r in top] == [rep.part_names[i] for i in want_top]
    assert [r.part for r in bottom] == [rep.part_names[i] for i in want_bottom]
    assert [r.part for r in rest] == [rep.part_names[i] for i in want_rest]
    s = t.omitted_summary()
    assert s["parts"] == len(want_rest)
    assert s["projected_share"] == math.fsum(share[i] for i in want_rest)
    assert s["norm_share"] == math.fsum(rep.norm_share[i] for i in want_rest)
    # Shown shares plus the summarised ones are the whole step.
    shown = math.fsum(r.projected_share for r in top + bottom)
    assert abs(shown + s["projected_share"] - 1.0) < 1e-12
    text = t.render()
    shown_lines = [ln for ln in text.splitlines() if re.match(r"rollout_\d+ ", ln)]
    assert [ln.split()[0] for ln in shown_lines] == [r.part for r in top + bottom]
    for ln, r in zip(shown_lines, top + bottom):
        assert float(ln.split()[1]) == pytest.approx(r.projected_share, abs=5e-7)
    if want_rest:
        line = next(ln for ln in text.splitlines() if ln.startswith("..."))
        assert f"{len(want_rest)} more parts" in line and f"share {s['projected_share']:.6f} in all" in line
        assert f"{int(sum(terms.trained[i].sum() for i in want_rest))} trained positions" in line
    else:
        assert not any(ln.startswith("...") for ln in text.splitlines())
    assert t.to_dict("t/")["t/omitted_share"] == s["projected_share"]


def _reference_context(terms: CreditTerms, part: Partition):
    """Per part, by a slow loop over plain lists: rows touched, groups, mean reward/advantage, trained count."""
    ids = part.ids.tolist()
    group, reward, adv = terms.group.tolist(), terms.rewards.tolist(), terms.advantages.tolist()
    out = []
    for j in range(len(part.names)):
        rows = [k for k in range(len(ids)) if j in ids[k]]
        out.append(
            {
                "rows": len(rows),
                "groups": sorted({group[k] for k in rows}),
                "reward": sum(reward[k] for k in rows) / len(rows),
                "advantage": sum(adv[k] for k in rows) / len(rows),
                "trained": sum(row.count(j) for row in ids),
            }
        )
    return out


@pytest.mark.parametrize("partition", [by_rollout, by_group])
def test_columns_group_reward_advantage_trained_match_a_loop(partition):
    terms = _terms(seed=3)
    part = partition(terms)
    rep = _report(part.names, seed=3)
    t = credit_table(rep, terms, part, top_k=2, bottom_k=1)
    want = {n: w for n, w in zip(part.names, _reference_context(terms, part))}
    for r in t.rows:
        c, w = r.context, want[r.part]
        assert c.rows == w["rows"] and c.n_groups == len(w["groups"]) and c.trained == w["trained"]
        assert c.group == (w["groups"][0] if len(w["groups"]) == 1 else None)
        assert c.reward == pytest.approx(w["reward"], abs=1e-12) and c.advantage == pytest.approx(
            w["advantage"], abs=1e-12
        )
        assert c.text is None  # no text and no decoder: no text column
    head = t.render().splitlines()[1].split()
    assert head == ["part", "projected_share", "norm_share", "||g_S||", "group", "reward", "advantage", "trained"]
    first = t.render().splitlines()[3].split()
    c = t.rows[0].context
    assert first[0] == t.rows[0].part and first[4] == str(c.group)
    assert float(first[5]) == pytest.approx(c.reward, abs=5e-4) and float(first[6]) == pytest.approx(
        c.advantage, abs=5e-4
    )
    assert int(first[7]) == c.trained


def test_text_column_from_terms_text_or_a_decoder():
    words = tuple(f"answer {k}\nline two, long enough to be cut" for k in range(B))
    terms = _terms(seed=5, text=words)
    part = by_rollout(terms)
    rep = _report(part.names, seed=5)
    t = credit_table(rep, terms, part, top_k=3, bottom_k=3, text_width=12)
    assert t.has_text and "completion" in t.render().splitlines()[1]
    for r in t.rows:
        k = int(r.part.split("_")[1])
        assert r.context.text == '"' + words[k].replace("\n", "\\n")[:11] + '…"'
        if r in t.split()[0]:
            assert r.context.text in t.render()
    # A decoder gets each row's trained token ids, in order.
    plain = _terms(seed=5)
    seen = []

    def decode(ids):
        seen.append(list(ids))
        return "-".join(map(str, ids))

    t2 = credit_table(rep, plain, part, decode=decode)
    for r in t2.rows:
        k = int(r.part.split("_")[1])
        ids = plain.tokens[k][plain.trained[k]].tolist()
        assert (
            r.context.text
            == '"' + "-".join(map(str, ids))[:23] + ("…" if len("-".join(map(str, ids))) > 24 else "") + '"'
        )
    assert len(seen) == B
    # Text wins over the decoder; a part of several rows shows none.
    assert credit_table(rep, terms, part, decode=decode).rows[0].context.text.startswith('"answer')
    assert all(
        r.context.text is None
        for r in credit_table(_report(by_group(terms).names), terms, by_group(terms), decode=decode).rows
    )


def test_module_decoder_prefers_a_hook_then_a_tokenizer():
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return ("skip:" if skip_special_tokens else "") + ",".join(map(str, ids))

    class WithTok:
        tokenizer = Tok()

    class WithHook(WithTok):
        def decode_completion(self, ids):
            return "hook"

    assert module_decoder(WithTok())([1, 2]) == "skip:1,2"
    assert module_decoder(WithHook())([1, 2]) == "hook"
    assert module_decoder(object()) is None


def test_bad_inputs_are_named():
    terms = _terms()
    part = by_rollout(terms)
    rep = _report(part.names)
    with pytest.raises(ValueError, match=r"`text` must be a sequence of 12 strings"):
        part_context(terms, part, text=("a", "b"))
    with pytest.raises(ValueError, match=r"`top_k` must be an int >= 0, got -1"):
        credit_table(rep, top_k=-1)
    with pytest.raises(ValueError, match=r"`partition.ids` must have the shape"):
        part_context(terms, Partition(part.ids[:, :3], part.names))
    # A partition whose parts are not the report's: shares only, and the table says why.
    other = _report(tuple(f"r0/{n}" for n in part.names))
    t = credit_table(other, terms, part)
    assert not t.has_context and "not shown" in t.render()


def test_undefined_reading_shows_the_reason_not_rows_of_nan():
    terms = _terms()
    part = by_rollout(terms)
    rep = _report(part.names, ok=False)
    t = credit_table(rep, terms, part)
    text = t.render()
    assert "UNDEFINED: the full gradient is zero" in text
    assert not any(ln.startswith("rollout_") for ln in text.splitlines())
    assert [r.part for r in t.rows] == list(part.names)  # batch order: there is nothing to sort by


def test_report_render_is_the_table_without_context():
    terms = _terms()
    part = by_rollout(terms)
    rep = _report(part.names)
    assert rep.render() == credit_table(rep, top_k=5, bottom_k=5).render()
    assert rep.render(max_rows=3) == credit_table(rep, top_k=2, bottom_k=1).render()
