"""Loaders: a sampler whose order depends only on (seed, epoch), so a resumed run draws what the
original did, and DataLoaders that draw nothing from the global random state."""
from __future__ import annotations

from typing import Iterator


def without_a_lone_image(count: int, batch_size: int) -> int:
    """``count`` images, one fewer where the last batch would hold one image alone: BatchNorm
    in training mode cannot normalise a single value per channel (resnet18's last feature map
    at 32x32 is 1x1), and `train --batch-size 68` on the built-in digits' 1,293 training images
    (19 x 68 + 1) failed in its first epoch."""
    return count - 1 if count > 1 and count % batch_size == 1 else count


class EpochSampler:
    """Shuffled indices that depend only on (seed, epoch): the same order for fp32 and amp, on
    every rank's share, and after a resume, which starts ``start`` samples into the epoch.
    Given the loader's ``batch_size``, an epoch leaves out the image a last batch would hold
    alone (without_a_lone_image): another one each epoch."""

    def __init__(self, size: int, seed: int, rank: int = 0, world_size: int = 1,
                 batch_size: int | None = None) -> None:
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.batch_size = batch_size
        self.epoch, self.start = 0, 0
        self.workers_generator = None  # its loader's (make_loader): seeded again each epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        if self.workers_generator is not None:  # the workers' seeds: this epoch's, resumed too
            self.workers_generator.manual_seed(self._epoch_seed() + 1)

    def _epoch_seed(self) -> int:
        return self.seed * 100_003 + self.epoch

    def _indices(self) -> list[int]:
        import torch

        generator = torch.Generator().manual_seed(self._epoch_seed())
        order = torch.randperm(self.size, generator=generator).tolist()
        # Pad so that every rank gets as many samples (DistributedSampler does the same).
        per_rank = -(-self.size // self.world_size)
        order += order[: per_rank * self.world_size - self.size]
        mine = order[self.rank::self.world_size]
        return mine[:without_a_lone_image(len(mine), self.batch_size)] if self.batch_size else mine

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    @property
    def epoch_size(self) -> int:
        """This rank's samples in a whole epoch, wherever a resume starts it."""
        per_rank = -(-self.size // self.world_size)
        return without_a_lone_image(per_rank, self.batch_size) if self.batch_size else per_rank

    def __len__(self) -> int:
        return self.epoch_size - self.start


def make_loader(dataset, batch_size: int, sampler=None, workers: int = 0, pin_memory: bool = False,
                timeout: float = 0):
    import torch

    # A generator of its own keeps the loader from drawing worker seeds from the global RNG
    # (whose state a checkpoint restores, for workers=0's augmentation); an EpochSampler seeds
    # it for each epoch, so that with workers a run resumed at an epoch's start draws what the
    # original did there (part way into one, the workers meet other images: not the same).
    generator = torch.Generator().manual_seed(0)
    if isinstance(sampler, EpochSampler):
        sampler.workers_generator = generator
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                       shuffle=False, num_workers=workers, pin_memory=pin_memory,
                                       timeout=timeout, generator=generator)


def batches(dataset, batch_size: int = 256):
    """(images, labels) of a data set in order, without augmentation randomness of our own."""
    yield from make_loader(dataset, batch_size)


def endless_batches(sampler: EpochSampler, loader):
    """Training batches, epoch after epoch, for as long as a probe takes (the range test, the
    precision's step timing)."""
    epoch = 0
    while True:
        epoch += 1
        sampler.set_epoch(epoch)
        yield from loader
