"""lens_callbacks.io (pure torch/numpy; never imports lightning)."""

from .safe import BoundedReadError, ReadLimits
from .skyrl import SkyRLDump, read_skyrl_dump
from .trust import TrustPolicy

__all__ = ["read_skyrl_dump", "SkyRLDump", "ReadLimits", "BoundedReadError", "TrustPolicy"]
