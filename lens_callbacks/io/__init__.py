"""lens_callbacks.io (pure torch/numpy; never imports lightning)."""

from .skyrl import SkyRLDump, read_skyrl_dump

__all__ = ["read_skyrl_dump", "SkyRLDump"]
