"""Global readings on 2 CPU ranks (gloo): DDP (``ddp``, ``ddp_spawn``) and FSDP2, against one process.

Each run is ``tests/callbacks/_distributed_worker.py`` in a subprocess (``ddp`` and FSDP2 re-launch the
script for rank 1); the ranks write what they read. The float32 case (shares summing to 1 within 1e-6,
``grad_match`` logged at rounding) runs on the GRPO example in test_credit_audit.py (``ddp_spawn``). The reference is a single-process
:func:`disintegrate` of the two ranks' batches concatenated (terms divided by the world size, as DDP
averages), at the parameters the ranks recorded, with no collective anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lens_callbacks.credit import CreditTerms, disintegrate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import _distributed_worker as worker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(strategy, dtype, what)``: the worker's two rank records, each configuration run once per module."""
    done: dict[tuple[str, str, str], tuple[dict, dict]] = {}

    def go(strategy: str, dtype: str, what: str = "audit") -> tuple[dict, dict]:
        key = (strategy, dtype, what)
        if key not in done:
            out = tmp_path_factory.mktemp(f"{strategy}_{dtype}_{what}")
            env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
            r = subprocess.run(
                [sys.executable, str(HERE / "_distributed_worker.py"), strategy, dtype, str(out), what],
                cwd=out,
                env=env,
                capture_output=True,
                text=True,
                timeout=400,
            )
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
            done[key] = tuple(torch.load(out / f"rank{i}.pt", weights_only=False) for i in range(worker.W))
        return done[key]

    return go


def _reference(row: dict):
    """Single-process audit of the concatenated batch at the recorded parameters (float64)."""
    plain = worker.Policy(torch.float64)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(row["params"][n])
    step = row["step"]

    def terms_fn(_):
        parts = [plain.credit_terms(worker.make_batch(r, step)) for r in range(worker.W)]
        terms = torch.cat([t.terms for t in parts]) / worker.W  # [W·B, T]: DDP applies the rank mean
        n = terms.shape[0]
        return CreditTerms(terms, torch.cat([t.trained for t in parts]), torch.arange(n), torch.arange(n))

    return disintegrate(plain, None, "by_rollout", dtype="float64", terms_fn=terms_fn, reference_grads=row["grad"])


def _same_on_every_rank(records):
    a, b = records
    for ra, rb in zip(a["rows"], b["rows"]):
        assert ra["part_names"] == rb["part_names"]
        assert ra["projected_share"] == rb["projected_share"] and ra["cancellation"] == rb["cancellation"]


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ddp_global_shares_equal_a_single_process_audit_of_the_concatenated_batch(run, strategy):
    records = run(strategy, "float64")
    _same_on_every_rank(records)
    rows = records[0]["rows"]
    assert [r["step"] for r in rows] == list(range(worker.STEPS))
    for row in rows:
        ref = _reference(row)
        assert row["part_names"] == tuple(f"r{r}/rollout_{k}" for r in range(worker.W) for k in range(worker.B))
        assert len(ref.projected_share) == len(row["projected_share"]) == worker.W * worker.B
        for got, want in zip(row["projected_share"], ref.projected_share):
            assert got == pytest.approx(want, rel=0, abs=1e-12)
        for got, want in zip(row["norm_share"], ref.norm_share):
            assert got == pytest.approx(want, rel=0, abs=1e-12)
        assert row["cancellation"] == pytest.approx(ref.cancellation, rel=1e-12)
        assert row["full_grad_norm"] == pytest.approx(ref.full_grad_norm, rel=1e-12)
        assert row["loss"] == pytest.approx(ref.loss, rel=1e-12)
        assert abs(sum(row["projected_share"]) - 1.0) < 1e-12
        assert row["conservation_error"] < 1e-13
        # grad_match against the averaged .grad, logged, at float64 rounding; and the reference agrees.
        assert row["logged"]["credit/grad_match"] == row["grad_match"] and row["grad_match"] < 1e-13
        assert ref.grad_match < 1e-13
    for c in records[0]["conservation"] + records[1]["conservation"]:
        assert c["source"] == "credit_parts" and c["holds"] and c["error"] < 1e-12, c["text"]


