"""Multi-turn GRPO with a calculator tool (see ``docs/multi_turn.md``)."""

from .module import GRPOToolsModule, ToolRolloutBatch, ToolsAdditionDataModule, group_advantages

__all__ = ["GRPOToolsModule", "ToolsAdditionDataModule", "ToolRolloutBatch", "group_advantages"]
