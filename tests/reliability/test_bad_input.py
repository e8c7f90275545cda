"""Bad calibration data, corrupt image files, and random option values: clean errors only."""
import dataclasses
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline import config as cfg
from pipeline.checks import DURATION_FIELDS
from pipeline.cli import cli
from stages import train
from stages.data.datasets import load_dataset
from stages.data.subsets import check_calibration
from stages.run.errors import PipelineError


@pytest.mark.parametrize("batches, message", [
    ([], "calibration data is empty"),
    ([torch.zeros(0, 1, 8, 8)], "calibration data is empty"),
    ([torch.zeros(4, 3, 8, 8)], r"shape \(4, 3, 8, 8\); expected \(N, 1, 8, 8\)"),
    ([torch.zeros(4, 8, 8)], r"shape \(4, 8, 8\); expected \(N, 1, 8, 8\)"),
    ([torch.zeros(4, 1, 8, 8, dtype=torch.uint8)], "torch.uint8; expected float32"),
    ([torch.full((4, 1, 8, 8), float("nan"))], "NaN or infinite"),
])
def test_bad_calibration_data_is_refused_with_what_was_expected(batches, message):
    with pytest.raises(PipelineError, match=message):
        check_calibration(batches, (1, 8, 8))
    check_calibration([torch.zeros(4, 1, 8, 8)], (1, 8, 8))  # the good case passes


def test_quantize_checks_calibration_before_writing_anything(fresh_tiny_run, monkeypatch):
    from pipeline.config import QuantizeConfig
    from stages import quantize
    from stages.runtimes import context

    run = fresh_tiny_run
    before = set(run.artifacts())
    monkeypatch.setattr(context, "calibration_batches",
                        lambda *a, **k: [torch.zeros(4, 3, 8, 8)])
    with pytest.raises(PipelineError, match="expected"):
        quantize.run(QuantizeConfig(methods="onnx-fp32,ort-static", quiet=True), run)
    assert set(run.artifacts()) == before  # not even the ONNX export ran


def _image_folder(root):
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                root / f"c{c}" / f"{i}.png")
    good = (root / "c0" / "0.png").read_bytes()
    (root / "c0" / "empty.png").write_bytes(b"")
    (root / "c1" / "truncated.png").write_bytes(good[: len(good) // 2])
    (root / "c1" / "text.png").write_text("this is not an image")
    return root


def test_corrupt_images_are_named_or_skipped_and_counted(tmp_path):
    root = _image_folder(tmp_path / "images")
    with pytest.raises(PipelineError) as raised:
        load_dataset("imagefolder", image_size=8, seed=0, data_dir=root)
    message = str(raised.value)
    assert "3 unreadable image(s)" in message
    for name in ("empty.png", "truncated.png", "text.png"):
        assert name in message
    splits = load_dataset("imagefolder", image_size=8, seed=0, data_dir=root, skip_bad_images=True)
    assert splits.skipped_images == 3
    assert len(splits.train) + len(splits.val) + len(splits.test) == 20


def test_a_later_stage_drops_the_files_training_skipped_without_decoding_every_file(
        tmp_path, monkeypatch):
    """quantize and report split the folder again and had decoded every file of it to find
    the unreadable ones, in each of their child processes too; the run now names them."""
    from stages.data import torchvision_sets
    from stages.data.datasets import load_splits

    config = cfg.TrainConfig(model="smallcnn", dataset="imagefolder", image_size=8,
                             data_dir=str(_image_folder(tmp_path / "images")),
                             skip_bad_images=True)
    trained_on = load_splits(config).identity()
    assert trained_on["skipped_files"] == ["c0/empty.png", "c1/text.png", "c1/truncated.png"]
    decoded, decode = [], torchvision_sets._DecodedImages._decode
    monkeypatch.setattr(torchvision_sets._DecodedImages, "_decode",
                        lambda self, path: decoded.append(path) or decode(self, path))
    again = load_splits(config, trained_on)
    assert decoded == [] and again.identity() == trained_on
    older = {key: value for key, value in trained_on.items() if key != "skipped_files"}
    assert load_splits(config, older).skipped_files == tuple(trained_on["skipped_files"])
    assert len(decoded) == 23  # a run from before they were named: every file read to find them


def test_skipped_images_are_counted_in_the_run(tmp_path):
    from stages.run import artifacts

    root = _image_folder(tmp_path / "images")
    run = artifacts.create_run(tmp_path / "artifacts", "skip")
    (result,) = train.run(cfg.TrainConfig(model="smallcnn", dataset="imagefolder",
                                          data_dir=str(root), image_size=8, epochs=1,
                                          baseline=False, skip_bad_images=True, lr=0.05,
                                          measure_memory=False, quiet=True), run)
    assert result.skipped_images == 3
    assert '"skipped_images": 3' in (run.root / "train" / "amp" / "metrics.jsonl").read_text()


NUMBERS = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True))
FIELD_VALUES = {
    int: st.integers(-10**6, 10**6), float: NUMBERS, bool: st.booleans(),
    str: st.text(max_size=12), "int | None": st.one_of(st.none(), st.integers(-5, 5)),
}


