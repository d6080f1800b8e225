"""Run console-script commands in forked children of a warm worker: memory limit, timeout, peak RSS.

Each hostile input must be refused by the real command (``lens_callbacks.cli.main``), so each runs in a
process of its own; starting Python and importing torch for every one of dozens of cases would take
minutes. A worker process imports the package once, then forks a child per case. The child:

- gets an address-space limit (``RLIMIT_AS``) of its size at fork plus ``mem_mb``, so a regression cannot
  take the machine down (an allocation beyond it fails inside the child);
- writes stdout/stderr to files, runs ``main(argv)`` in ``cwd``, and exits with its status.

The worker waits with ``os.wait4``, kills the child at the timeout, and reports the exit status, both
streams, the wall time, and the child's peak resident memory (``ru_maxrss``, which on Linux counts the
pages the child inherited and touched as well as its own: the peak of the whole command, as a user
would see it).

Protocol: one JSON object per line on stdin (``argv``, ``cwd``, ``timeout``, ``mem_mb``, ``env``); one
JSON object per line on stdout.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(case: dict, out_path: str, err_path: str) -> None:
    code = 70
    try:
        os.setsid()
        limit = _vm_size_bytes() + int(case.get("mem_mb", 1024)) * (1 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        os.chdir(case.get("cwd") or os.getcwd())
        os.environ.update(case.get("env") or {})
        from lens_callbacks.cli import main

        try:
            code = int(main(list(case["argv"])) or 0)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 71
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_case(case: dict) -> dict:
    tmp = tempfile.mkdtemp(prefix="lens-isolated-")
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(case, out_path, err_path)
    timeout = float(case.get("timeout", 30))
    timed_out = False
    while True:
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid == pid:
            break
        if time.monotonic() - t0 > timeout:
            timed_out = True
            os.killpg(pid, signal.SIGKILL)
            wpid, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    wall = time.monotonic() - t0
    rc = os.waitstatus_to_exitcode(status)
    res = {
        "rc": rc,
        "stdout": Path(out_path).read_text(errors="replace") if os.path.exists(out_path) else "",
        "stderr": Path(err_path).read_text(errors="replace") if os.path.exists(err_path) else "",
        "wall_s": wall,
        "peak_mb": usage.ru_maxrss / 1024.0,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "timed_out": timed_out,
    }
    for p in (out_path, err_path):
        if os.path.exists(p):
            os.unlink(p)
    os.rmdir(tmp)
    return res


def main() -> None:
    for mod in sys.argv[1:]:  # warm imports, paid once for every case
        __import__(mod)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        sys.stdout.write(json.dumps(run_case(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
