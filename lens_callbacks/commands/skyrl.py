"""``lens-callbacks skyrl DUMP``: a SkyRL dump's summary (rows, groups, keys, advantages per group)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lens-callbacks skyrl",
        description="Read a SkyRL global_step_N_training_input.pkl through a restricted unpickler (skyrl is "
        "never imported, nothing the file names is called) and print its summary.",
    )
    parser.add_argument("path", help="a SkyRL dump file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(list(argv))

    from ..io.skyrl import SkyRLDumpError, read_skyrl_dump

    try:
        dump = read_skyrl_dump(args.path)
    except (OSError, SkyRLDumpError) as err:
        print(f"lens-callbacks skyrl: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dump.summary(), indent=2))
    else:
        print(dump.render())
    return 0
