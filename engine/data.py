"""The training data loader `initialize()` builds from `training_data`.

Each data-parallel rank reads a disjoint shard of every epoch (DistributedSampler, shuffled with the
config's `seed`, identical on all ranks), `train_micro_batch_size_per_gpu` samples at a time. The loader
counts the batches it has handed out so a checkpoint can resume mid-epoch.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DistributedDataLoader:
    """Iterable over micro-batches of this rank's shard; a new `iter()` starts the next epoch (also after
    a pass left with `break`)."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_world_size: int,
                 seed: int, drop_last: bool = False, collate_fn: Callable | None = None,
                 num_workers: int = 0, shuffle: bool = True):
        self.dataset = dataset
        self.sampler = DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._loader_args = {"sampler": self.sampler, "collate_fn": collate_fn, "drop_last": drop_last,
                             "num_workers": num_workers, "seed": seed}
        self.loader = self._build(micro_batch_size)
        self.epoch = 0
        self.batches_in_epoch = 0  # handed out in the current epoch
        self._skip = 0  # batches to skip after a resume
        self._passing = False  # a pass (an iterator) is under way

    def _build(self, micro_batch_size: int) -> DataLoader:
        args = dict(self._loader_args)
        generator = torch.Generator()
        generator.manual_seed(args.pop("seed"))
        return DataLoader(self.dataset, batch_size=micro_batch_size, generator=generator, **args)

    def set_micro_batch_size(self, micro_batch_size: int, caller: str) -> None:
        """Yield `micro_batch_size` samples per batch from the next pass on (engine/batch_size.py). Within a
        pass it is an error: the pass's position, and a checkpoint's record of it, count batches of one size."""
        if self._passing:
            raise RuntimeError(f"{caller}({micro_batch_size}): the training data loader engine.initialize() built "
                               f"is in the middle of a pass ({self.batches_in_epoch} of {len(self)} batches of "
                               f"{self.loader.batch_size} handed out); change the micro batch between passes, or "
                               "iterate a loader of your own")
        # A position loaded and not yet skipped counts batches of the old size: kept in samples (rounded
        # down, as restore.py's _sampler_state), else a warm-up re-applied after a resume skipped data.
        self._skip = self._skip * self.loader.batch_size // micro_batch_size
        self.loader = self._build(micro_batch_size)
        if self._skip:
            self._next_epoch_if_done()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        if self.batches_in_epoch:  # the last pass was left mid-epoch (a `break`): this one is the next epoch
            self.epoch += 1
        self.sampler.set_epoch(self.epoch)
        skip, self._skip = self._skip, 0
        self.batches_in_epoch = 0
        self._passing = True
        try:
            for i, batch in enumerate(self.loader):
                if i < skip:
                    continue
                self.batches_in_epoch = i + 1
                yield batch
        finally:  # also when the pass is left (a `break` closes the generator)
            self._passing = False
        self.epoch += 1
        self.batches_in_epoch = 0

    def state_dict(self) -> dict:
        # A position loaded but not yet skipped (no pass since) is still the position: a save right after
        # a load said batch 0 and replayed the epoch.
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch or self._skip}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` was taken: the same epoch after its batches handed out, or the next epoch
        when they were all of it (a checkpoint taken at an epoch's last step; resumed as its first pass,
        that would be an empty one: an epoch lost, and a pipeline's repeating loader ended)."""
        self.epoch, self._skip, self.batches_in_epoch = int(state["epoch"]), int(state["batches_in_epoch"]), 0
        self._next_epoch_if_done()

    def _next_epoch_if_done(self) -> None:
        """A position to skip to that is the epoch's end (all its batches) resumes with the next epoch."""
        if self._skip >= len(self):
            self.epoch, self._skip = self.epoch + 1, 0
