"""The chain itself, with stand-in stages: which rank runs what, and what it lets through."""
from __future__ import annotations

import pytest

from pipeline import chain
from stages.run import artifacts
from stages.training import distributed


def test_an_unexpected_error_reading_a_resumed_run_is_not_swallowed(tmp_path, monkeypatch):
    """Only a missing run is left for run_chain to report: any other failure while reading
    the precision a resumed run trained in would otherwise let it train uncapped, silently."""
    run = artifacts.create_run(tmp_path, "r")
    ran = []

    def unreadable(self, stage):
        raise ValueError("config.json holds a list")

    monkeypatch.setattr(artifacts.Run, "recorded_config", unreadable)
    with pytest.raises(ValueError, match="holds a list"):
        chain.run_chain([("train", ran.append)], tmp_path, run.name, device="cpu", quiet=True,
                        resume=True, train_precision="fp32")
    assert ran == []
    monkeypatch.undo()  # a missing run is still run_chain's usage error, not a crash here
    with pytest.raises(Exception, match="run 'nope' does not exist"):
        chain.run_chain([("train", ran.append)], tmp_path, "nope", device="cpu", quiet=True,
                        resume=True, train_precision="fp32")


def test_under_torchrun_only_train_runs_on_every_rank_and_the_rest_alone(tmp_path, monkeypatch):
    """qat, quantize and report run on rank 0 alone, where a collective would wait forever for
    ranks that have left: inside them rank 0 is a world of one."""
    seen = []

    def stage(name):
        return name, lambda run: seen.append((name, distributed.current().world_size))

    stages = [stage("train"), stage("qat"), stage("quantize"), stage("report")]
    run = artifacts.create_run(tmp_path, "r")
    for rank, expected in ((1, [("train", 2)]),
                           (0, [("train", 2), ("qat", 1), ("quantize", 1), ("report", 1)])):
        seen.clear()
        world = distributed.World(rank, 2)
        monkeypatch.setattr(distributed, "setup", lambda device, world=world: world)
        monkeypatch.setattr(distributed, "_joined", lambda world=world: world)
        chain.run_chain(stages, tmp_path, run.name, device="cpu", quiet=True, resume=True,
                        train_precision="fp32")
        assert seen == expected



def test_the_process_group_and_the_cap_follow_trains_own_device(tmp_path, monkeypatch):
    """A [train] table's device = "cpu" under the group's --device auto: torchrun's backend
    (NCCL on CUDA, Gloo on the CPU) and oneDNN's cap are chosen for the CPU (they had taken
    the group's "auto", which picks NCCL on a GPU host, whose CPU tensors it cannot reduce)."""
    from stages.training import precision

    devices = []
    monkeypatch.setattr(distributed, "setup", lambda device: devices.append(device) or
                        distributed.World())
    monkeypatch.setattr(precision, "cap_isa_for_bf16_training",
                        lambda name, device: devices.append(device))

    def train(run):
        pass

    train.device = "cpu"
    run = artifacts.create_run(tmp_path, "r")
    chain.run_chain([("train", train)], tmp_path, run.name, device="auto", quiet=True,
                    resume=True, train_precision="bf16")
    assert devices == ["cpu", "cpu"]


@pytest.mark.parametrize("args, asked", [
    (["qat"], ["fp32"]),  # qat's auto fine-tunes in fp32: no cap (it had capped as train's auto)
    (["qat", "--precision", "bf16"], ["bf16"]),
    (["quantize", "--auto"], ["fp32"]),  # the QAT --auto may go on to, in this process
    (["quantize"], []),
])
def test_the_cap_follows_what_each_training_stage_trains_in(tmp_path, monkeypatch, args,
                                                               asked):
    """oneDNN's AMX cap for bf16 training was decided from train's precision alone: qat on its
    own was capped for an fp32 fine-tuning, and a bf16 QAT under quantize --auto was not."""
    from click.testing import CliRunner

    from pipeline.cli import cli
    from stages.training import precision

    seen = []
    monkeypatch.setattr(precision, "cap_isa_for_bf16_training",
                        lambda name, device: seen.append(name))
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), *args])
    assert result.exit_code == 2 and "no run in" in result.stderr  # refused after the cap
    assert seen == asked
