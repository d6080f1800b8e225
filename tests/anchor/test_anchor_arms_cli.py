"""``lens-callbacks anchor-arms`` end to end on a 3-step toy config of the GRPO example (one combined test)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
ARMS = ["off", "A", "C", "B", "D", "X"]  # X: an arm whose callback cannot be built, so its run crashes


def _toy_config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "cli_configs" / "grpo_anchor_arms.yaml").read_text())
    cfg["trainer"]["val_check_interval"] = 3
    cfg["data"]["init_args"]["num_val_prompts"] = 8
    p = tmp_path / "toy.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.slow
def test_anchor_arms_harness_on_a_3_step_toy_config(tmp_path, run_cli, monkeypatch):
    from lens_callbacks.callbacks.arms_recorder import parameter_hash
    from lens_callbacks.cli import cli_main
    from lens_callbacks.examples.grpo import GRPOModule

    cfg, out = _toy_config(tmp_path), tmp_path / "arms"
    common = [
        "anchor-arms",
        "--config",
        cfg,
        "--seeds",
        "1",
        "--steps",
        "3",
        "--cadence",
        "1",
        "--delay-K",
        "1",
        "--out",
        out,
        "--no-progress",
    ]
    r = run_cli(
        *common, "--arms", ",".join(ARMS), "--arm", 'X={"mode": "bogus"}', "--jobs", "2", timeout=900, check=True
    )
    dec = json.loads((out / "decision.json").read_text())
    md = (out / "decision.md").read_text()

    # every arm ran; X is reported as crashed, never as a pass, and the verdict is stop
    runs = {(x["arm"], x["seed"]): x for x in dec["runs"]}
    assert set(runs) == {(a, 0) for a in ARMS} | {("none", 0)}
    assert all(runs[(a, 0)]["status"] == "ok" for a in ARMS[:-1]) and runs[("none", 0)]["status"] == "ok"
    assert runs[("X", 0)]["status"] == "crashed" and "mode" in runs[("X", 0)]["error"]
    rows = {(x["check"], x["arm"]): x for x in dec["rows"]}
    assert rows[("runs finished", "X")]["passed"] is False
    assert dec["verdict"] == "stop" and "runs finished (X" in dec["reason"]
    for a in ARMS:
        assert rows[("runs finished", a)]["passed"] is (a != "X")
        assert f"| runs finished | {a} |" in md
    for a in ("C", "B", "D"):
        for check in ("comm bytes = arm A's", "grad-norm stability", "no regression", "anchor refusals"):
            assert (check, a) in rows and rows[(check, a)]["passed"] is True, (check, a)
    for x in dec["rows"]:
        assert f"| {x['check']} | {x['arm']} |" in md
    assert "verdict: stop" in r.stdout and "runs finished" in r.stdout

    # every finished run logged the score (greedy accuracy after step 3) and wrote its own directory
    for a in ARMS[:-1] + ["none"]:
        x = runs[(a, 0)]
        assert [s for s, _ in x["scores"]] == [3] and 0.0 <= x["score"] <= 1.0
        assert (out / "runs" / a / "seed0" / "tb" / "version_0").is_dir()

    # comm bytes: A, B, C and D all ship the same snapshots — two fires (steps 1 and 2) of every trainable
    # tensor in float32 up and one sign bit per parameter down
    m = GRPOModule(**yaml.safe_load(cfg.read_text())["model"]["init_args"])
    per_fire = sum(p.numel() * 4 + (p.numel() + 7) // 8 for p in m.parameters() if p.requires_grad)
    comm = {a: sum(f["comm_bytes"] for f in runs[(a, 0)]["fires"]) for a in ("A", "B", "C", "D")}
    assert comm == {a: 2 * per_fire for a in comm}
    assert runs[("off", 0)]["fires"] == [] and rows[("comm bytes = arm A's", "C")]["passed"] is True
    # one process: no gradient traffic, and the comm row says so rather than leaving it out
    assert all(runs[(a, 0)]["grad_comm_bytes"] == 0 for a in ARMS[:-1])
    assert rows[("comm bytes = arm A's", "C")]["note"] == "no gradient traffic (single process)"

    # off ≡ no callback, bitwise — against a run of the user's config without the anchor made here, in process
    assert rows[("off-path parity", "off")]["passed"] is True
    plain = yaml.safe_load(cfg.read_text())
    plain["trainer"]["callbacks"] = []
    plain["trainer"]["logger"] = False
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lens-callbacks"])
    torch.set_num_threads(1)
    cli = cli_main(
        [
            "fit",
            "--config",
            str(tmp_path / "plain.yaml"),
            "--trainer.max_steps",
            "3",
            "--seed_everything",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            f"--trainer.default_root_dir={tmp_path / 'plain'}",
        ]
    )
    want = parameter_hash(cli.model)
    assert runs[("off", 0)]["param_hash"] == want == runs[("none", 0)]["param_hash"]
    assert runs[("A", 0)]["param_hash"] != want  # the merger did change the run: the hash is not blind
    assert runs[("off", 0)]["score"] == pytest.approx(float(cli.trainer.callback_metrics["val/accuracy"]), abs=0)

    # a finished arm is read back, not re-run: no log file is rewritten
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/stdout.log")}
    r2 = run_cli(*common, "--arms", "off,A,C,B,D", timeout=300, check=True)
    dec2 = json.loads((out / "decision.json").read_text())
    assert sorted(dec2["settings"]["read_back"]) == sorted(f"{a}/seed0" for a in ["off", "A", "C", "B", "D", "none"])
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert dec2["verdict"] in ("stay on A", "promote") and "verdict:" in r2.stdout
