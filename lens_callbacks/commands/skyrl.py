"""``lens-callbacks skyrl DUMP``: a SkyRL dump's summary (rows, groups, keys, advantages per group)."""

from __future__ import annotations

import json
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    from ._errors import OneLineArgumentParser, add_debug_flag, print_safely, report_error

    parser = OneLineArgumentParser(
        prog="lens-callbacks skyrl",
        description="Read a SkyRL global_step_N_training_input.pkl through a restricted unpickler (skyrl is "
        "never imported, nothing the file names is called) and print its summary.",
    )
    parser.add_argument("path", help="a SkyRL dump file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_debug_flag(parser)
    args = parser.parse_args(list(argv))

    from ..io.skyrl import read_skyrl_dump

    try:  # a bad dump is one line naming the file and field (or the limit it exceeded), exit 2
        dump = read_skyrl_dump(args.path)
        text = json.dumps(dump.summary(), indent=2) if args.json else dump.render()
        print_safely(text)
    except Exception as err:
        return report_error("lens-callbacks skyrl", err, args.debug)
    return 0
