"""Single-turn GRPO on small-number addition: a tiny offline GPT-2 policy that implements ``credit_terms``.

YAML class paths: ``lens_callbacks.examples.grpo.GRPOModule`` and ``lens_callbacks.examples.grpo.AdditionDataModule``.
"""

from .data import AdditionDataModule
from .module import GRPOModule, Rollout, RolloutBatch
from .task import build_tokenizer, reward

__all__ = ["GRPOModule", "AdditionDataModule", "RolloutBatch", "Rollout", "build_tokenizer", "reward"]
