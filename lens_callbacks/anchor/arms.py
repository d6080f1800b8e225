r"""The anchor spec's online arms (§11 "Step 2", §13 steps 5–7) as a harness over a user's LightningCLI config.

Each arm is one setting of :class:`~lens_callbacks.callbacks.AnchorProjectionCallback`, run once per seed in
its own process and directory (``python -m lens_callbacks fit --config RUN.yaml --trainer.max_steps N
--seed_everything S``):

======  =====================================================================================================
``off``  the callback present with ``mode="off"`` (must be bitwise the run without it: the parity run ``none``)
``A``    ``signed_ema`` on the raw stale snapshot (the operating merger; the reference of every comparison)
``C``    ``projected``: ``θ̂`` (Resolution A) with the coherence gate and its retrospective factor
``B``    ablation: ``projected`` with the spec's four-factor gate only (``retro_gate=False``), which passes
         most of a coherent-but-bending trajectory — close to projecting ungated
``D``    ablation: ``projected`` with one gate for the whole model (``pool="global"``) instead of per layer
======  =====================================================================================================

The decision (:func:`decide`) reads the runs against the spec's thresholds: runs finished; off-path parity;
comm bytes (the gradients' all-reduce traffic plus the anchor's own) equal to arm A's; grad-norm stability (NaN, or more than 10× arm A's, fails); no regression
``Δ ≥ −max(0.010, 2σ)`` for C and D; gated-ON ≈ 0 where the projection does not help; and the margin
``Δ ≥ max(0.010, 2σ)`` that promotes C. Any failed safety row → ``stop``; all safe and the margin met →
``promote``; all safe without it → ``stay on A``.

Pure python/numpy (and PyYAML for the config); never imports lightning — the runs are subprocesses.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

__all__ = [
    "ARMS",
    "ANCHOR_CLASS",
    "RECORDER_CLASS",
    "PARITY_ARM",
    "RunResult",
    "Row",
    "ArmSummary",
    "ArmsReport",
    "decide",
    "summarize",
    "run_config",
    "run_arms",
    "figures",
]

ANCHOR_CLASS = "lens_callbacks.callbacks.AnchorProjectionCallback"
RECORDER_CLASS = "lens_callbacks.callbacks.arms_recorder.ArmsRecorder"
PARITY_ARM = "none"  # the run without any anchor callback, on the first seed: the reference of arm off

ARMS: dict[str, dict[str, Any]] = {
    "off": {"mode": "off"},
    "A": {"mode": "signed_ema"},
    "C": {"mode": "projected"},
    "B": {"mode": "projected", "retro_gate": False},
    "D": {"mode": "projected", "pool": "global"},
}
SAFETY_ARMS = ("C", "D")  # held to no regression and gated-ON ≈ 0; B is an ablation and only reported

REGRESSION_FLOOR = 0.010
GRAD_NORM_FACTOR = 10.0
GATED_ON_TOL = 0.01


def _nan(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _median(xs: Iterable[float]) -> float:
    v = [x for x in xs if math.isfinite(x)]
    return float(np.median(v)) if v else float("nan")


@dataclass(frozen=True)
class RunResult:
    """One arm on one seed, as the harness read it back.

    Attributes:
        arm, seed: which run. status: ``"ok"`` or ``"crashed"`` (non-zero exit, or no record written).
        score: the last value of the score tag (NaN when the module never logged it).
        scores: ``(step, value)`` after every validation. grad_norms: ``(step, ||g||)`` the optimizer received
            (after the merger; NaN where the norm was not finite).
        fires: the anchor's readings per fire (dicts with ``t_fast``, ``gated_on_fraction``, ``comm_bytes``, …).
        param_hash: SHA-256 of the final parameters. error: the end of stderr for a crashed run.
        logged_tags: every metric name the run logged (to say what to pass as ``--score``).
        grad_comm_bytes: the gradient traffic of the run — the all-reduce payload of every rank, summed over
            ranks and steps (0 in a single process; NaN where the strategy did not count it).
        grad_comm_per_rank: that payload per rank. grad_comm_note: why it is 0 or NaN (empty when counted).
        world_size: processes of the run.
    """

    arm: str
    seed: int
    status: str
    score: float = float("nan")
    scores: tuple = ()
    grad_norms: tuple = ()
    fires: tuple = ()
    param_hash: str = ""
    error: str = ""
    returncode: int = 0
    logged_tags: tuple = ()
    seconds: float = float("nan")
    refusal: str = ""
    grad_comm_bytes: float = float("nan")
    grad_comm_per_rank: tuple = ()
    grad_comm_note: str = "not recorded"
    world_size: int = 1

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def comm_bytes(self) -> float:
        """The anchor's own traffic: snapshots up plus sign bits down, summed over fires."""
        return float(sum(_nan(f.get("comm_bytes")) for f in self.fires))

    @property
    def total_comm_bytes(self) -> float:
        """Gradient traffic plus the anchor's; NaN when the gradient traffic was not counted."""
        return self.grad_comm_bytes + self.comm_bytes

    @property
    def grad_norm_max(self) -> float:
        """Largest gradient norm of the run; NaN if any step's norm was not finite."""
        v = [_nan(g) for _, g in self.grad_norms]
        if not v or not all(math.isfinite(x) for x in v):
            return float("nan")
        return max(v)

    def to_dict(self) -> dict[str, Any]:
        def fin(x: Any) -> Any:
            if isinstance(x, float):
                return x if math.isfinite(x) else None
            if isinstance(x, dict):
                return {k: fin(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [fin(v) for v in x]
            return x

        return fin(
            {
                "arm": self.arm,
                "seed": self.seed,
                "status": self.status,
                "score": self.score,
                "scores": [list(s) for s in self.scores],
                "grad_norms": [list(g) for g in self.grad_norms],
                "fires": list(self.fires),
                "param_hash": self.param_hash,
                "error": self.error,
                "returncode": self.returncode,
                "logged_tags": list(self.logged_tags),
                "seconds": self.seconds,
                "refusal": self.refusal,
                "grad_comm_bytes": self.grad_comm_bytes,
                "grad_comm_per_rank": list(self.grad_comm_per_rank),
                "grad_comm_note": self.grad_comm_note,
                "world_size": self.world_size,
            }
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunResult":
        return cls(
            arm=str(d["arm"]),
            seed=int(d["seed"]),
            status=str(d["status"]),
            score=_nan(d.get("score")),
            scores=tuple((int(s), _nan(v)) for s, v in d.get("scores", [])),
            grad_norms=tuple((int(s), _nan(v)) for s, v in d.get("grad_norms", [])),
            fires=tuple(dict(f) for f in d.get("fires", [])),
            param_hash=str(d.get("param_hash", "")),
            error=str(d.get("error", "")),
            returncode=int(d.get("returncode", 0)),
            logged_tags=tuple(d.get("logged_tags", [])),
            seconds=_nan(d.get("seconds")),
            refusal=str(d.get("refusal") or ""),
            grad_comm_bytes=_nan(d.get("grad_comm_bytes")),
            grad_comm_per_rank=tuple(d.get("grad_comm_per_rank") or ()),
            grad_comm_note=str(d.get("grad_comm_note", "not recorded")),
            world_size=int(d.get("world_size") or 1),
        )


@dataclass(frozen=True)
class Row:
    """One threshold row of the decision: its measured value and whether it passed.

    ``kind``: ``"safety"`` (a failure stops), ``"margin"`` (promotes C) or ``"info"`` (reported only).
    ``passed`` is None for an info row.
    """

    check: str
    arm: str
    value: str
    threshold: str
    passed: Optional[bool]
    kind: str = "safety"
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "arm": self.arm,
            "value": self.value,
            "threshold": self.threshold,
            "passed": self.passed,
            "kind": self.kind,
            "note": self.note,
        }


@dataclass(frozen=True)
class ArmSummary:
    """One arm over its seeds.

    Attributes:
        score_mean, score_std: mean and sample std (``ddof=1``; 0 for one seed) of the final score over the
            finished seeds. delta_mean, delta_std: the same for the per-seed difference to arm A (paired by
            seed; NaN for A itself).
        grad_ratio: the largest per-seed ratio of this arm's largest gradient norm to arm A's (same seed).
        comm_bytes: the anchor's traffic per seed (snapshots up plus sign bits down, summed over fires).
        grad_comm_bytes: the gradient traffic per seed (all ranks; 0 in one process, NaN where not counted).
        gated_on: mean gated-ON fraction over projected fires (all seeds). weight_err_ratio: median ungated
            ``||θ̂ − θ_true|| / ||θ_stale − θ_true||`` over projected fires (< 1: the projection helps).
        coef_pred_error: median retrospective coefficient-prediction error over fires.
        evr1, evr1_null: medians over fires; evr1_above_null: share of fires whose EVR1 beat its null.
    """

    arm: str
    n_runs: int
    n_ok: int
    score_mean: float
    score_std: float
    delta_mean: float
    delta_std: float
    grad_ratio: float
    grad_nan: bool
    comm_bytes: tuple
    grad_comm_bytes: tuple
    n_fires: int
    n_projected: int
    gated_on: float
    weight_err_ratio: float
    coef_pred_error: float
    evr1: float
    evr1_null: float
    evr1_above_null: float

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        out = {}
        for k in (
            "n_runs",
            "n_ok",
            "score_mean",
            "score_std",
            "delta_mean",
            "delta_std",
            "grad_ratio",
            "n_fires",
            "n_projected",
            "gated_on",
            "weight_err_ratio",
            "coef_pred_error",
            "evr1",
            "evr1_null",
            "evr1_above_null",
        ):
            v = float(getattr(self, k))
            if math.isfinite(v):
                out[f"{prefix}{self.arm}/{k}"] = v
        return out


def _last_line(text: str, limit: int = 200) -> str:
    """The last non-blank line of a crashed run's stderr (where Python puts the exception), cut to ``limit``."""
    line = next((x.strip() for x in reversed(str(text or "").splitlines()) if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _std(x: Sequence[float]) -> float:
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def summarize(arm: str, runs: Sequence[RunResult], ref: Mapping[int, RunResult]) -> ArmSummary:
    """Aggregate one arm's runs; ``ref`` maps seed → arm A's run (for Δ, the grad-norm ratio)."""
    ok = [r for r in runs if r.ok]
    scores = [r.score for r in ok if math.isfinite(r.score)]
    deltas = [
        r.score - ref[r.seed].score
        for r in ok
        if r.seed in ref and ref[r.seed].ok and math.isfinite(r.score) and math.isfinite(ref[r.seed].score)
    ]
    ratios, grad_nan = [], False
    for r in ok:
        g = r.grad_norm_max
        if r.grad_norms and not math.isfinite(g):
            grad_nan = True
        a = ref.get(r.seed)
        if a is not None and a.ok and math.isfinite(g) and math.isfinite(a.grad_norm_max) and a.grad_norm_max > 0:
            ratios.append(g / a.grad_norm_max)
    fires = [f for r in ok for f in r.fires]
    proj = [f for f in fires if f.get("projected")]
    evr = [(_nan(f.get("evr1")), _nan(f.get("evr1_null"))) for f in fires]
    evr = [(e, n) for e, n in evr if math.isfinite(e) and math.isfinite(n)]
    return ArmSummary(
        arm=arm,
        n_runs=len(runs),
        n_ok=len(ok),
        score_mean=float(np.mean(scores)) if scores else float("nan"),
        score_std=_std(scores) if scores else float("nan"),
        delta_mean=float(np.mean(deltas)) if deltas and arm != "A" else float("nan"),
        delta_std=_std(deltas) if deltas and arm != "A" else float("nan"),
        grad_ratio=max(ratios) if ratios else float("nan"),
        grad_nan=grad_nan,
        comm_bytes=tuple(r.comm_bytes for r in sorted(ok, key=lambda r: r.seed)),
        grad_comm_bytes=tuple(r.grad_comm_bytes for r in sorted(ok, key=lambda r: r.seed)),
        n_fires=len(fires),
        n_projected=len(proj),
        gated_on=float(np.mean([_nan(f.get("gated_on_fraction")) for f in proj])) if proj else 0.0,
        weight_err_ratio=_median(_nan(f.get("weight_err_ratio")) for f in proj),
        coef_pred_error=_median(_nan(f.get("coef_pred_error")) for f in fires),
        evr1=_median(e for e, _ in evr),
        evr1_null=_median(n for _, n in evr),
        evr1_above_null=float(np.mean([e > n for e, n in evr])) if evr else float("nan"),
    )


def _g(x: float, fmt: str = ".4g") -> str:
    return format(x, fmt) if math.isfinite(x) else "nan"


@dataclass(frozen=True)
class ArmsReport:
    """The arms' summaries, every threshold row and the verdict (``"promote"``, ``"stay on A"``, ``"stop"``)."""

    verdict: str
    reason: str
    rows: tuple
    arms: Mapping[str, ArmSummary]
    runs: tuple
    settings: Mapping[str, Any] = field(default_factory=dict)

    def decide(self) -> tuple[str, str]:
        return self.verdict, self.reason

    def to_dict(self, prefix: str = "anchor_arms/") -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.arms.values():
            out.update(s.to_dict(prefix))
        out[f"{prefix}verdict_promote"] = float(self.verdict == "promote")
        out[f"{prefix}verdict_stop"] = float(self.verdict == "stop")
        return out

    def to_json(self) -> dict[str, Any]:
        def fin(x: Any) -> Any:
            return x if not isinstance(x, float) or math.isfinite(x) else None

        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "settings": dict(self.settings),
            "rows": [r.to_dict() for r in self.rows],
            "arms": {
                a: {k: fin(v) if not isinstance(v, tuple) else [fin(x) for x in v] for k, v in vars(s).items()}
                for a, s in self.arms.items()
            },
            "runs": [r.to_dict() for r in self.runs],
        }

    def _arm_lines(self) -> list[tuple[str, ...]]:
        head = (
            "arm",
            "runs ok",
            "score mean ± std",
            "Δ vs A ± std",
            "grad ×A",
            "comm bytes",
            "grad comm bytes",
            "fires (proj.)",
            "gated-ON",
            "w_err ratio",
            "coef err",
            "EVR1 / null",
        )
        lines = [head]

        def per_seed(xs: tuple) -> str:
            if not xs:
                return "—"
            if all(not math.isfinite(x) for x in xs):
                return "not counted"
            return _g(xs[0], ".6g") if len(set(xs)) == 1 else "/".join(_g(c, ".6g") for c in xs)

        for a, s in self.arms.items():
            lines.append(
                (
                    a,
                    f"{s.n_ok}/{s.n_runs}",
                    f"{_g(s.score_mean)} ± {_g(s.score_std, '.2g')}",
                    "—" if a == "A" else f"{_g(s.delta_mean, '+.4g')} ± {_g(s.delta_std, '.2g')}",
                    "nan" if s.grad_nan else _g(s.grad_ratio, ".3g"),
                    per_seed(s.comm_bytes),
                    # only a single process counts 0: DDP sends every step
                    "0 (single process)"
                    if s.grad_comm_bytes and all(x == 0 for x in s.grad_comm_bytes)
                    else per_seed(s.grad_comm_bytes),
                    f"{s.n_fires} ({s.n_projected})",
                    _g(s.gated_on, ".3f"),
                    _g(s.weight_err_ratio, ".3g"),
                    _g(s.coef_pred_error, ".3g"),
                    f"{_g(s.evr1, '.3f')} / {_g(s.evr1_null, '.3f')}",
                )
            )
        return lines

    def _row_lines(self) -> list[tuple[str, ...]]:
        lines = [("check", "arm", "value", "threshold", "result")]
        for r in self.rows:
            if r.passed is None:
                res = "info"
            elif r.kind == "info":  # an ablation's row: reported, not decided on
                res = ("pass" if r.passed else "fail") + " (info)"
            else:
                res = "PASS" if r.passed else "FAIL"
            lines.append((r.check, r.arm, r.value + (f" ({r.note})" if r.note else ""), r.threshold, res))
        return lines

    def render(self) -> str:
        def table(lines: list[tuple[str, ...]]) -> list[str]:
            w = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
            return ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in lines]

        st = self.settings
        out = [
            f"anchor arms: {st.get('config', '')} · arms {','.join(self.arms)} · seeds {st.get('seeds', '')} · "
            f"{st.get('steps', '')} steps · score {st.get('score', '')}"
        ]
        out += table(self._arm_lines())
        out.append("")
        out += table(self._row_lines())
        out.append("")
        out.append(f"verdict: {self.verdict} ({self.reason})")
        return "\n".join(out)

    def markdown(self) -> str:
        def table(lines: list[tuple[str, ...]]) -> list[str]:
            esc = [tuple(c.replace("|", "\\|") for c in row) for row in lines]
            return ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(esc[0])] + [
                "| " + " | ".join(row) + " |" for row in esc[1:]
            ]

        st = self.settings
        out = [
            f"# Anchor arms: {self.verdict}",
            "",
            f"Config `{st.get('config', '')}`, arms {', '.join(self.arms)}, seeds {st.get('seeds', '')}, "
            f"{st.get('steps', '')} steps, score `{st.get('score', '')}` (last validation).",
            "",
        ]
        out += table(self._arm_lines())
        out.append("")
        out += table(self._row_lines())
        out += ["", f"**Verdict: {self.verdict}** — {self.reason}", ""]
        return "\n".join(out)


def _comm_row(arm: str, pairs: Sequence[tuple[RunResult, RunResult]]) -> Row:
    """Comm parity over all traffic: gradients (every rank) plus the anchor's snapshots and signs, seed by seed.

    Where neither run counted its gradient traffic (a strategy without a counter) the anchor's bytes alone are
    compared and the note says so; where only one of the two did, the row fails: the totals are not comparable.
    """
    check, threshold = "comm bytes = arm A's", "total (gradients + anchor) equal on every seed"
    if not pairs:
        return Row(check, arm, "nan vs nan", threshold, False, note="no seed finished for both arms")
    passed, mixed = True, False
    for r, a in pairs:
        gr, ga = math.isfinite(r.grad_comm_bytes), math.isfinite(a.grad_comm_bytes)
        if gr != ga:
            mixed = True
        passed &= gr == ga and r.comm_bytes == a.comm_bytes and (not gr or r.grad_comm_bytes == a.grad_comm_bytes)
    r, a = pairs[0]
    if mixed:
        return Row(
            check,
            arm,
            f"{_g(r.total_comm_bytes, '.6g')} vs {_g(a.total_comm_bytes, '.6g')}",
            threshold,
            False,
            note="gradient traffic counted in only one of the two runs: "
            + f"{arm}: {r.grad_comm_note or 'counted'}; A: {a.grad_comm_note or 'counted'}",
        )
    if not math.isfinite(r.grad_comm_bytes):
        return Row(
            check,
            arm,
            f"{_g(r.comm_bytes, '.6g')} vs {_g(a.comm_bytes, '.6g')}",
            threshold,
            passed,
            note=f"anchor bytes only; gradient traffic {r.grad_comm_note or 'not counted'}",
        )
    if r.grad_comm_bytes == 0 and a.grad_comm_bytes == 0:
        return Row(
            check,
            arm,
            f"{_g(r.comm_bytes, '.6g')} vs {_g(a.comm_bytes, '.6g')}",
            threshold,
            passed,
            note=r.grad_comm_note or "no gradient traffic",
        )
    return Row(
        check,
        arm,
        f"total {_g(r.total_comm_bytes, '.6g')} (grad {_g(r.grad_comm_bytes, '.6g')} + anchor "
        f"{_g(r.comm_bytes, '.6g')}) vs total {_g(a.total_comm_bytes, '.6g')} (grad "
        f"{_g(a.grad_comm_bytes, '.6g')} + anchor {_g(a.comm_bytes, '.6g')})",
        threshold,
        passed,
        note=f"seed {r.seed}, {r.world_size} ranks",
    )


def decide(
    results: Sequence[RunResult],
    parity: Optional[RunResult] = None,
    *,
    arms: Optional[Sequence[str]] = None,
    floor: float = REGRESSION_FLOOR,
    grad_factor: float = GRAD_NORM_FACTOR,
    gated_on_tol: float = GATED_ON_TOL,
    settings: Optional[Mapping[str, Any]] = None,
) -> ArmsReport:
    r"""The spec's decision over finished runs.

    Args:
        results: one :class:`RunResult` per arm and seed (arm ``A`` must be among them: it is the reference).
        parity: the run without an anchor callback (first seed), compared bitwise with arm ``off``.
        arms: the order of the arms in the report (default: as they first appear in ``results``).
        floor: the ``0.010`` of ``Δ ≥ −max(floor, 2σ)`` (no regression) and ``Δ ≥ max(floor, 2σ)`` (margin);
            ``σ`` is the sample std over seeds of the per-seed difference to arm A (0 with one seed).
        grad_factor: the largest gradient norm may exceed arm A's (same seed) by this factor at most.
        gated_on_tol: "gated-ON ≈ 0": the most mean gated-ON fraction allowed where the projection does not
            help (median ungated weight-error ratio ≥ 1 over projected fires).

    Returns:
        An :class:`ArmsReport`: ``stop`` if any safety row fails, else ``promote`` if C's margin row passes,
        else ``stay on A``.

    Example:
        >>> r = lambda arm, seed, score: RunResult(arm, seed, "ok", score=score, grad_norms=((0, 1.0),))
        >>> rep = decide([r("A", 0, 0.50), r("A", 1, 0.52), r("C", 0, 0.56), r("C", 1, 0.58)])
        >>> rep.verdict, round(rep.arms["C"].delta_mean, 12)
        ('promote', 0.06)
    """
    order = list(arms) if arms is not None else list(dict.fromkeys(r.arm for r in results))
    if "A" not in order:
        raise ValueError(f"`arms` must include 'A' (the reference every arm is compared with), got {order!r}.")
    by_arm: dict[str, list[RunResult]] = {
        a: sorted([r for r in results if r.arm == a], key=lambda r: r.seed) for a in order
    }
    ref = {r.seed: r for r in by_arm["A"]}
    summaries = {a: summarize(a, by_arm[a], ref) for a in order}
    rows: list[Row] = []

    for a in order:
        runs = by_arm[a]
        crashed = [r.seed for r in runs if not r.ok]
        first = next((r for r in runs if not r.ok), None)
        why = _last_line(first.error) if first is not None else ""
        rows.append(
            Row(
                "runs finished",
                a,
                f"{len(runs) - len(crashed)}/{len(runs)}",
                "all seeds exit 0",
                bool(runs) and not crashed,
                note=(f"crashed seeds {crashed}" + (f"; seed {first.seed}: {why}" if why else "")) if crashed else "",
            )
        )
    for a in order:
        if a == "off":
            continue
        refused = [(r.seed, r.refusal) for r in by_arm[a] if r.ok and r.refusal]
        # A refused anchor evaluation leaves .grad as it was: the arm would pass without having been tested.
        rows.append(
            Row(
                "anchor refusals",
                a,
                "none" if not refused else f"{len(refused)} run(s)",
                "no refused fire, gradient or merge",
                not refused,
                note=f"seed {refused[0][0]}: {refused[0][1]}" if refused else "",
            )
        )
    if parity is not None or "off" in order:
        off = next((r for r in by_arm.get("off", []) if parity is not None and r.seed == parity.seed), None)
        if parity is None or off is None or not (parity.ok and off.ok):
            rows.append(
                Row(
                    "off-path parity",
                    "off",
                    "not available",
                    "arm off ≡ no callback, bitwise",
                    False,
                    note="the parity run or arm off did not finish",
                )
            )
        else:
            same = off.param_hash == parity.param_hash and off.scores == parity.scores and bool(off.param_hash)
            rows.append(
                Row(
                    "off-path parity",
                    "off",
                    "identical" if same else "differ",
                    "arm off ≡ no callback, bitwise",
                    same,
                    note=f"seed {off.seed}, final weights sha256 {off.param_hash[:12]} vs {parity.param_hash[:12]}",
                )
            )
    for a in order:
        if a in ("A", "off"):
            continue
        rows.append(_comm_row(a, [(r, ref[r.seed]) for r in by_arm[a] if r.ok and r.seed in ref and ref[r.seed].ok]))
    for a in order:
        s = summaries[a]
        if a == "A":
            value = "nan" if s.grad_nan else ("finite" if s.n_ok else "no run finished")
            rows.append(Row("grad-norm stability", a, value, "no NaN", not s.grad_nan and s.n_ok > 0))
            continue
        if a == "off":
            continue
        passed = (not s.grad_nan) and math.isfinite(s.grad_ratio) and s.grad_ratio <= grad_factor
        note = "" if s.grad_nan or math.isfinite(s.grad_ratio) else "no seed finished for both this arm and arm A"
        rows.append(
            Row(
                "grad-norm stability",
                a,
                "nan" if s.grad_nan else f"{_g(s.grad_ratio, '.3g')}× A",
                f"finite, ≤ {grad_factor:g}× arm A",
                passed,
                note=note,
            )
        )

    def tol(s: ArmSummary) -> float:
        return max(floor, 2.0 * s.delta_std) if math.isfinite(s.delta_std) else floor

    for a in order:
        if a in ("A", "off"):
            continue
        s = summaries[a]
        t = tol(s)
        passed = math.isfinite(s.delta_mean) and s.delta_mean >= -t
        note = ""
        paired = [r for r in by_arm[a] if r.ok and r.seed in ref and ref[r.seed].ok]
        if not math.isfinite(s.delta_mean) and not paired:
            note = "no seed finished for both this arm and arm A"
        elif not math.isfinite(s.delta_mean):
            tags = next((r.logged_tags for r in paired), ())
            note = f"no score: {settings.get('score') if settings else 'the score'!s} was never logged" + (
                f"; logged: {', '.join(tags)}" if tags else ""
            )
        rows.append(
            Row(
                "no regression",
                a,
                f"Δ {_g(s.delta_mean, '+.4g')}",
                f"Δ ≥ −{t:.4g} (max({floor:g}, 2σ))",
                passed,
                kind="safety" if a in SAFETY_ARMS else "info",
                note=note,
            )
        )
    for a in order:
        if a in ("A", "off"):
            continue
        s = summaries[a]
        kind = "safety" if a in SAFETY_ARMS else "info"
        if s.n_projected == 0:
            rows.append(
                Row(
                    "gated-ON ≈ 0 where projection does not help",
                    a,
                    "no projected fire",
                    f"gated-ON ≤ {gated_on_tol:g}",
                    s.n_ok > 0,
                    kind=kind,
                    note="the window never reached n0",
                )
            )
            continue
        helps = math.isfinite(s.weight_err_ratio) and s.weight_err_ratio < 1.0
        if helps:
            rows.append(
                Row(
                    "gated-ON ≈ 0 where projection does not help",
                    a,
                    f"gated-ON {s.gated_on:.3f}",
                    "n/a: the projection helps",
                    True,
                    kind=kind,
                    note=f"median ungated weight-error ratio {_g(s.weight_err_ratio, '.3g')} < 1",
                )
            )
        else:
            rows.append(
                Row(
                    "gated-ON ≈ 0 where projection does not help",
                    a,
                    f"gated-ON {s.gated_on:.3f}",
                    f"≤ {gated_on_tol:g}",
                    s.gated_on <= gated_on_tol,
                    kind=kind,
                    note=f"median ungated weight-error ratio {_g(s.weight_err_ratio, '.3g')} ≥ 1",
                )
            )
    for a in order:
        if a in ("A", "off"):
            continue
        s = summaries[a]
        rows.append(
            Row(
                "coefficient-prediction error",
                a,
                _g(s.coef_pred_error, ".3g"),
                "low (< 1 beats holding)",
                None,
                kind="info",
            )
        )
        rows.append(
            Row(
                "EVR1 against its null",
                a,
                f"{_g(s.evr1, '.3f')} vs {_g(s.evr1_null, '.3f')}",
                "EVR1 above the random-walk null",
                None,
                kind="info",
                note=f"{_g(s.evr1_above_null, '.0%')} of fires above" if math.isfinite(s.evr1_above_null) else "",
            )
        )
    if "C" in order:
        s = summaries["C"]
        t = tol(s)
        rows.append(
            Row(
                "margin (promotes C)",
                "C",
                f"Δ {_g(s.delta_mean, '+.4g')}",
                f"Δ ≥ {t:.4g} (max({floor:g}, 2σ))",
                math.isfinite(s.delta_mean) and s.delta_mean >= t,
                kind="margin",
            )
        )

    failed = [r for r in rows if r.kind == "safety" and r.passed is False]
    margin = next((r for r in rows if r.kind == "margin"), None)
    if failed:
        verdict = "stop"
        reason = "failed: " + "; ".join(f"{r.check} ({r.arm}: {r.value})" for r in failed)
    elif margin is not None and margin.passed:
        verdict, reason = "promote", f"every safety row passes and C clears the margin ({margin.value})"
    else:
        verdict = "stay on A"
        reason = (
            "every safety row passes; C does not clear the margin" + (f" ({margin.value})" if margin else "")
            if "C" in order
            else "every safety row passes; arm C was not run"
        )
    return ArmsReport(
        verdict=verdict,
        reason=reason,
        rows=tuple(rows),
        arms=summaries,
        runs=tuple(results) + ((parity,) if parity is not None else ()),
        settings=dict(settings or {}),
    )


# ---- running the arms ---------------------------------------------------------------------------------------


def _is_anchor(entry: Any) -> bool:
    cp = entry.get("class_path", "") if isinstance(entry, dict) else str(entry)
    return cp.split(".")[-1] == "AnchorProjectionCallback"


def run_config(
    config: Mapping[str, Any],
    arm: str,
    run_dir: Path,
    *,
    anchor_args: Optional[Mapping[str, Any]] = None,
    arm_args: Optional[Mapping[str, Any]] = None,
    score: str = "val/accuracy",
    val_every: Optional[int] = None,
) -> dict[str, Any]:
    """The user's parsed config with the anchor callback set to one arm and a recorder added.

    Any ``AnchorProjectionCallback`` in ``trainer.callbacks`` is removed; its ``init_args`` (updated with
    ``anchor_args``, then the arm's own ``arm_args``) configure the arm's callback. Arm ``none`` gets no anchor
    callback. The run logs (TensorBoard) and saves into ``run_dir``; a progress bar is not drawn.
    """
    cfg = copy.deepcopy(dict(config))
    trainer = dict(cfg.get("trainer") or {})
    cbs = trainer.get("callbacks") or []
    if isinstance(cbs, dict):
        cbs = [cbs]
    base: dict[str, Any] = {}
    kept = []
    for c in cbs:
        if _is_anchor(c):
            base.update((c.get("init_args") or {}) if isinstance(c, dict) else {})
        else:
            kept.append(c)
    base.update(anchor_args or {})
    if arm != PARITY_ARM:
        kept.append({"class_path": ANCHOR_CLASS, "init_args": {**base, **(arm_args or {})}})
    kept.append({"class_path": RECORDER_CLASS, "init_args": {"out": str(run_dir / "record.json"), "score": score}})
    trainer["callbacks"] = kept
    trainer["default_root_dir"] = str(run_dir)
    trainer["enable_progress_bar"] = False
    if trainer.get("logger", True) not in (False, None):
        trainer["logger"] = {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(run_dir), "name": "tb", "version": 0},
        }
    if val_every is not None:
        trainer["val_check_interval"] = int(val_every)
        trainer["check_val_every_n_epoch"] = None
    cfg["trainer"] = trainer
    return cfg


