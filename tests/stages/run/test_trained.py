"""What a run's float model tells later stages: amp, else fp32, and the data it was trained on,
read back through DataConfig."""
import dataclasses

import pytest

from pipeline.config import ImportConfig, TrainConfig
from stages.run.errors import UsageError
from stages.run.trained import DataConfig, float_source, trained_data


class _Run:
    """A run reduced to its manifest entries."""

    name = "r"

    def __init__(self, entries: dict) -> None:
        self.entries = entries

    def artifacts(self) -> dict:
        return self.entries

    def entry(self, name: str) -> dict:
        return self.entries[name]


@pytest.mark.parametrize("config", [TrainConfig, ImportConfig])
def test_the_data_fields_are_those_of_train_and_import_with_their_defaults(config):
    """Every field a saved train or import config holds under that name, with the default it
    has there: a DataConfig read from an older run means what the newer config would."""
    theirs = {f.name: f for f in dataclasses.fields(config)}
    for field in dataclasses.fields(DataConfig):
        assert field.name in theirs, field.name
        if field.default is not dataclasses.MISSING:
            assert theirs[field.name].default == field.default, field.name


def test_a_saved_config_gives_its_data_and_drops_training_s_own_fields():
    saved = dataclasses.asdict(TrainConfig(model="smallcnn", dataset="digits", image_size=16,
                                           seed=3, val_fraction=0.2, in_channels=3,
                                           skip_bad_images=True, epochs=2))
    assert DataConfig.saved(saved) == DataConfig(dataset="digits", image_size=16, seed=3,
                                                 val_fraction=0.2, in_channels=3,
                                                 skip_bad_images=True)
    # A run saved before a field existed gets that field's default.
    older = {"dataset": "cifar10", "image_size": 32, "seed": 0, "epochs": 5}
    assert DataConfig.saved(older) == DataConfig("cifar10", 32, 0, data_dir="data",
                                                 download=False, val_fraction=0.1,
                                                 in_channels=None, skip_bad_images=False)


def test_the_float_source_is_amp_else_an_imported_fp32():
    amp = {"config": {"dataset": "mnist", "image_size": 28, "seed": 1}}
    fp32 = {"config": {"dataset": "digits", "image_size": 8, "seed": 0}}
    both = _Run({"fp32": fp32, "amp": amp})
    assert float_source(both) == "amp" and trained_data(both).dataset == "mnist"
    imported = _Run({"fp32": fp32})
    assert float_source(imported) == "fp32" and trained_data(imported).image_size == 8
    with pytest.raises(UsageError, match="run 'r' has no float model; run 'pipeline train' or "
                                         "'pipeline import' first"):
        float_source(_Run({"onnx-fp32": {}}))


def test_a_resume_whose_start_file_is_gone_says_which_as_a_usage_error(tmp_path, monkeypatch):
    """A moved --init-weights file failed the resume with a ValueError naming a flag --resume
    refuses (a model with no checkpoint starts afresh from that file)."""
    from stages.run import artifacts
    from stages.run.trained import resumed_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "start.pt").write_bytes(b"weights")
    config = TrainConfig(model="smallcnn", init_weights="start.pt")
    run = artifacts.create_run(tmp_path / "artifacts", "r")
    run.record_config("train", dataclasses.asdict(config))
    (tmp_path / "start.pt").unlink()
    with pytest.raises(UsageError, match=r"^run 'r' cannot resume as it was started: "
                                         r"--init-weights 'start.pt' is not a file; put it back"):
        resumed_config(TrainConfig(), run, world_size=1)
