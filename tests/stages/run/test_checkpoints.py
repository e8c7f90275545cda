"""The best checkpoint beside the numbered ones: written first, and taken on resume only where
it holds the best epoch the resumed checkpoint names."""
import pytest
import torch

from stages.run import artifacts, checkpoints
from stages.run.checkpoints import Checkpointer, best_weights


def _state(epoch: int) -> dict:
    return {"model": {"w": torch.full((2,), float(epoch))},
            "position": {"epoch": epoch, "global_step": 10 * epoch, "step_in_epoch": 10}}


def test_a_stop_inside_an_improved_epochs_save_leaves_the_best_and_resume_skips_it(
        tmp_path, monkeypatch):
    run = artifacts.create_run(tmp_path, "best")
    saver = Checkpointer(run, "amp", run.root / "train" / "amp", keep=2, config_dict={})
    saver.save(_state(1), best=True)
    assert torch.equal(best_weights(run, "amp", best_epoch=1)["w"], torch.ones(2))
    written = checkpoints.atomic_torch_save

    def stopped_at_the_numbered_one(obj, path):
        if path.name.startswith("checkpoint-step"):
            raise KeyboardInterrupt
        written(obj, path)

    monkeypatch.setattr(checkpoints, "atomic_torch_save", stopped_at_the_numbered_one)
    with pytest.raises(KeyboardInterrupt):
        saver.save(_state(2), best=True)
    # The newest checkpoint is still epoch 1's, whose best is epoch 1: the file now holds
    # epoch 2, which the resumed run trains again, so it is not taken as epoch 1's best.
    assert run.entry("amp/checkpoint-last")["epoch"] == 1
    assert run.entry("amp/checkpoint-best")["epoch"] == 2
    assert best_weights(run, "amp", best_epoch=1) is None
    assert torch.equal(best_weights(run, "amp", best_epoch=2)["w"], torch.full((2,), 2.0))


def test_a_resume_without_its_best_keeps_the_last_epoch_and_says_why():
    """Where best_weights gave nothing back (the file held another epoch), the model keeps
    its last epoch, recorded as such: it had been recorded as epoch 0 with no reason."""
    from stages.training import choice
    from stages.training.loop import Totals

    totals = Totals(best_epoch=2)
    history = [{"epoch": 1}, {"epoch": 2}, {"epoch": 3}]
    assert choice.keep_best(totals, history, None, None, have_best=False) is False
    assert (totals.chosen_epoch, totals.chosen) == (
        3, "epoch 3, the last: the best epoch's weights did not survive a resume")


def test_a_stop_between_the_bests_rename_and_its_manifest_entry_still_resumes(tmp_path,
                                                                               monkeypatch):
    """The best file is replaced under one name, then registered: a stop between the two left
    a file that did not match its sha256, and every later resume was refused."""
    run = artifacts.create_run(tmp_path, "best")
    saver = Checkpointer(run, "amp", run.root / "train" / "amp", keep=2, config_dict={})
    saver.save(_state(1), best=True)

    def stopped_before_the_manifest(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "register", stopped_before_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        saver.save(_state(2), best=True)
    assert best_weights(run, "amp", best_epoch=1) is None