def _config_strategy(config_class, skip=("model",)):
    fields = {}
    for field in config_class.__dataclass_fields__.values():
        if field.name in skip:
            continue
        kind = field.type if field.type in FIELD_VALUES else None
        if kind is None and field.type in ("int", "float", "bool", "str"):
            kind = field.type
        strategy = FIELD_VALUES.get({"int": int, "float": float, "bool": bool, "str": str}.get(
            kind, kind), st.text(max_size=12))
        fields[field.name] = st.one_of(st.just(field.default), strategy)
    return st.fixed_dictionaries(fields)


def _given(config_class, values: dict) -> set[str]:
    """The flags of the values that are not their field's default."""
    return {f"--{field.name.replace('_', '-')}" for field in dataclasses.fields(config_class)
            if not (type(values[field.name]) is type(field.default)
                    and values[field.name] == field.default)}


def _flags_named(message: str) -> set[str]:
    """The flags a message names: '--epochs ...', click's "Invalid value for '--seed'", or a
    key of the --config file ('... time in [train] must be ...')."""
    return set(re.findall(r"--[a-z][a-z0-9-]*", message)) | {
        f"--{key.replace('_', '-')}" for key in re.findall(r"(\w+) in \[\w+\]", message)}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # nan, inf, -inf and 1e-05 are TOML floats as Python writes them
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(_toml, value))}]"
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _through_the_command_line(stage: str, values: dict, folder: Path):
    """``values`` given to ``stage`` the way a user gives them: the group's --seed, --device and
    --quiet as flags, the rest in a --config file (a value left at None is its default)."""
    group = [f"--{key}={values[key]}" for key in ("seed", "device") if key in values]
    group += ["--quiet"] if values.get("quiet") is True else []
    table = "".join(f"{key} = {_toml(value)}\n" for key, value in values.items()
                    if value is not None)
    (folder / "config.toml").write_text(f"[{stage}]\n{table}", encoding="utf-8")
    return CliRunner().invoke(cli, ["--artifacts-dir", str(folder / "artifacts"), *group,
                                    "--config", str(folder / "config.toml"), stage])


