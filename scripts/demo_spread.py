"""Run the demo once per ATen CPU kernel set and print how far each reading docs/readings.md quotes moves.

The demo's arithmetic takes ATen's vectorised kernels for the CPU it runs on (``ATEN_CPU_CAPABILITY``:
``default`` = scalar, ``avx2``, ``avx512`` where the CPU has it), and 200 steps of training carry their
rounding differences into the readings. This script is how the spreads in
``tests/examples/test_demo_readings.py`` were measured::

    .venv/bin/python scripts/demo_spread.py            # about 2 minutes per kernel set on one core

It prints, per quoted reading, the value under each kernel set and the relative spread (max − min) / |max|.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def capabilities() -> list[str]:
    """The kernel sets this CPU can run: ``default`` and ``avx2`` always (x86-64), ``avx512`` where present."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["default", "avx2"] + (["avx512"] if "avx512f" in flags else [])


def run(cap: str, out: Path) -> dict[str, float]:
    from tests.examples.test_demo_readings import QUOTES, DemoRun

    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lens_callbacks",
            "fit",
            "--config",
            str(ROOT / "cli_configs" / "grpo_credit.yaml"),
            f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.enable_progress_bar=false",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SystemExit(f"the demo failed under ATEN_CPU_CAPABILITY={cap}: {r.stderr[-2000:]}")
    demo = DemoRun(out / "grpo_credit" / "version_0")
    return {key: float(fn(demo)) for key, fn in QUOTES.items()}


def main() -> None:
    caps = capabilities()
    with tempfile.TemporaryDirectory() as tmp:
        values = {cap: run(cap, Path(tmp) / cap) for cap in caps}
    print(f"{'reading':24s} " + " ".join(f"{c:>12s}" for c in caps) + "   spread")
    spreads = {}
    for key in values[caps[0]]:
        vals = [values[c][key] for c in caps]
        hi = max(abs(v) for v in vals)
        spreads[key] = (max(vals) - min(vals)) / hi if hi else 0.0
        print(f"{key:24s} " + " ".join(f"{v:12.5g}" for v in vals) + f"   {spreads[key]:.2e}")
    print(json.dumps({"capabilities": caps, "values": values, "spreads": spreads}))


if __name__ == "__main__":
    main()