def _fingerprint(cfg: Mapping[str, Any], steps: int, seed: int) -> str:
    return hashlib.sha256(
        json.dumps({"cfg": cfg, "steps": steps, "seed": seed}, sort_keys=True, default=str).encode()
    ).hexdigest()


def _run_one(
    arm: str, seed: int, cfg: dict, run_dir: Path, steps: int, python: str, cwd: Path, timeout: Optional[float]
) -> tuple[RunResult, bool]:
    """Run (or read back) one arm/seed; returns the result and whether it was read back."""
    import yaml

    result_path = run_dir / "result.json"
    fp = _fingerprint(cfg, steps, seed)
    if result_path.is_file():
        try:
            saved = json.loads(result_path.read_text())
            if saved.get("status") == "ok" and saved.get("fingerprint") == fp:
                return RunResult.from_dict(saved), True
        except (ValueError, KeyError, TypeError):
            pass  # an unreadable result is run again
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "record.json").unlink(missing_ok=True)
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [
        python,
        "-m",
        "lens_callbacks",
        "fit",
        "--config",
        str(cfg_path),
        "--trainer.max_steps",
        str(steps),
        "--seed_everything",
        str(seed),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(cwd) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    for attempt in range(PORT_RETRIES + 1):
        # A multi-process run's rendezvous port, one per run: runs in parallel (``jobs > 1``) must never meet
        # at one port, which Lightning's own pick (an ephemeral port, released before rank 0 binds it) allows.
        env["MASTER_PORT"] = str(_rendezvous_port())
        with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
            try:
                rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=err, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -9
        if rc in (0, -9) or not _port_clash((run_dir / "stderr.log").read_text(errors="replace")[-20000:]):
            break  # only a clash at the rendezvous port is run again: it says nothing about the arm
    secs = time.perf_counter() - t0
    record = run_dir / "record.json"
    if rc == 0 and record.is_file():
        rec = json.loads(record.read_text())
        scores = tuple((int(s), _nan(v)) for s, v in rec.get("scores", []))
        res = RunResult(
            arm=arm,
            seed=seed,
            status="ok",
            score=scores[-1][1] if scores else float("nan"),
            scores=scores,
            grad_norms=tuple((int(s), _nan(v)) for s, v in rec.get("grad_norms", [])),
            fires=tuple(rec.get("fires", [])),
            param_hash=str(rec.get("param_hash", "")),
            returncode=0,
            logged_tags=tuple(rec.get("logged_tags", [])),
            seconds=secs,
            refusal=str(rec.get("refusal") or ""),
            **_grad_comm_fields(rec.get("grad_comm")),
        )
    else:
        tail = (run_dir / "stderr.log").read_text(errors="replace")[-2000:]
        why = "timed out" if rc == -9 else (f"exit status {rc}" if rc != 0 else "exit 0 but no record was written")
        res = RunResult(arm=arm, seed=seed, status="crashed", returncode=rc, error=f"{why}\n{tail}", seconds=secs)
    result_path.write_text(json.dumps({**res.to_dict(), "fingerprint": fp}, indent=1))
    return res, False


PORT_RETRIES = 2  # a run that failed only because its rendezvous port was taken is started again, at most this often
_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range (32768–60999): no outgoing connection is given one
_ports_given: set[int] = set()
_ports_lock = threading.Lock()


def _rendezvous_port() -> int:
    """A free TCP port for one run's ``MASTER_PORT``, never the same twice in this process."""
    rng = np.random.default_rng()
    with _ports_lock:
        for _ in range(200):
            port = int(rng.integers(*_PORT_RANGE))
            if port in _ports_given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _ports_given.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {_PORT_RANGE} after 200 tries; free some ports or run with `jobs=1`.")


def _port_clash(stderr: str) -> bool:
    return "EADDRINUSE" in stderr or "ddress already in use" in stderr


def _grad_comm_fields(gc: Any) -> dict[str, Any]:
    """The recorder's ``grad_comm`` entry as :class:`RunResult` fields (a record without one: not recorded)."""
    if not isinstance(gc, Mapping):
        return {}
    return {
        "grad_comm_bytes": _nan(gc.get("bytes")),
        "grad_comm_per_rank": tuple(gc.get("per_rank") or ()),
        "grad_comm_note": str(gc.get("note") or ""),
        "world_size": int(gc.get("world_size") or 1),
    }


def _seeds(seeds: Any) -> list[int]:
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"`seeds` must be a count ≥ 1 or a list of seeds, got {seeds!r}.")
        return list(range(seeds))
    out = [int(s) for s in seeds]
    if not out or len(set(out)) != len(out):
        raise ValueError(f"`seeds` must be a count ≥ 1 or a list of distinct seeds, got {seeds!r}.")
    return out


