#!/usr/bin/env bash
# Sets up .venv as scripts/test.sh does, trains the tiny GRPO example with the credit audit attached
# (a few minutes on a 2-core CPU). The callback prints the last credit report at the end of fit
# (print_last_report in the YAML) and keeps it in <run dir>/credit_last.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first and pinned: a bare requirement would pull a multi-GB CUDA build on a CPU machine.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e '.[dev,examples]'
# The policy is tiny: one thread per process is faster than two fighting over a small CPU.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m lens_callbacks fit --config cli_configs/grpo_credit.yaml --trainer.enable_progress_bar=false "$@"
run_dir="$PWD/$(ls -td runs/grpo_credit/version_* | head -n 1)"  # absolute: the lines below work from anywhere
echo
echo "last credit report: $run_dir/credit_last.txt"
echo "view the run: tensorboard --logdir $run_dir"