@pytest.mark.parametrize("stage", ["train", "quantize", "report"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_values_a_stage_cannot_take_are_refused_naming_one_given_before_anything_is_written(
        stage, data):
    """Random values either make a config, or are refused with one line that names the flag
    of a value given (not one left at its default); from the command line that refusal is a
    usage error (exit 2) before the run folder, or anything else, is written."""
    config_class = cfg.STAGE_CONFIGS[stage]
    values = data.draw(_config_strategy(config_class))
    if stage == "train":
        values["model"] = "smallcnn"
    try:
        config_class(**values)
        return
    except ValueError as exc:
        message = str(exc)
    given = _given(config_class, values)
    assert "\n" not in message and _flags_named(message) & given, (message, given)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        result = _through_the_command_line(stage, values, folder)
        assert result.exit_code == 2, (message, result.output)
        line = result.stderr.strip()
        assert "\n" not in line and line.startswith("pipeline: error: "), line
        assert _flags_named(line) & given, (line, given)
        assert [p.name for p in folder.iterdir()] == ["config.toml"]


# For each declared type, values of some other type (what a hand-written TOML file holds).
WRONG_TYPE = {
    "bool": st.one_of(st.sampled_from(["no", "false", "true", "yes"]), st.integers(0, 1)),
    "int": st.one_of(st.text(max_size=4).map(lambda t: t or "3"), st.floats(0.5, 9.5),
                     st.booleans()),
    "float": st.one_of(st.sampled_from(["0.1", "1e-3", "fast"]), st.booleans()),
    "str": st.one_of(st.integers(), st.booleans(), st.lists(st.integers(), max_size=2)),
}


@pytest.mark.parametrize("stage", ["train", "quantize", "report"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_value_of_the_wrong_type_is_refused_naming_its_flag(stage, data):
    config_class = cfg.STAGE_CONFIGS[stage]
    # A duration field takes text ("5m") by design: test_duration_fields_parse_units covers it.
    fields = [f for f in config_class.__dataclass_fields__.values()
              if f.type.removesuffix(" | None") in WRONG_TYPE and f.name != "model"
              and f.name not in DURATION_FIELDS]
    field = data.draw(st.sampled_from(fields))
    value = data.draw(WRONG_TYPE[field.type.removesuffix(" | None")])
    extra = {"model": "smallcnn"} if stage == "train" else {}
    with pytest.raises(ValueError) as raised:
        config_class(**extra | {field.name: value})
    assert str(raised.value).startswith(f"--{field.name.replace('_', '-')} must be ")


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("5m", 300.0),
                                           ("1.5h", 5400.0), (" 2M ", 120.0)])
@pytest.mark.parametrize("config_class", [cfg.QuantizeConfig, cfg.QatConfig])
def test_duration_fields_parse_units(text, seconds, config_class):
    assert config_class(tuning_time=text).tuning_time == seconds


@pytest.mark.parametrize("text", ["fast", "0", "-5m", "nan", "inf", "m", ""])
@pytest.mark.parametrize("config_class", [cfg.QuantizeConfig, cfg.QatConfig])
def test_a_duration_that_is_not_one_is_refused_naming_its_flag(text, config_class):
    with pytest.raises(ValueError, match=r"^--tuning-time .* is not a duration; give one such"):
        config_class(tuning_time=text)
    with pytest.raises(ValueError, match=r"^--tuning-time must be a positive duration, got -5"):
        config_class(tuning_time=-5)


@pytest.mark.parametrize("config_class", [cfg.QuantizeConfig, cfg.QatConfig])
def test_an_infinite_duration_from_a_config_file_is_refused(config_class):
    """time = inf in a --config table is a float, not a string to parse: it had passed and
    overflowed when the epochs that fit were planned."""
    with pytest.raises(ValueError, match=r"^--tuning-time must be a positive duration, got inf"):
        config_class(tuning_time=float("inf"))
    with pytest.raises(ValueError, match=r"^--time must be a positive duration, got inf"):
        cfg.TrainConfig(model="smallcnn", time=float("inf"))


@pytest.mark.parametrize("seed", [-1, 2 ** 32])
@pytest.mark.parametrize("config_class", [cfg.TrainConfig, cfg.QuantizeConfig, cfg.QatConfig])
def test_a_seed_the_generators_cannot_take_is_refused(config_class, seed):
    """[train] seed = -1 in a config file had passed, and the split failed after the run
    folder was made; 2**32 and over overflow the sampler's seed."""
    extra = {"model": "smallcnn"} if config_class is cfg.TrainConfig else {}
    with pytest.raises(ValueError, match=rf"^--seed must be from 0 to 4294967295, got {seed}"):
        config_class(seed=seed, **extra)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(epochs=st.text(max_size=6), lr=st.text(max_size=6), batch=st.text(max_size=6),
       sizes=st.text(max_size=8))
def test_random_option_values_give_usage_errors_never_tracebacks(tmp_path, monkeypatch, epochs,
                                                                 lr, batch, sizes):
    """Values the options cannot take are usage errors (exit 2, one line) before any stage
    runs; values they can take reach the stages, which here do nothing."""
    from stages import report

    ran = []
    monkeypatch.setattr(train, "run", lambda config, run, resume=False: ran.append("train") or [])
    monkeypatch.setattr(report, "run", lambda config, run: ran.append("report") or {})
    monkeypatch.setattr(report, "summary_table", lambda result: "")  # of the report not made
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--quiet", "train",
                                      "--model", "smallcnn", "--epochs", epochs, "--lr", lr,
                                      "--batch-size", batch, "report", "--batch-sizes", sizes])
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.stderr
    if result.exit_code == 0:
        assert ran == ["train", "report"]
        return
    assert result.exit_code == 2, result.output
    assert ran == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeline: error:"), result.stderr


@pytest.mark.parametrize("field, flag", [("init_weights", "--init-weights"),
                                         ("data_dir", "--data-dir")])
def test_a_home_directory_that_does_not_exist_is_a_usage_error(field, flag):
    """'~0' expands to the home of a user named 0: pathlib raises RuntimeError (found by the
    property test above in CI)."""
    with pytest.raises(ValueError, match=f"^{flag} '~0': '~' names no user"):
        cfg.TrainConfig(model="smallcnn", **{field: "~0"})


def test_predict_reads_a_quoted_tilde_path_as_it_checked_it(tmp_path, monkeypatch):
    """'~/My Photos' in quotes reaches us unexpanded: it was checked expanded and read as
    given, so the folder was taken for one missing file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "My Photos").mkdir()
    assert cfg.PredictConfig(paths=("~/My Photos",)).paths == (str(tmp_path / "My Photos"),)
    with pytest.raises(ValueError, match=r"File name too long; give image files or folders"):
        cfg.PredictConfig(paths=("x" * 300 + ".png",))  # an OSError, not only a missing file
