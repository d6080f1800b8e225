"""lens_callbacks: Lightning callbacks that audit what one RL step of a language-model policy did.

The core (``credit``, ``process``, ``anchor``, ``io``) is pure torch/numpy. The callbacks are loaded
lazily so that ``import lens_callbacks.credit`` never imports lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from .refusal import ReadingWarning, Refusal

__version__ = "0.1.0"

# name -> module that defines it; resolved on first attribute access (PEP 562).
_LAZY = {
    "CreditAuditCallback": "lens_callbacks.callbacks",
    "ExtraReadings": "lens_callbacks.callbacks",
    "ConservationCheckCallback": "lens_callbacks.callbacks",
    "AnchorProjectionCallback": "lens_callbacks.callbacks",
    "ProcessRewardCallback": "lens_callbacks.callbacks",
    "RunRecordCallback": "lens_callbacks.callbacks",
    "ProbeCreditCallback": "lens_callbacks.callbacks",
    "CreditTerms": "lens_callbacks.credit",
    "CreditSource": "lens_callbacks.credit",
    "disintegrate": "lens_callbacks.credit",
    "read_skyrl_dump": "lens_callbacks.io",
    "SkyRLDump": "lens_callbacks.io",
    "induced_process_reward": "lens_callbacks.process",
    "audit_groups": "lens_callbacks.process",
}

__all__ = ["Refusal", "ReadingWarning", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lens_callbacks' has no attribute {name!r}")