def run_arms(
    config: Any,
    arms: Sequence[str] = ("off", "A", "C"),
    seeds: Any = 3,
    steps: int = 200,
    out: Any = "anchor_arms",
    *,
    score: str = "val/accuracy",
    anchor_args: Optional[Mapping[str, Any]] = None,
    arm_defs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    val_every: Optional[int] = None,
    jobs: int = 1,
    parity: bool = True,
    python: str = sys.executable,
    cwd: Any = None,
    timeout: Optional[float] = None,
    progress: Any = True,
    floor: float = REGRESSION_FLOOR,
    grad_factor: float = GRAD_NORM_FACTOR,
    gated_on_tol: float = GATED_ON_TOL,
    write: bool = True,
) -> ArmsReport:
    """Run every arm on every seed (resumably) and decide.

    Args:
        config: path of the user's LightningCLI YAML (or the parsed mapping).
        arms: arm names among :data:`ARMS` (or ``arm_defs``); must include ``A``.
        seeds: a count (seeds ``0..n−1``) or a list. steps: ``trainer.max_steps`` of every run.
        out: output directory: ``runs/ARM/seedS/`` per run, ``decision.json``, ``decision.md``, figures.
        score: the logged held-out metric the arms are compared on (its last value per run).
        anchor_args: ``AnchorProjectionCallback`` arguments common to every arm (over the config's own).
        arm_defs: extra or replaced arms, name → arguments (e.g. ``{"E": {"mode": "projected", "kappa": 2}}``).
        val_every: set ``trainer.val_check_interval`` to this many steps (``None``: the config's).
        jobs: runs at once. parity: also run the config without any anchor callback on the first seed
            (compared bitwise with arm ``off``; only when ``off`` is among the arms).
        cwd: working directory of the runs (class paths resolve from it; default: the current one).
        timeout: seconds a run may take before it counts as crashed.
        progress: ``True``: a tqdm bar over runs on stderr (when tqdm is installed); ``False``/``None``: none;
            or a factory ``total -> bar`` with ``update(n)`` and ``close()``.

    A run whose ``result.json`` says it finished with the same config, steps and seed is read back, not re-run;
    a crashed one is run again.
    """

    defs = {**ARMS, **(arm_defs or {})}
    arms = list(arms)
    bad = [a for a in arms if a not in defs]
    if bad:
        raise ValueError(f"`arms` must be among {sorted(defs)!r} (or defined with arm_defs), got unknown {bad!r}.")
    if "A" not in arms:
        raise ValueError(f"`arms` must include 'A' (the reference every arm is compared with), got {arms!r}.")
    if len(set(arms)) != len(arms):
        raise ValueError(f"`arms` must not repeat an arm, got {arms!r}.")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"`steps` must be an int ≥ 1, got {steps!r}.")
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"`jobs` must be an int ≥ 1, got {jobs!r}.")
    seed_list = _seeds(seeds)
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    if isinstance(config, Mapping):
        cfg0, cfg_name = dict(config), "<mapping>"
    else:
        p = Path(config)
        if not p.is_file():
            raise ValueError(f"`config` must be a LightningCLI YAML file, got {str(config)!r} (not a file).")
        from ..io.config import read_config_yaml  # bounded: size, tags, aliases expanded; errors are one line

        cfg0, cfg_name = read_config_yaml(p) or {}, str(config)
        if not isinstance(cfg0, dict):
            raise ValueError(
                f"`config` must hold a YAML mapping (trainer/model/data), got {type(cfg0).__name__} in {cfg_name!r}."
            )
    trainer0 = cfg0.get("trainer")
    if trainer0 is not None and not isinstance(trainer0, Mapping):
        raise ValueError(f"{cfg_name}: field `trainer` must be a mapping, got {type(trainer0).__name__}.")
    cbs0 = (trainer0 or {}).get("callbacks")
    if cbs0 is not None and not isinstance(cbs0, (list, Mapping)):
        raise ValueError(
            f"{cfg_name}: field `trainer.callbacks` must be a list of callbacks, got {type(cbs0).__name__}."
        )
    out = Path(out)
    jobs_list = [(a, s) for a in arms for s in seed_list]
    if parity and "off" in arms:
        jobs_list.append((PARITY_ARM, seed_list[0]))
    work = []
    for a, s in jobs_list:
        run_dir = (out / "runs" / a / f"seed{s}").resolve()
        cfg = run_config(
            cfg0, a, run_dir, anchor_args=anchor_args, arm_args=defs.get(a, {}), score=score, val_every=val_every
        )
        work.append((a, s, cfg, run_dir))
    if progress is True:
        try:
            from tqdm.auto import tqdm

            def progress(total: int) -> Any:
                return tqdm(total=total, desc="anchor-arms", unit="run", file=sys.stderr)
        except ImportError:  # tqdm ships with lightning; without it, no bar
            progress = None
    bar = progress(len(work)) if callable(progress) else None
    results: dict[tuple[str, int], RunResult] = {}
    reread: list[tuple[str, int]] = []
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futs = {pool.submit(_run_one, a, s, cfg, d, steps, python, cwd, timeout): (a, s) for a, s, cfg, d in work}
            for f in as_completed(futs):
                res, was_read = f.result()
                results[futs[f]] = res
                if was_read:
                    reread.append(futs[f])
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    main = [results[(a, s)] for a in arms for s in seed_list]
    par = results.get((PARITY_ARM, seed_list[0]))
    settings = {
        "config": cfg_name,
        "arms": arms,
        "seeds": seed_list,
        "steps": steps,
        "score": score,
        "anchor_args": dict(anchor_args or {}),
        "arm_defs": {a: dict(defs[a]) for a in arms},
        "val_every": val_every,
        "floor": floor,
        "grad_factor": grad_factor,
        "gated_on_tol": gated_on_tol,
        "read_back": sorted(f"{a}/seed{s}" for a, s in reread),
    }
    report = decide(
        main, par, arms=arms, floor=floor, grad_factor=grad_factor, gated_on_tol=gated_on_tol, settings=settings
    )
    if write:
        out.mkdir(parents=True, exist_ok=True)
        (out / "decision.json").write_text(json.dumps(report.to_json(), indent=1))
        (out / "decision.md").write_text(report.markdown())
        figures(report, out)
    return report


