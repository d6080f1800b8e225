"""For tests that fit under ``strategy="ddp_spawn"`` on gloo: each worker destroys its process group as it exits.

Lightning destroys the group at exit only for NCCL. A gloo group left to the interpreter's exit was seen to
abort a worker after a fit that passed ("terminate called without an active exception", SIGABRT), which
fails the test; an ``atexit`` handler (run before the C++ static destructors) closes the group first.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


def _destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class DestroyGroupAtExit(Callback):
    """Registers, in each worker, the handler that destroys the process group at exit."""

    def setup(self, trainer, pl_module, stage) -> None:
        atexit.unregister(_destroy_group)  # once per process, however many fits it runs
        atexit.register(_destroy_group)


def leave_rank() -> None:
    """The last line of a worker script whose results are written: close the group and leave without the
    interpreter's teardown. With the group closed a rank still aborted so at exit now and then (its C++
    static destructors and joinable threads); every collective is over, so nothing is lost by skipping it."""
    _destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
