"""``lens-callbacks process RECORD_OR_DUMP``: the G3 table over every group of a run record or SkyRL dump."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lens-callbacks process",
        description="Audit every group of a run record (a directory with trajectories/) or a SkyRL dump "
        "(a global_step_N_training_input.pkl, or a directory of them) for the process reward its outcomes induce.",
    )
    parser.add_argument("path", help="run-record directory, SkyRL dump file, or directory of dumps")
    parser.add_argument("--groups", type=int, default=0, help="also print the first N groups' readings")
    parser.add_argument("--json", action="store_true", help="print the aggregate numbers as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(list(argv))

    from ..io.skyrl import SkyRLDumpError
    from ..process import audit_groups, load_groups

    try:
        groups, source = load_groups(args.path)
    except (OSError, ValueError, SkyRLDumpError) as err:
        print(f"lens-callbacks process: {err}", file=sys.stderr)
        return 2
    audit = audit_groups(groups, source=source, progress=not args.no_progress and len(groups) > 50)
    if args.json:
        print(json.dumps(audit.numbers(), indent=2, sort_keys=True))
    else:
        print(audit.render())
        for reading in audit.readings[: max(args.groups, 0)]:
            print()
            print(reading.render())
    return 0
