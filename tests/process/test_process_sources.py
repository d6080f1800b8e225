"""Groups from a run record (the JSONL schema), from CreditTerms, and the `process` subcommand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lens_callbacks.credit import CreditTerms
from lens_callbacks.process import audit_groups, groups_from_record, groups_from_terms, load_groups

ROOT = Path(__file__).resolve().parents[2]


def _line(step, group, rollout, reward, completion, user=(1, 2)):
    return {
        "schema": "lens_callbacks.trajectory/1",
        "step": step,
        "group": group,
        "rollout": rollout,
        "prompt_id": f"p{group}",
        "reward": reward,
        "turns": [
            {"role": "user", "text": "q", "token_ids": list(user), "trained": False, "tool_call": None},
            {"role": "assistant", "text": "a", "token_ids": list(completion[:1]), "trained": True, "tool_call": None},
            {
                "role": "tool",
                "text": "t",
                "token_ids": [99],
                "trained": False,
                "tool_call": {"name": "x", "arguments": "{}"},
            },
            {"role": "assistant", "text": "b", "token_ids": list(completion[1:]), "trained": True, "tool_call": None},
        ],
    }


def _write_record(tmp_path, steps):
    d = tmp_path / "run"
    (d / "trajectories").mkdir(parents=True)
    for step, lines in steps.items():
        with open(d / "trajectories" / f"step_{step:06d}.jsonl", "w") as f:
            for obj in lines:
                f.write(json.dumps(obj) + "\n")
    return d


def test_record_groups_follow_the_schema(tmp_path):
    run = _write_record(
        tmp_path,
        {
            0: [_line(0, 0, 0, 1.0, [5, 6]), _line(0, 0, 1, 0.0, [5, 7, 8]), _line(0, 1, 2, 0.5, [9])],
            1: [_line(1, 0, 0, 1.0, [4]), _line(1, 0, 1, 0.0, [3])],
        },
    )
    groups = groups_from_record(run)
    assert [g.key for g in groups] == ["step0/group0", "step0/group1", "step1/group0"]
    # trained turns only, in order; the user and tool turns are not completion tokens
    assert groups[0].completions == ((5, 6), (5, 7, 8))
    assert groups[0].rewards == (1.0, 0.0)
    assert groups_from_record(run, steps=[1])[0].completions == ((4,), (3,))
    a = audit_groups(groups)
    assert [r.kill for r in a.readings] == [False, True, True]
    g2, src = load_groups(run)
    assert [g.completions for g in g2] == [g.completions for g in groups] and "run record" in src
    by_path = audit_groups(str(run))
    assert by_path.numbers() == a.numbers() and "run record" in by_path.source


def test_record_errors_name_the_line(tmp_path):
    run = _write_record(tmp_path, {0: [_line(0, 0, 0, 1.0, [5]), {"schema": "other/1"}]})
    with pytest.raises(ValueError, match=r"step_000000\.jsonl:2.*schema"):
        groups_from_record(run)
    with pytest.raises(FileNotFoundError, match="trajectories"):
        groups_from_record(tmp_path)


def test_groups_from_terms_use_trained_tokens_and_rewards():
    tokens = torch.tensor([[7, 1, 2, 0], [7, 1, 3, 4], [7, 9, 9, 0]])  # [B, T]
    trained = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    terms = CreditTerms(
        terms=torch.zeros(3, 4),
        trained=trained,
        rollout=torch.arange(3),
        group=torch.tensor([4, 4, 2]),
        rewards=torch.tensor([1.0, 0.0, 0.5]),
        tokens=tokens,
    )
    groups = groups_from_terms(terms)
    assert [g.key for g in groups] == ["2", "4"]
    assert groups[1].completions == ((1, 2), (1, 3, 4)) and groups[1].rewards == (1.0, 0.0)
    assert groups[0].completions == ((9, 9),)
    direct = audit_groups(terms)
    assert [r.key for r in direct.readings] == ["2", "4"]
    assert direct.readings[1].prefix_counts == ((2, 1), (2, 1, 1))
    with pytest.raises(ValueError, match="tokens"):
        groups_from_terms(CreditTerms(torch.zeros(3, 4), trained, torch.arange(3), torch.zeros(3, dtype=torch.long)))


def test_process_command_prints_the_table(tmp_path, capsys):
    run = _write_record(tmp_path, {0: [_line(0, 0, 0, 1.0, [5, 6]), _line(0, 0, 1, 0.0, [8, 7])]})
    r = subprocess.run(
        [sys.executable, "-m", "lens_callbacks", "process", str(run), "--groups", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "Kill condition fires" in r.stdout and "on 1 of 1" in r.stdout and "group step0/group0" in r.stdout
    from lens_callbacks.cli import main

    assert main(["process", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
