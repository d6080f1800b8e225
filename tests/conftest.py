"""Suite-wide settings and the console-script runner the end-to-end tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Tiny models: thread start-up costs more than it saves on 2 shared cores. Set once here, rather than
# as a side effect of whichever test module happens to be imported first.
torch.set_num_threads(1)


def _inductor_vector_isa_under_default_kernels() -> None:
    """Under ``ATEN_CPU_CAPABILITY=default`` torch 2.13's inductor picks no vector ISA, yet some of its CPU
    kernels still emit ``at::vec::Vectorized`` code, which then fails to compile (``'at::vec' has not been
    declared``) — in plain torch, for any compiled model. The eager kernels stay the default ones (what the
    variable selects); inductor's own generated code is given the widest ISA this CPU has, as it picks
    without the variable. On a CPU with none, the compile tests fail as torch does."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "default":
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    isas = valid_vec_isa_list()
    if isas and inductor_config.cpp.simdlen is None:
        inductor_config.cpp.simdlen = max(isa.bit_width() for isa in isas)


_inductor_vector_isa_under_default_kernels()


@pytest.fixture
def run_cli():
    """Run ``python -m lens_callbacks ARGS`` from the repository root, as a user would.

    Returns the ``CompletedProcess``; ``check=True`` asserts exit status 0 and shows the output's tail.
    """

    def run(*args: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
        env = dict(
            os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
        )
        r = subprocess.run(
            [sys.executable, "-m", "lens_callbacks", *map(str, args)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    return run
