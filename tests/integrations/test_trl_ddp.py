"""The TRL adapter under two data-parallel CPU processes (gloo): global readings of real GRPOTrainer steps.

Two ranks train a tiny Qwen2 (LoRA, fp32, accumulation 2, ``max_grad_norm`` 0.5) under ``torch.distributed.run``;
accelerate picks MULTI_CPU, so DDP averages the ranks' gradients. Every reading is held against something the
adapter does not compute: ``grad_match`` against the averaged ``.grad`` (clip divided out), step conservation
against the real SGD update, and the shares against each rank's per-row gradients by a plain autograd loop
dotted with the averaged ``.grad`` (``trl_ddp_worker.RowReference``), gathered here from both ranks' files.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the `trl` extra is not installed: pip install -e '.[trl]'")
pytest.importorskip("peft", reason="LoRA runs need peft (in the `trl` and `dev` extras)")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover - torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from lens_callbacks.examples.trl_grpo import save_policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trl_ddp_worker.py")
W = 2
# grpo: per-row token mean, then row mean, / accumulation; dapo: tokens of the whole generation batch over
# every process (num_items_in_batch / num_processes). DDP then averages both over the ranks.
# run -> (engine that must have run, audited steps); the runs are defined in trl_ddp_worker.VARIANTS.
EXACT = {
    "grpo": ("ghost", 2),
    "dapo": ("ghost", 2),
    "grpo_reference": ("reference", 1),
    "bnpo_entropy_mask": ("ghost", 1),
}
RUNS = (*EXACT, "dapo_forgets_world_size", "grpo_fails_on_rank1")


def _free_port() -> int:
    # A port below the ephemeral range, so that it cannot be handed to some other socket meanwhile.
    for _ in range(200):
        port = random.randint(20000, 31999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def _launch(tmp_path: Path, policy: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(W),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(WORKER),
        policy,
        str(tmp_path),
        *RUNS,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks: a hung collective never hangs the suite
        out, _ = proc.communicate()
        pytest.fail(f"the 2-process run did not finish in 240 s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_ddp")
    policy = save_policy(str(tmp / "policy"))
    done = _launch(tmp, policy)
    assert done.returncode == 0, done.stdout[-6000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(W)]


@pytest.mark.slow
@pytest.mark.parametrize("run", EXACT)
def test_two_ranks_read_the_global_step_exactly(ranks, run):
    loss_type = run.split("_")[0]
    engine, n_steps = EXACT[run]
    per_rank = [r[run] for r in ranks]
    for rank in per_rank:
        assert rank["world_size"] == W and rank["distributed_type"].endswith("MULTI_CPU")
        assert len(rank["steps"]) == n_steps and rank["global_step"] == n_steps
    # Only the main process logs (transformers' reporting integrations write from it alone).
    assert per_rank[0]["logged_steps"] == list(range(1, n_steps + 1)) and per_rank[1]["logged_steps"] == []
    for step in range(n_steps):
        entries = [rank["steps"][step] for rank in per_rank]
        for r, e in enumerate(entries):
            assert "part_names" in e, (r, e["report"])
            assert e["engine"] == engine
            assert e["grad_match"] <= 1e-6, (loss_type, r, e["grad_match"])
            assert e["conservation_error"] <= 1e-6, (loss_type, r, e["conservation_error"])
            assert abs(e["share_sum"] - 1.0) <= 1e-6, (loss_type, r, e["share_sum"])
            assert abs(math.fsum(e["projected_share"]) - 1.0) <= 1e-6
            cons = e["conservation"]
            assert cons["source"] == "credit_parts", cons["render"]
            assert cons["relative_error"] <= 1e-6, (loss_type, r, cons["render"])
            # clipping really rescaled the averaged .grad, so the clip coefficient had to be divided out
            assert e["reference"]["clip_coef"] < 0.5
        # Every rank holds the same global reading, bit for bit.
        keys = ("part_names", "projected_share", "part_norm", "grad_match", "conservation_error", "cancellation")
        for k in keys:
            assert entries[0][k] == entries[1][k], k
        assert entries[0]["conservation"]["relative_error"] == entries[1]["conservation"]["relative_error"]
        # 2 ranks x 2 micro-batches x 2 rows: one part per rollout, named by the rank that trained it.
        names = entries[0]["part_names"]
        assert len(names) == 16 and len(set(names)) == 16
        assert {n.split("/")[0] for n in names} == {"r0", "r1"}
        # The independent reference: share of rank r's row k = <g_rk, ḡ> / (W ||ḡ||²), ḡ the averaged .grad / c.
        refs = [e["reference"] for e in entries]
        assert refs[0]["gbar_sq"] == pytest.approx(refs[1]["gbar_sq"], rel=1e-12)  # the same averaged .grad
        expected = {}
        for r, ref in enumerate(refs):
            for rollout, dot in ref["dots"].items():
                expected[f"r{r}/rollout_{rollout}"] = dot / (W * ref["gbar_sq"])
        assert set(expected) == set(names)
        got = dict(zip(names, entries[0]["projected_share"]))
        worst = max(abs(got[n] - expected[n]) for n in names)
        assert worst <= 1e-6, (loss_type, step, worst)
        # Both ranks hold real parts of the step (no rank's share is trivially all of it).
        for r in ("r0", "r1"):
            assert 0.05 < sum(v for n, v in got.items() if n.startswith(r + "/")) < 0.95


@pytest.mark.slow
def test_forgetting_the_world_size_in_the_normaliser_is_caught(ranks):
    # dapo re-derived without TRL's `/ num_processes`: every rank's terms are half the loss it backpropagated,
    # so the audit's global gradient is G = ḡ/2 and grad_match = ||G − ḡ|| / ||G|| = 1.
    for rank in ranks:
        (e,) = rank["dapo_forgets_world_size"]["steps"]
        assert "part_names" in e, e["report"]
        assert e["grad_match"] == pytest.approx(1.0, abs=1e-6)
        assert e["share_sum"] == pytest.approx(0.5, abs=1e-6)
        # the parts still add up to the (wrong) objective: only grad_match and the share sum can catch this
        assert e["conservation_error"] <= 1e-6


@pytest.mark.slow
def test_a_rank_whose_audit_fails_leaves_every_rank_with_the_same_refusal(ranks):
    # Rank 1 cannot re-derive its terms: both ranks still run the collectives (no hang), read the same
    # refusal, hold the update against .grad, and train on.
    per_rank = [r["grpo_fails_on_rank1"] for r in ranks]
    for rank in per_rank:
        assert rank["global_step"] == 2 and len(rank["steps"]) == 2
        for e in rank["steps"]:
            assert e["condition"] == "credit_audit_global", e["report"]
            assert "rank(s) [1]" in e["report"]
            cons = e["conservation"]
            assert cons["source"] == "grad" and cons["relative_error"] <= 1e-6, cons["render"]
    assert "no terms on this rank" in per_rank[1]["steps"][0]["report"]
    assert per_rank[0]["logged_steps"] == [1, 2] and per_rank[1]["logged_steps"] == []
    assert per_rank[0]["logged_refused"] == [1.0, 1.0]
