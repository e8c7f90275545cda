"""torch.distributed as torchrun sets it up: NCCL on CUDA, Gloo on CPU, rank 0 writes.

Nothing here is home-made parallelism: torchrun starts the processes and sets RANK, WORLD_SIZE
and LOCAL_RANK; we join the process group and wrap the model in DistributedDataParallel.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

_alone = False  # rank 0 working by itself while the other ranks have gone (see alone())


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: str = "auto") -> World:
    """Join the process group torchrun prepared; a single process gets World() and no group."""
    if not launched_by_torchrun():
        return World()
    import torch
    import torch.distributed as dist

    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                  int(os.environ.get("LOCAL_RANK", "0")))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return world


def current() -> World:
    """This process's place in the process group: a world of one outside torchrun, and inside
    alone()."""
    return World() if _alone else _joined()


def _joined() -> World:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(),
                     int(os.environ.get("LOCAL_RANK", "0")))
    return World()


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the run name, for example)."""
    import torch.distributed as dist

    if not current().active:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main_first(work: Callable[[bool], Any], only_if: bool = True) -> Any:
    """``work(True)`` on each machine's first rank, then ``work(False)`` on its other ranks
    once every first rank returned: files a first rank writes to its machine's disk (a
    download) are read, not written by every rank at once. Where a first rank fails, torchrun
    stops the ranks that wait. Not ``only_if``: every rank at once, ``work(True)``."""
    world = current()
    if not world.active or not only_if:
        return work(True)
    first = world.local_rank == 0
    done = work(True) if first else None
    broadcast(None)  # the other ranks wait here until the first ones are done
    return done if first else work(False)


def all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not current().active:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def reduce_health(values) -> list[float]:
    """The training loop's device sums over every rank, read by the host once: loss, correct
    and seen are summed; the skipped steps and the longest run of them are the largest (a
    step is skipped on every rank at once: the gradients GradScaler checks are all-reduced);
    the first step whose loss was not finite is the earliest on any rank (-1: none)."""
    import torch
    import torch.distributed as dist

    if current().active:
        none = float(2 ** 62)
        sums, skips, first_bad = values[:3].clone(), values[3:5].clone(), values[5:6].clone()
        first_bad = torch.where(first_bad < 0, none, first_bad)
        dist.all_reduce(sums)
        dist.all_reduce(skips, op=dist.ReduceOp.MAX)
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        first_bad = torch.where(first_bad >= none, -1.0, first_bad)
        values = torch.cat([sums, skips, first_bad])
    return values.tolist()


def sync_buffers(model) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics). DDP broadcasts them at
    the start of each forward, so after the last step each rank still holds its own shard's."""
    import torch.distributed as dist

    if not current().active:
        return
    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)


@contextlib.contextmanager
def alone():
    """Rank 0's single-process work after training (quantize, qat, report): the other ranks
    have left, so a collective would wait for them forever. Inside, rank 0 is a world of one:
    no DDP, no sharded sampler, no all_reduce. qat is such work because quantize --auto, which
    runs on rank 0 alone, goes on to it."""
    global _alone
    before, _alone = _alone, True
    try:
        yield
    finally:
        _alone = before


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
