"""Suite-wide settings, the console-script runner the end-to-end tests share and the benchmark scripts' loader."""

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


def _inductor_vector_isa_under_forced_kernels() -> None:
    """Under ``ATEN_CPU_CAPABILITY`` torch 2.13's inductor picks its own CPU vector ISA wrongly, in plain torch:

    - ``default``: it picks no vector ISA yet some kernels still emit ``at::vec::Vectorized`` code, which fails
      to compile (``'at::vec' has not been declared``) for any compiled model;
    - ``avx2`` on an AVX-512 machine: a compiled tiny Llama given position ids reads NaN from its first
      forward (measured; with the ISA named explicitly, at 256 bits as at 512, the same model reads finite
      values equal to eager's).

    The eager kernels stay the ones the variable selects; inductor's generated code is given its ISA
    explicitly: the variable's width (``avx2`` 256 bits, ``avx512`` 512), or under ``default`` the widest this
    CPU has, as it picks without the variable. On a CPU with no vector ISA, the compile tests fail as torch does.
    """
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability is None:
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if inductor_config.cpp.simdlen is not None:
        return
    width = {"avx2": 256, "avx512": 512}.get(capability)
    if width is None:  # default: the widest this CPU has
        width = max((isa.bit_width() for isa in valid_vec_isa_list()), default=None)
    if width is not None:
        inductor_config.cpp.simdlen = width


_inductor_vector_isa_under_forced_kernels()


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


@pytest.fixture
def bench_script():
    """Load ``benchmarks/<name>.py`` as a module (once per session: ``sys.modules`` keeps it, as its
    dataclasses need; ``benchmarks/`` joins ``sys.path`` for the scripts that import each other)."""
    import importlib.util

    def load(name: str):
        if name in sys.modules:
            return sys.modules[name]
        if str(ROOT / "benchmarks") not in sys.path:
            sys.path.insert(0, str(ROOT / "benchmarks"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
