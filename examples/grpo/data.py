"""Prompts for the addition task: each batch is ``[P, 2]`` operand pairs (the policy turns them into text)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..resumable import ResumableDataLoader

try:
    from lightning.pytorch import LightningDataModule
except ImportError:  # pragma: no cover - the examples need lightning
    from pytorch_lightning import LightningDataModule  # type: ignore

__all__ = ["AdditionDataModule"]


class AdditionDataModule(LightningDataModule):
    """``num_prompts`` fixed pairs ``(a, b)`` with ``0 <= a, b <= max_operand``, ``batch_size`` prompts per step.

    Args:
        batch_size: prompts per training step (each is sampled ``group_size`` times by the module).
        max_operand: largest operand, 1..9 (single digits keep every prompt the same length).
        num_prompts: size of the prompt set.
        data_seed: seeds the prompt set and the shuffling (its own generator; the global RNG is untouched).
            Epoch ``e``'s order depends on ``data_seed`` and ``e`` only, and the position within the epoch
            is checkpointed, so a resumed run continues the data order where it stopped.
            Named apart from the module's ``seed`` so the two hparams never clash in a logger.
    """

    def __init__(self, batch_size: int = 4, max_operand: int = 9, num_prompts: int = 256, data_seed: int = 0) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}.")
        if not isinstance(max_operand, int) or not 1 <= max_operand <= 9:
            raise ValueError(f"`max_operand` must be an int in 1..9 (single-digit operands), got {max_operand!r}.")
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"`num_prompts` must be a positive int, got {num_prompts!r}.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.max_operand = max_operand
        self.num_prompts = num_prompts
        self.data_seed = data_seed
        g = torch.Generator().manual_seed(data_seed)
        self.pairs = torch.randint(0, max_operand + 1, (num_prompts, 2), generator=g)  # [N, 2]

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(TensorDataset(self.pairs), batch_size=self.batch_size, shuffle=True, data_seed=self.data_seed + 1)
