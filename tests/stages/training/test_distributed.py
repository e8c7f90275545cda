"""What ranks do in turn (stages/training/distributed.py); the ranks themselves are tested in
tests/pipeline/test_resume_and_distributed.py."""
import pytest

from stages.training import distributed


@pytest.mark.parametrize("rank, local_rank, expected", [
    (0, 0, ["work(first=True)", "wait for rank 0"]),
    (1, 1, ["wait for rank 0", "work(first=False)"]),
    (2, 0, ["work(first=True)", "wait for rank 0"]),  # another machine's first rank
])
def test_each_machines_first_rank_works_first_and_the_others_after_it(monkeypatch, rank,
                                                                      local_rank, expected):
    """torchrun ... train --download had every rank write the same archive at once."""
    done = []
    monkeypatch.setattr(distributed, "current", lambda: distributed.World(
        rank=rank, world_size=4, local_rank=local_rank))
    monkeypatch.setattr(distributed, "broadcast", lambda value: done.append("wait for rank 0"))
    result = distributed.main_first(lambda first: done.append(f"work(first={first})") or rank)
    assert done == expected and result == rank


def test_a_single_process_works_once():
    assert distributed.main_first(lambda first: first) is True


def test_skipped_steps_are_counted_once_not_once_per_rank(monkeypatch):
    """GradScaler skips a step on every rank at once: summed over 2 ranks, 3 skipped steps
    read 6, and optimizer steps (steps less skipped) came out short."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(distributed, "current", lambda: distributed.World(rank=0, world_size=2))

    def two_equal_ranks(tensor, op=dist.ReduceOp.SUM):
        return tensor.mul_(2) if op == dist.ReduceOp.SUM else tensor

    monkeypatch.setattr(dist, "all_reduce", two_equal_ranks)
    loss, correct, seen, skipped, longest, first_bad = distributed.reduce_health(
        torch.tensor([1.0, 5, 10, 3, 2, -1], dtype=torch.float64))
    assert (loss, correct, seen) == (2.0, 10, 20)
    assert (skipped, longest, first_bad) == (3, 2, -1)


def test_every_rank_keeps_rank_0s_validation_hits(monkeypatch):
    """Each rank scored validation itself: ranks whose kernels round one image apart kept
    different best epochs or cut their plans apart, and their collectives no longer met."""
    from types import SimpleNamespace

    import torch

    from stages import train

    own, rank_0s = torch.tensor([True, False]), torch.tensor([True, True])
    monkeypatch.setattr(train.batchnorm, "recompute_module", lambda *args: None)
    monkeypatch.setattr(distributed, "sync_buffers", lambda model: None)
    monkeypatch.setattr(train, "dataset_hits", lambda *args: own)
    monkeypatch.setattr(distributed, "broadcast", lambda value: rank_0s)
    model = SimpleNamespace(loop=SimpleNamespace(parts=SimpleNamespace(model=None), device="cpu"),
                            splits=SimpleNamespace(calibration=None, val=None),
                            config=SimpleNamespace(batch_size=1))
    assert train._score(model) is rank_0s
