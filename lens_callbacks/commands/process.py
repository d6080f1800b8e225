"""``lens-callbacks process RECORD_OR_DUMP``: the G3 table over every group of a run record or SkyRL dump."""

from __future__ import annotations

import json
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    from ._errors import OneLineArgumentParser, add_debug_flag, print_safely, report_error

    parser = OneLineArgumentParser(
        prog="lens-callbacks process",
        description="Audit every group of a run record (a directory with trajectories/) or a SkyRL dump "
        "(a global_step_N_training_input.pkl, or a directory of them) for the process reward its outcomes induce.",
    )
    parser.add_argument("path", help="run-record directory, SkyRL dump file, or directory of dumps")
    parser.add_argument("--groups", type=int, default=0, help="also print the first N groups' readings")
    parser.add_argument("--json", action="store_true", help="print the aggregate numbers as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_debug_flag(parser)
    args = parser.parse_args(list(argv))

    from ..process import audit_groups, load_groups

    try:  # a bad record or dump is one line naming the file and field, exit 2
        groups, source = load_groups(args.path)
        audit = audit_groups(groups, source=source, progress=not args.no_progress and len(groups) > 50)
        if args.json:
            text = json.dumps(audit.numbers(), indent=2, sort_keys=True)
        else:
            text = "\n".join([audit.render(), *("\n" + r.render() for r in audit.readings[: max(args.groups, 0)])])
        print_safely(text)
    except Exception as err:
        return report_error("lens-callbacks process", err, args.debug)
    return 0
