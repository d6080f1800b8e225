"""Cost of the bounded SkyRL reader: the checks against the bare unpickle-and-decode they guard.

    python benchmarks/read_cost.py [--rows 512] [--width 4096] [--repeats 5]

A synthetic dump in the current layout (plain state dict) with ``rows × width`` int64 sequences and
float32 response tensors is written once; then, in one run, interleaved:

- ``bare``: ``open().read()`` + ``pickle.loads`` with the reader's own outer unpickler + numpy decoding of
  every entry (what reading cost before the bounds);
- ``read_skyrl_dump``: the full reader (regular-file check, size cap, opcode scan, budget, shape and
  finiteness checks, padding rows dropped, torch tensors).

Reports medians and their ratio (timing noise of a shared machine cancels in the ratio), and the opcode
scan alone.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from lens_callbacks.io.safe import ReadLimits, scan_pickle  # noqa: E402
from lens_callbacks.io.skyrl import _OuterUnpickler, read_skyrl_dump  # noqa: E402


def _entry(a: np.ndarray) -> dict:
    return {"format": "numpy", "data": a.tobytes(), "shape": a.shape, "dtype": str(a.dtype)}


def make_dump(path: Path, rows: int, width: int) -> None:
    rng = np.random.default_rng(0)
    R = width // 2
    resp = np.ones((rows, R), np.int64)
    bd = {
        "sequences": _entry(rng.integers(0, 150000, (rows, width), dtype=np.int64)),
        "attention_mask": _entry(np.ones((rows, width), np.int64)),
        "response_mask": _entry(resp),
        "loss_mask": _entry(resp.astype(np.float32)),
        "action_log_probs": _entry(rng.standard_normal((rows, R)).astype(np.float32)),
        "base_action_log_probs": _entry(rng.standard_normal((rows, R)).astype(np.float32)),
        "returns": _entry(rng.standard_normal((rows, R)).astype(np.float32)),
        "advantages": _entry(rng.standard_normal((rows, R)).astype(np.float32)),
    }
    meta = {"pad_size": 0, "response_length": R, "policy_prompt_boundaries": [(i, i + 4) for i in range(0, rows, 4)]}
    path.write_bytes(
        pickle.dumps({"batch_dict": bd, "batch_size": rows, "device": "cpu", "metadata": meta}, protocol=4)
    )


def bare(path: Path) -> int:
    data = open(path, "rb").read()
    state = _OuterUnpickler(io.BytesIO(data), str(path)).load()
    out = [np.frombuffer(e["data"], e["dtype"]).reshape(e["shape"]).copy() for e in state["batch_dict"].values()]
    return sum(a.nbytes for a in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "global_step_1_training_input.pkl"
        make_dump(path, a.rows, a.width)
        size = os.path.getsize(path)
        data = path.read_bytes()
        t_bare, t_read, t_scan = [], [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            bare(path)
            t1 = time.perf_counter()
            read_skyrl_dump(path)
            t2 = time.perf_counter()
            scan_pickle(data, str(path), ReadLimits())
            t3 = time.perf_counter()
            t_bare.append(t1 - t0)
            t_read.append(t2 - t1)
            t_scan.append(t3 - t2)
        mb, mr, ms = (statistics.median(x) for x in (t_bare, t_read, t_scan))
        print("| dump | bare unpickle+decode | read_skyrl_dump | ratio | opcode scan alone |")
        print("|---|---|---|---|---|")
        print(
            f"| {a.rows}x{a.width}, {size / 2**20:.0f} MiB | {mb * 1e3:.0f} ms | {mr * 1e3:.0f} ms | {mr / mb:.2f} | {ms * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
