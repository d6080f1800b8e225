"""Lightning callbacks: thin adapters over the Trainer-free core (and the arms' PowerSGD strategy)."""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule; imported on first access so one callback's extras never load another's.
_CALLBACKS = {
    "CreditAuditCallback": "credit_audit",
    "ExtraReadings": "credit_audit",
    "ConservationCheckCallback": "conservation",
    "ProcessRewardCallback": "process",
    "AnchorProjectionCallback": "anchor",
    "RunRecordCallback": "records",
    "ProbeCreditCallback": "probe",
    "PowerSGDStrategy": "powersgd",
}

__all__ = list(_CALLBACKS)


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        return getattr(importlib.import_module(f"{__name__}.{_CALLBACKS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
