#!/usr/bin/env bash
# Sets up a virtual environment from scratch and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first and pinned: a bare requirement would pull a multi-GB CUDA build on a CPU machine.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# The versions the suite last passed with: a release of a dependency moves the readings docs/ quotes.
.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e '.[dev,examples]'
# Lint and format first (seconds): a style failure is reported before the suite runs.
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
# -m "": every test, the slow end-to-end runs included (a plain `pytest` leaves them out).
# -n 2: two processes (pytest-xdist), one per core of the 2-core machines CI runs on; each test runs one
# thread (tests/conftest.py), so two fill the cores without oversubscribing them. `-n N` after it uses
# N cores, `-n 0` one process.
exec .venv/bin/python -m pytest -m "" -n 2 "$@"
