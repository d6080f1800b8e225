"""``lens-callbacks anchor-arms`` on the spec's comm-efficient base: 2 CPU ranks (gloo), PowerSGD-compressed DDP.

Arms A and C, one seed, 3 steps. The gradient traffic each run recorded is checked against a hand count over the
GRPO model's tensors (2 warm-up steps of whole buckets, then the P and Q factors of the tensors PowerSGD
compresses plus the tensors it sends whole), on both ranks; the comm-parity row compares the totals.
"""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.mark.slow
def test_arms_on_two_powersgd_ranks_count_the_gradient_traffic(tmp_path, run_cli):
    from lens_callbacks.examples.grpo import GRPOModule

    cfg = yaml.safe_load((ROOT / "cli_configs" / "grpo_anchor_arms_powersgd.yaml").read_text())
    cfg["trainer"]["val_check_interval"] = STEPS
    cfg["data"]["init_args"]["num_val_prompts"] = 8
    path, out = tmp_path / "toy.yaml", tmp_path / "arms"
    path.write_text(yaml.safe_dump(cfg))
    r = run_cli(
        "anchor-arms",
        "--config",
        path,
        "--arms",
        "A,C",
        "--seeds",
        "1",
        "--steps",
        STEPS,
        "--cadence",
        "1",
        "--delay-K",
        "1",
        "--out",
        out,
        "--no-progress",
        "--no-parity",
        "--jobs",
        "2",
        timeout=600,
        check=True,
    )
    dec = json.loads((out / "decision.json").read_text())
    runs = {x["arm"]: x for x in dec["runs"]}
    errors = "\n".join(f"{a}: {runs[a]['error']}" for a in ("A", "C") if runs[a]["error"])
    assert all(runs[a]["status"] == "ok" and runs[a]["world_size"] == 2 for a in ("A", "C")), r.stdout + errors

    # by hand: every trainable tensor viewed as n × m; rank r = min(n, m, 2); compressed when (n+m)·r·2 < n·m
    args = cfg["trainer"]["strategy"]["init_args"]
    rank, start = args["matrix_approximation_rank"], args["start_powerSGD_iter"]
    m_ = GRPOModule(**cfg["model"]["init_args"])
    whole = compressed = 0
    n_compressed = 0
    for p in m_.parameters():
        if not p.requires_grad:
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        k = min(n, m, rank)
        whole += p.numel()
        if (n + m) * k * 2 < n * m:
            compressed += (n + m) * k
            n_compressed += 1
        else:
            compressed += p.numel()
    assert n_compressed > 0 and compressed < whole  # the toy model does exercise the compression
    per_rank = 4 * (start * whole + (STEPS - start) * compressed)  # float32
    for a in ("A", "C"):
        rec = json.loads((out / "runs" / a / "seed0" / "record.json").read_text())["grad_comm"]
        assert rec["hook"] == "powerSGD_hook" and rec["backend"] == "gloo"
        assert rec["per_rank"] == [per_rank, per_rank] and rec["bytes"] == runs[a]["grad_comm_bytes"] == 2 * per_rank
        assert rec["per_step"] == [[s, 4 * (whole if s < start else compressed)] for s in range(STEPS)]
        assert rec["by_path"] == {"warmup": 4 * start * whole, "powersgd": 4 * (STEPS - start) * compressed}

    # the anchor's own bytes: two fires (steps 1 and 2), each every trainable tensor up and one sign bit down
    per_fire = sum(p.numel() * 4 + (p.numel() + 7) // 8 for p in m_.parameters() if p.requires_grad)
    anchor = {a: sum(f["comm_bytes"] for f in runs[a]["fires"]) for a in ("A", "C")}
    assert anchor == {"A": 2 * per_fire, "C": 2 * per_fire}

    # comm parity is over the total, and the row shows both parts
    (row,) = [x for x in dec["rows"] if x["check"] == "comm bytes = arm A's" and x["arm"] == "C"]
    total = 2 * per_rank + 2 * per_fire
    assert row["passed"] is True
    assert row["value"] == (
        f"total {total:.6g} (grad {2 * per_rank:.6g} + anchor {2 * per_fire:.6g}) vs "
        f"total {total:.6g} (grad {2 * per_rank:.6g} + anchor {2 * per_fire:.6g})"
    )
    assert "grad comm bytes" in r.stdout and f"{2 * per_rank:.6g}" in r.stdout
    # the score is the ranks' mean greedy accuracy after step 3
    assert [s for s, _ in runs["A"]["scores"]] == [STEPS] and 0.0 <= runs["A"]["score"] <= 1.0
