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
        num_val_prompts: size of a validation set of pairs drawn apart from the training prompts' stream
            (0: no validation). The module scores it by greedy decoding (``val/accuracy``).
    """

    def __init__(
        self,
        batch_size: int = 4,
        max_operand: int = 9,
        num_prompts: int = 256,
        data_seed: int = 0,
        num_val_prompts: int = 0,
    ) -> None:
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
        if isinstance(num_val_prompts, bool) or not isinstance(num_val_prompts, int) or num_val_prompts < 0:
            raise ValueError(f"`num_val_prompts` must be an int >= 0 (0: no validation), got {num_val_prompts!r}.")
        self.num_val_prompts = num_val_prompts
        # Its own seed, so adding a validation set leaves the training prompts as they were.
        gv = torch.Generator().manual_seed(data_seed + 2)
        self.val_pairs = torch.randint(0, max_operand + 1, (num_val_prompts, 2), generator=gv)  # [Nv, 2]
        if num_val_prompts == 0:
            # Without a validation set the datamodule is one that defines no val_dataloader (Lightning then
            # runs no validation loop; an empty loader would warn on every fit).
            self.val_dataloader = super().val_dataloader

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            TensorDataset(self.pairs), batch_size=self.batch_size, shuffle=True, data_seed=self.data_seed + 1
        )

    def val_dataloader(self) -> DataLoader:
        # A generator of its own: a DataLoader iterator without one draws its base seed from the global
        # stream, which would shift the training run's sampling after every validation.
        return DataLoader(
            TensorDataset(self.val_pairs),
            batch_size=max(self.batch_size, 32),
            shuffle=False,
            generator=torch.Generator().manual_seed(self.data_seed + 3),
        )