def figures(report: ArmsReport, out: Any) -> list[Path]:
    """``scores.png`` (score over steps per arm: the seeds' mean and their min–max band) and ``gated_on.png``
    (gated-ON fraction over steps per projected arm, mean over seeds). Nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out)
    written = []
    color = {a: f"C{i}" for i, a in enumerate(report.arms)}  # one colour per arm in both figures
    fig, ax = plt.subplots(figsize=(6, 3.6))
    drew = False
    for a in report.arms:
        runs = [r for r in report.runs if r.arm == a and r.ok and r.scores]
        if not runs:
            continue
        steps = sorted(set.intersection(*[{s for s, _ in r.scores} for r in runs]))
        if not steps:
            continue
        m = np.array([[dict(r.scores)[s] for s in steps] for r in runs], dtype=float)  # [seeds, steps]
        ax.plot(steps, m.mean(0), color=color[a], label=f"{a} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(steps, m.min(0), m.max(0), color=color[a], alpha=0.15)
        drew = True
    _finish(
        plt,
        fig,
        ax,
        drew,
        str(report.settings.get("score", "score")),
        "score per arm (mean over seeds, band: min–max)",
        out / "scores.png",
        written,
    )
    fig, ax = plt.subplots(figsize=(6, 3.2))
    drew = False
    for a in report.arms:
        runs = [r for r in report.runs if r.arm == a and r.ok and any(f.get("projected") for f in r.fires)]
        if not runs:
            continue
        per: dict[int, list[float]] = {}
        for r in runs:
            for f in r.fires:
                per.setdefault(int(f["t_fast"]), []).append(
                    _nan(f.get("gated_on_fraction")) if f.get("projected") else 0.0
                )
        steps = sorted(per)
        ax.plot(steps, [float(np.mean(per[s])) for s in steps], ".-", color=color[a], label=a)
        drew = True
    _finish(
        plt,
        fig,
        ax,
        drew,
        "gated-ON fraction",
        "gated-ON fraction per fire (mean over seeds)",
        out / "gated_on.png",
        written,
    )
    return written


def _finish(plt: Any, fig: Any, ax: Any, drew: bool, ylabel: str, title: str, path: Path, written: list) -> None:
    """Label, save (when anything was drawn) and close one figure of :func:`figures`."""
    if drew:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        written.append(path)
    plt.close(fig)
