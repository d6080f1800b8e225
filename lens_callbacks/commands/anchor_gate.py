"""``lens-callbacks anchor-gate DIR --cadence C --delay-K K``: the offline gate over saved checkpoints.

Replays the weights saved in ``DIR`` (Lightning ``.ckpt`` or plain state-dict ``.pt`` files; the step is
``global_step`` inside the file or ``step=N``/``step_N`` in its name) through a simulated delayed anchor and
prints, per fire, the rank-1 fit readings and the weight-prediction error against the stale snapshot and
velocity extrapolation, then the decision.

Checkpoints travel between people: each file is read bounded and loaded with ``weights_only=True``
(:func:`lens_callbacks.io.safe.load_torch_checkpoint`: regular files only, a size cap, members stored
uncompressed, tensors checked against their storage). A bad file is one line on stderr naming it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from ..anchor import Rank1TrajProjector, load_checkpoints, replay
from ._errors import OneLineArgumentParser, add_debug_flag, one_line, print_safely, report_error, shown_path

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(
        prog="lens-callbacks anchor-gate",
        description="Replay saved checkpoints through a delayed anchor and score the rank-1 projection.",
    )
    ap.add_argument("directory", type=Path, help="directory of *.ckpt / *.pt files, one per saved step")
    ap.add_argument("--cadence", type=int, required=True, help="steps between snapshots (> 0)")
    ap.add_argument(
        "--delay-K", dest="delay_K", type=int, required=True, help="steps before a snapshot is visible (≥ 0)"
    )
    ap.add_argument("--w-cap", type=int, default=16, help="most snapshots in the fit window (default 16)")
    ap.add_argument("--n0", type=int, default=4, help="snapshots before projecting (default 4)")
    ap.add_argument("--h-safe", type=int, default=None, help="cap on the de-stale distance in steps (default: none)")
    ap.add_argument("--pool", default="layer", choices=("layer", "global", "tensor"), help="gate block (default layer)")
    ap.add_argument("--r2-min", type=float, default=0.7, help="R² where the line starts to earn trust (default 0.7)")
    ap.add_argument(
        "--null-quantile", type=float, default=0.95, help="random-walk EVR1 quantile to beat (default 0.95)"
    )
    ap.add_argument(
        "--null-dim", type=int, default=None, help="dimension of the random walk behind the null (default: block size)"
    )
    ap.add_argument("--no-retro-gate", action="store_true", help="trust from the spec's four factors only")
    ap.add_argument("--prefix", default="", help="only tensors whose name starts with this")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary and every fire's readings here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(ap)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.directory.is_dir():
        print(
            one_line(
                f"lens-callbacks anchor-gate: `directory` must be a directory of checkpoints, got {shown_path(args.directory)!r}."
            ),
            file=sys.stderr,
        )
        return 2
    try:
        weights = load_checkpoints(args.directory, args.prefix)
        projector = Rank1TrajProjector(
            n0=args.n0,
            w_cap=args.w_cap,
            h_safe=args.h_safe,
            pool=args.pool,
            r2_min=args.r2_min,
            null_quantile=args.null_quantile,
            null_dim=args.null_dim,
            retro_gate=not args.no_retro_gate,
        )
        progress = None  # without tqdm (it ships with lightning), no bar
        if not args.no_progress:
            try:
                from tqdm.auto import tqdm

                def progress(it):
                    return tqdm(it, desc="anchor-gate", unit="snapshot", file=sys.stderr)
            except ImportError:
                pass
        try:
            report = replay(weights, args.cadence, args.delay_K, projector=projector, progress=progress)
        except ValueError as err:  # about the folder's checkpoints as a whole: name the folder
            raise ValueError(f"{args.directory}: {err}") from None
        print_safely(report.render())
        if args.json is not None:
            payload = {
                "summary": {
                    **report.to_dict(""),
                    "decision": report.decision,
                    "reason": report.reason,
                    "cadence": report.cadence,
                    "delay_K": report.delay_K,
                },
                "fires": [r.to_dict("") for r in report.readings],
            }
            args.json.write_text(json.dumps(payload, indent=2))
    except Exception as e:  # a bad checkpoint or argument is one line naming it, never a traceback
        return report_error("lens-callbacks anchor-gate", e, args.debug)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
