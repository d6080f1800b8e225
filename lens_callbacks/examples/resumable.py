"""A training data order that a run killed mid-epoch resumes exactly.

Epoch ``e`` visits the items in the order ``randperm(n, seed = data_seed·1_000_003 + e)`` (or ``0 .. n−1``
without shuffling), so the order of every epoch is a function of the seed and the epoch alone. The
sampler counts the items it has handed out; that count and the epoch are its ``state_dict``, which
:class:`ResumableDataLoader` exposes so that Lightning stores it in the checkpoint and gives it back on
resume (``fit_loop`` saves the state of every train loader with ``state_dict``/``load_state_dict``).

The count is exact because nothing reads ahead: the loader has a length, so Lightning's fetcher does
not prefetch, and with ``num_workers=0`` the batch sampler takes items one batch at a time. (Worker
processes read ahead; this loader keeps ``num_workers=0``.)
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ResumableSampler", "ResumableDataLoader"]

_EPOCH_STRIDE = 1_000_003


class ResumableSampler(Sampler[int]):
    """Indices ``0 .. n−1`` in a per-epoch order that depends on ``(data_seed, epoch)`` only.

    Example:
        >>> s = ResumableSampler(4, shuffle=False)
        >>> it = iter(s); [next(it), next(it)], s.state_dict()
        ([0, 1], {'epoch': 0, 'position': 2})
        >>> t = ResumableSampler(4, shuffle=False); t.load_state_dict(s.state_dict()); list(t)
        [2, 3]
    """

    def __init__(self, n: int, shuffle: bool = True, data_seed: int = 0) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"`n` must be a positive int, got {n!r}.")
        self.n = n
        self.shuffle = bool(shuffle)
        self.data_seed = int(data_seed)
        self.epoch = 0
        self.position = 0  # items of `epoch` already handed out

    def __len__(self) -> int:
        return self.n

    def order(self, epoch: int) -> list[int]:
        """The visiting order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.data_seed * _EPOCH_STRIDE + int(epoch))
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.n:  # the last epoch was used up: a new iterator starts the next one
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position < self.n:
            i = order[self.position]
            self.position += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class ResumableDataLoader(DataLoader):
    """A single-process ``DataLoader`` over a :class:`ResumableSampler` whose state Lightning checkpoints."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool = True,
        data_seed: int = 0,
        sampler: Any = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("num_workers", 0):
            raise ValueError(
                f"`num_workers` must be 0 for a resumable data order, got {kwargs['num_workers']!r}: worker "
                "processes read ahead of the step that is checkpointed."
            )
        self.resumable_sampler = ResumableSampler(len(dataset), shuffle=shuffle, data_seed=data_seed)
        # Under DDP Lightning rebuilds the loader with a distributed sampler around the original one; that
        # sampler then decides the order (each epoch still a function of the seeds) and the position is not
        # checkpointed.
        super().__init__(
            dataset, batch_size=batch_size, sampler=self.resumable_sampler if sampler is None else sampler, **kwargs
        )

    def state_dict(self) -> dict[str, int]:
        return self.resumable_sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.resumable_sampler.load_state_dict(state)