def test_fsdp2_readings_equal_ddp_on_the_same_data(run):
    ddp = run("ddp", "float64")
    fsdp = run("fsdp", "float64")
    assert fsdp[0]["strategy"] == "ModelParallelStrategy"
    _same_on_every_rank(fsdp)
    for a, b in zip(fsdp[0]["rows"], ddp[0]["rows"]):
        assert a["part_names"] == b["part_names"]
        for n in a["params"]:
            assert torch.allclose(a["params"][n], b["params"][n], rtol=0, atol=1e-12)
        for key in ("projected_share", "norm_share"):
            for x, y in zip(a[key], b[key]):
                assert x == pytest.approx(y, rel=0, abs=1e-10)
        for key in ("cancellation", "full_grad_norm", "loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-10)
        assert a["conservation_error"] < 1e-12 and a["grad_match"] < 1e-12
        ref = _reference(a)
        for x, y in zip(a["projected_share"], ref.projected_share):
            assert x == pytest.approx(y, rel=0, abs=1e-10)
    for c in fsdp[0]["conservation"] + fsdp[1]["conservation"]:
        assert c["source"] == "credit_parts" and c["holds"] and c["error"] < 1e-12, c["text"]


class _ConcatPolicy(worker.Policy):
    """One process, both ranks' batches at once, terms divided by W: the step DDP/FSDP take together."""

    def forward(self, batch):
        if isinstance(batch, dict):
            parts = [worker.Policy.forward(self, b) for b in batch["ranks"]]
            terms = torch.cat([t.terms for t in parts]) / worker.W  # [W·B, T]
            n = terms.shape[0]
            return CreditTerms(terms, torch.cat([t.trained for t in parts]), torch.arange(n), torch.arange(n))
        return worker.Policy.forward(self, batch)

    def train_dataloader(self):
        batches = [{"ranks": [worker.make_batch(r, s) for r in range(worker.W)]} for s in range(self.steps)]
        return torch.utils.data.DataLoader(batches, batch_size=None)


class _Grads(worker.pl.Callback):
    def __init__(self, anchor):
        self.anchor, self.rows = anchor, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        r = self.anchor.last_reading
        self.rows.append(
            {
                "grad": [p.grad.detach().clone() for p in pl_module.parameters()],
                "reading": None if r is None else r.to_dict("anchor/"),
            }
        )


def test_fsdp2_anchor_equals_one_process_on_the_concatenated_batches(run, tmp_path):
    from lens_callbacks.callbacks.anchor import AnchorProjectionCallback

    fsdp = run("fsdp", "float64", "anchor")
    assert fsdp[0]["strategy"] == "ModelParallelStrategy"
    anchor = AnchorProjectionCallback(**worker.ANCHOR_KW)
    spy = _Grads(anchor)
    m = _ConcatPolicy(torch.float64, steps=worker.ANCHOR_STEPS)
    worker.pl.Trainer(
        max_steps=worker.ANCHOR_STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[anchor, spy],
        default_root_dir=str(tmp_path),
    ).fit(m)
    assert any(r["reading"] and r["reading"]["anchor/projected"] == 1.0 for r in spy.rows)  # the projection ran
    for rank in fsdp:
        assert len(rank["rows"]) == len(spy.rows) == worker.ANCHOR_STEPS
        for got, want in zip(rank["rows"], spy.rows):
            assert got["refusal"] is None
            for a, b in zip(got["grad"], want["grad"]):  # the merged .grad, gathered from the shards
                assert torch.allclose(a, b, rtol=0, atol=1e-10)
            assert (got["reading"] is None) == (want["reading"] is None)
            for k, v in (want["reading"] or {}).items():
                assert got["reading"][k] == pytest.approx(v, rel=1e-8, abs=1e-10, nan_ok=True), k
        for n, p in m.named_parameters():
            assert torch.allclose(rank["params"][n], p.detach(), rtol=0, atol=1e-10)
        # The conservation check without an audit, on sharded parameters: .grad gathered whole.
        seen = rank["conservation"]
        assert len(seen) == worker.ANCHOR_STEPS
        assert seen[0]["kind"] == "ConservationReading"  # step 0: no snapshot visible yet, nothing merged
        for c in seen:
            if c["kind"] == "ConservationReading":
                assert c["source"] == "grad" and c["holds"] and c["error"] < 1e-12, c["text"]
            else:  # a check that knows of the merger may refuse the merged steps, naming it
                assert "Anchor" in c["text"], c["text"]


def test_ddp_extra_partitions_are_read_over_all_ranks_without_nan_or_deprecated_collectives(run):
    """2 ranks with ``extra_partitions``: each extra reading equals a single process on the concatenated batch."""
    records = run("ddp", "float64", "extras")
    for rank in records:
        for row in rank["rows"]:
            logged = row["logged"]
            # No NaN scalar, the smoothed noise readings included: b_simple_ema is left out, not logged as
            # NaN, while the smoothed ‖G‖² is not positive (noise swamps the signal).
            nan = [k for k, v in logged.items() if v != v]
            assert nan == [], nan
            assert logged["credit/noise/grad_sq_ema"] == logged["credit/noise/grad_sq_ema"]
            if "credit/noise/b_simple_ema" not in logged:
                assert logged["credit/noise/grad_sq_ema"] <= 0
        # Our collectives raise no FutureWarning (torch.distributed.nn.functional.all_gather is deprecated).
        ours = [w for w in rank["warnings"] if w[0] == "FutureWarning" and "distributed" in w[1]]
        assert ours == [], ours
        assert "not read" not in rank["readings_text"], rank["readings_text"]
    a, b = (r["rows"] for r in records)
    for ra, rb in zip(a, b):
        shared = {k: v for k, v in ra["logged"].items() if "by_advantage_sign" in k or "by_group" in k}
        assert shared and shared == {k: rb["logged"][k] for k in shared}  # the same global reading on both ranks
    for row in a:
        plain = worker.Policy(torch.float64)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(row["params"][n])
        n = worker.W * worker.B

        def terms_fn(_, step=row["step"]):
            parts = [plain.credit_terms(worker.make_batch(r, step)) for r in range(worker.W)]
            terms = torch.cat([t.terms for t in parts]) / worker.W  # [W·B, T]: DDP applies the rank mean
            return CreditTerms(
                terms,
                torch.cat([t.trained for t in parts]),
                torch.arange(n),
                torch.arange(n),
                advantages=torch.cat([t.advantages for t in parts]),
            )

        ref = disintegrate(plain, None, "by_advantage_sign", dtype="float64", terms_fn=terms_fn)
        logged = row["logged"]
        for name, share in zip(ref.part_names, ref.projected_share):
            key = f"credit/by_advantage_sign/projected_share/{name}"
            if key in logged:
                assert logged[key] == pytest.approx(share, rel=0, abs=1e-12), name
            else:
                assert share == 0.0, (name, share)
        # by_group (positional, one row per group here): one part per rank's row, named by rank.
        groups = {k: v for k, v in logged.items() if k.startswith("credit/by_group/projected_share/")}
        assert len(groups) == n and sum(groups.values()) == pytest.approx(1.0, abs=1e-12)
        assert all(k.split("/")[-2] in ("r0", "r1") for k in groups), sorted(groups)
        # The noise scale of the global batch: every rank's rows, from a one-process by_rollout audit.
        per_row = disintegrate(plain, None, "by_rollout", dtype="float64", terms_fn=terms_fn)
        from lens_callbacks.credit.readings.noise import noise_scale

        want = noise_scale(per_row.part_norm, per_row.full_grad_norm)
        assert logged["credit/noise/b_simple"] == pytest.approx(want.b_simple, rel=1e-9)
