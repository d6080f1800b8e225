"""``lens-callbacks anchor-arms --config CONFIG.yaml --arms off,A,C --seeds 3 --steps N``: the spec's online arms.

Runs the LightningCLI config once per arm and seed, each in its own process and directory under ``--out``,
with ``AnchorProjectionCallback`` set to the arm (see :mod:`lens_callbacks.anchor.arms` for what each arm is),
then prints the per-arm table, every threshold row with its measured value and pass/fail, and the verdict
(``promote`` / ``stay on A`` / ``stop``); writes ``decision.json``, ``decision.md`` and the figures. Finished
runs are read back on the next call, so an interrupted set resumes where it stopped.
Exit status: 0 with a verdict (whatever it is), 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from ..anchor.arms import GATED_ON_TOL, GRAD_NORM_FACTOR, REGRESSION_FLOOR, run_arms
from ._errors import one_line, print_safely

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lens-callbacks anchor-arms",
        description="Run the anchor spec's online arms (off, A, C[, B, D]) on a LightningCLI config and decide.",
    )
    ap.add_argument("--config", type=Path, required=True, help="the LightningCLI YAML to run once per arm and seed")
    ap.add_argument("--arms", default="off,A,C", help="comma-separated arms among off,A,B,C,D (default off,A,C)")
    ap.add_argument(
        "--seeds",
        default="3",
        help="a count n (seeds 0..n-1) or a comma-separated list, e.g. 7, for seed 7 alone (default 3)",
    )
    ap.add_argument("--steps", type=int, required=True, help="trainer.max_steps of every run")
    ap.add_argument("--score", default="val/accuracy", help="logged held-out metric to compare (default val/accuracy)")
    ap.add_argument("--out", type=Path, default=Path("anchor_arms"), help="output directory (default anchor_arms)")
    ap.add_argument("--cadence", type=int, default=None, help="override the anchor's cadence in every arm")
    ap.add_argument(
        "--delay-K", dest="delay_K", type=int, default=None, help="override the anchor's delay_K in every arm"
    )
    ap.add_argument(
        "--anchor-args",
        default=None,
        help="JSON object of AnchorProjectionCallback arguments for every arm, e.g. '{\"w_cap\": 8}'",
    )
    ap.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='define or replace an arm, e.g. --arm \'E={"mode": "projected", "kappa": 2}\' (repeatable)',
    )
    ap.add_argument(
        "--val-every", type=int, default=None, help="validate every this many steps (default: the config's)"
    )
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    ap.add_argument("--no-parity", action="store_true", help="skip the run without any anchor callback")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a run may take before it counts as crashed")
    ap.add_argument(
        "--floor",
        type=float,
        default=REGRESSION_FLOOR,
        help=f"the 0.010 of Δ ≥ −max(0.010, 2σ) (default {REGRESSION_FLOOR})",
    )
    ap.add_argument(
        "--grad-factor",
        type=float,
        default=GRAD_NORM_FACTOR,
        help=f"grad-norm limit × arm A's (default {GRAD_NORM_FACTOR:g})",
    )
    ap.add_argument(
        "--gated-on-tol", type=float, default=GATED_ON_TOL, help=f"'gated-ON ≈ 0' tolerance (default {GATED_ON_TOL})"
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _json_object(name: str, text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise ValueError(f"`{name}` must be a JSON object, got {text!r} ({e}).") from None
    if not isinstance(v, dict):
        raise ValueError(f'`{name}` must be a JSON object such as \'{{"mode": "projected"}}\', got {text!r}.')
    return v


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        seeds = (
            int(args.seeds) if args.seeds.strip().isdigit() else [int(s) for s in args.seeds.split(",") if s.strip()]
        )
        anchor_args = _json_object("--anchor-args", args.anchor_args) if args.anchor_args else {}
        if args.cadence is not None:
            anchor_args["cadence"] = args.cadence
        if args.delay_K is not None:
            anchor_args["delay_K"] = args.delay_K
        defs = {}
        for spec in args.arm:
            name, sep, body = spec.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"`--arm` must be NAME=JSON, got {spec!r}.")
            defs[name.strip()] = _json_object(f"--arm {name.strip()}", body)
        report = run_arms(
            args.config,
            arms,
            seeds,
            args.steps,
            args.out,
            score=args.score,
            anchor_args=anchor_args,
            arm_defs=defs,
            val_every=args.val_every,
            jobs=args.jobs,
            parity=not args.no_parity,
            timeout=args.timeout,
            progress=not args.no_progress,
            floor=args.floor,
            grad_factor=args.grad_factor,
            gated_on_tol=args.gated_on_tol,
        )
    except (ValueError, OSError) as e:  # a bad argument or config file: one line naming it, never a traceback
        print(one_line(f"anchor-arms: {e}"), file=sys.stderr)
        return 2
    print_safely(report.render())
    print(f"\nwritten: {args.out / 'decision.json'}, {args.out / 'decision.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
