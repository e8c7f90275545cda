"""Small data in each real on-disk format, read by the real torchvision loaders."""
import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets

from pipeline.config import TrainConfig
from stages import train
from stages.data.datasets import load_dataset
from stages.run import artifacts
from stages.run.errors import PipelineError


def _write_idx(folder, prefix, count, rng):
    folder.mkdir(parents=True, exist_ok=True)
    images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    labels = np.arange(count, dtype=np.uint8) % 10
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 2049, count) + labels.tobytes())


@pytest.fixture
def mnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("MNIST", "FashionMNIST"):
        _write_idx(tmp_path / name / "raw", "train", 100, rng)
        _write_idx(tmp_path / name / "raw", "t10k", 30, rng)
    return tmp_path


@pytest.fixture
def cifar_dir(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()

    def batch(count):
        return {"data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
                "labels": [i % 10 for i in range(count)]}

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(20)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(20)))
    meta = {"label_names": [str(i) for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    # torchvision checks the md5 of the published files; ours are small stand-ins.
    monkeypatch.setattr(datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(datasets.cifar, "check_integrity", lambda path, md5=None: True)
    return tmp_path


def _png_folder(root, classes=3, per_class=10, size=12):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i}.png")
    return root


def _kinds(split) -> list[str]:
    return [type(t).__name__ for t in split.dataset.transform.transforms]


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_mnist_formats_load_split_and_widen(mnist_dir, name):
    splits = load_dataset(name, image_size=28, seed=0, data_dir=mnist_dir)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (90, 10, 30)
    assert splits.num_classes == 10 and splits.in_channels == 1
    assert splits.test[0][0].shape == (1, 28, 28)
    # A mirrored letter or digit is another one: shifts alone, and the run's recipe says so.
    assert _kinds(splits.train) == ["RandomCrop", "ToTensor", "Normalize"]
    assert splits.augmentation == ("random shifts of up to 3 pixels (a crop of the zero-padded "
                                   "image)")
    widened = load_dataset(name, image_size=32, seed=0, data_dir=mnist_dir, in_channels=3)
    image = widened.test[0][0]
    assert image.shape == (3, 32, 32) and torch.equal(image[0], image[2])


def test_cifar_batches_load_with_augmentation_for_training_only(cifar_dir):
    splits = load_dataset("cifar10", image_size=32, seed=0, data_dir=cifar_dir)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (90, 10, 20)
    assert splits.in_channels == 3 and splits.num_classes == 10
    assert "RandomCrop" in _kinds(splits.train) and "RandomHorizontalFlip" in _kinds(splits.train)
    assert "RandomCrop" not in _kinds(splits.val)
    assert "RandomCrop" not in _kinds(splits.calibration)
    assert splits.train.dataset.transform.transforms[0].padding == 4
    assert splits.augmentation == ("random shifts of up to 4 pixels (a crop of the zero-padded "
                                   "image) and horizontal flips")
    assert torch.equal(splits.calibration[0][0], splits.calibration[0][0])


def test_imagefolder_split_or_train_val_folders(tmp_path):
    single = load_dataset("imagefolder", image_size=16, seed=0,
                          data_dir=_png_folder(tmp_path / "flat", per_class=20))
    assert len(single.train) + len(single.val) + len(single.test) == 60
    assert single.num_classes == 3 and single.test[0][0].shape == (3, 16, 16)
    _png_folder(tmp_path / "split" / "train")
    _png_folder(tmp_path / "split" / "val", per_class=4)
    both = load_dataset("imagefolder", image_size=16, seed=0, data_dir=tmp_path / "split")
    assert len(both.test) == 12 and len(both.train) + len(both.val) == 30
    assert "RandomHorizontalFlip" in _kinds(both.train) and "flips" in both.augmentation


def test_imagefolder_decodes_each_file_once_into_the_pixels_torchvision_gives(tmp_path,
                                                                           monkeypatch):
    """12x12 PNGs at --image-size 16: the pixels torchvision's own loader and Resize give, and
    kept, so that no file is opened again; past the memory budget they are read each time."""
    from torchvision import transforms as T

    from stages.data import torchvision_sets

    root = _png_folder(tmp_path / "flat", per_class=20)
    splits = load_dataset("imagefolder", image_size=16, seed=0, data_dir=root)
    mean, std = torchvision_sets.STATS["imagefolder"]
    reference = datasets.ImageFolder(str(root), transform=T.Compose(
        [T.Resize((16, 16)), T.ToTensor(), T.Normalize(mean, std)]))
    expected = [reference[i][0] for i in splits.test.indices]
    monkeypatch.setattr(torchvision_sets, "DECODED_BYTES", 0)
    unkept = load_dataset("imagefolder", image_size=16, seed=0, data_dir=root)
    for path in root.rglob("*.png"):
        path.unlink()
    for i, image in enumerate(expected):
        assert torch.equal(splits.test[i][0], image)
    assert splits.train[0][0].shape == (3, 16, 16)  # augmented afresh from the kept pixels
    first = unkept.test.dataset.samples[unkept.test.indices[0]][0]
    with pytest.raises(PipelineError, match=f"{first} cannot be read: no such file"):
        unkept.test[0]  # removed during training: the file is named


def test_an_image_folder_of_16_bit_grey_trains_on_the_pixels_predict_gives(tmp_path):
    """Pillow's convert alone clips 16-bit grey at 255 of 65535, which had trained the model on
    white images while predict scaled the same files to 8 bits."""
    from stages.data import preprocess, torchvision_sets

    root = tmp_path / "scans"
    for c in range(3):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(4):
            pixels = np.full((16, 16), 257 * (40 + 60 * c + i), dtype=np.uint16)
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i}.png")
    splits = load_dataset("imagefolder", image_size=16, seed=0, data_dir=root)
    spec = {"colour": "RGB", "image_size": 16, "channels": 3, "source_size": None,
            "mean": list(torchvision_sets.STATS["imagefolder"][0]),
            "std": list(torchvision_sets.STATS["imagefolder"][1])}
    for i, index in enumerate(splits.test.indices):
        path = splits.test.dataset.samples[index][0]
        served = preprocess.to_input(preprocess.decode(path, spec)[None], spec)[0]
        np.testing.assert_allclose(splits.test[i][0].numpy(), served, atol=1e-5)


def test_an_image_folder_of_one_class_or_too_few_images_is_refused_saying_why(tmp_path):
    """One class trains nothing (its loss is zero whatever the weights); a single folder is
    split twice, so each class needs three images, not the two the split's own error asked."""
    with pytest.raises(PipelineError, match=r"has one class subfolder \(class0\); a classifier "
                                            "needs two or more"):
        load_dataset("imagefolder", image_size=8, seed=0,
                     data_dir=_png_folder(tmp_path / "one", classes=1, size=8))
    with pytest.raises(PipelineError, match=r"class 'class0' in .*two has 2 image\(s\); give "
                                            r"every class 3 or more \(one each for test, "
                                            r"validation and training\)"):
        load_dataset("imagefolder", image_size=8, seed=0,
                     data_dir=_png_folder(tmp_path / "two", per_class=2, size=8))
    assert len(load_dataset("imagefolder", image_size=8, seed=0, data_dir=_png_folder(
        tmp_path / "three", per_class=3, size=8)).train) == 3


def test_missing_data_names_the_folder_and_files(tmp_path):
    with pytest.raises(PipelineError) as raised:
        load_dataset("mnist", image_size=28, seed=0, data_dir=tmp_path)
    message = str(raised.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "train-images-idx3-ubyte" in message
    assert "--download" in message
    with pytest.raises(PipelineError, match="cifar-10-batches-py.*data_batch_1"):
        load_dataset("cifar10", image_size=32, seed=0, data_dir=tmp_path)
    with pytest.raises(PipelineError, match="is not a folder"):
        load_dataset("imagefolder", image_size=32, seed=0, data_dir=tmp_path / "nothing")


def test_training_runs_on_torchvision_data(cifar_dir, tmp_path):
    run = artifacts.create_run(tmp_path / "artifacts", "cifar")
    config = TrainConfig(model="smallcnn", dataset="cifar10", data_dir=str(cifar_dir), epochs=1,
                         batch_size=16, lr=0.05, baseline=False, measure_memory=False,
                         quiet=True)
    (result,) = train.run(config, run)
    assert result.optimizer_steps == 6  # 90 training images in batches of 16
    assert run.entry("amp")["model_spec"]["in_channels"] == 3
    # The reported test accuracy is what the saved model scores on the 20 test images.
    from stages.measure.evaluate import dataset_accuracy
    from stages.runtimes.pytorch import load_float_module

    saved = load_float_module(run, "amp")
    assert result.test_accuracy == dataset_accuracy(saved, load_dataset(
        "cifar10", image_size=32, seed=0, data_dir=cifar_dir).test)
    assert round(result.test_accuracy * 20) == result.test_accuracy * 20


def test_quantizes_check_images_cover_the_classes_of_a_split_in_class_order():
    """An image folder's training split lists its classes one after another (900 photos of the
    first class come first in photos10): the images quantize compares a variant on before and
    after saving, and against its runtime, are drawn across the split, not its first 128."""
    from stages.data.subsets import spread_images

    in_class_order = torch.utils.data.TensorDataset(
        torch.arange(10).repeat_interleave(90).float().view(-1, 1, 1, 1),
        torch.arange(10).repeat_interleave(90))
    drawn = spread_images(in_class_order, 128, seed=0)
    assert drawn.shape == (128, 1, 1, 1)
    assert set(drawn.flatten().long().tolist()) == set(range(10))
    assert torch.equal(drawn, spread_images(in_class_order, 128, seed=0))  # a fixed draw


def test_an_image_folders_split_subfolders_go_by_their_usual_names(tmp_path):
    """train/ and valid/ (Kaggle's and Roboflow's names) had been read as two classes, "train"
    and "valid"; with val/ and test/ both present, val/ had been taken as the test split."""
    _png_folder(tmp_path / "kaggle" / "train")
    _png_folder(tmp_path / "kaggle" / "valid", per_class=4)
    kaggle = load_dataset("imagefolder", image_size=8, seed=0, data_dir=tmp_path / "kaggle")
    assert kaggle.classes == ("class0", "class1", "class2") and len(kaggle.test) == 12
    for split, count in (("train", 10), ("val", 3), ("test", 5)):
        _png_folder(tmp_path / "three" / split, per_class=count)
    three = load_dataset("imagefolder", image_size=8, seed=0, data_dir=tmp_path / "three")
    assert (len(three.train), len(three.val), len(three.test)) == (30, 9, 15)
    flat = _png_folder(tmp_path / "vehicles")  # a class may be called train
    (flat / "class2").rename(flat / "train")
    vehicles = load_dataset("imagefolder", image_size=8, seed=0, data_dir=flat)
    assert vehicles.classes == ("class0", "class1", "train")


def test_hidden_folders_and_files_in_an_image_folder_are_left_out(tmp_path):
    """As predict leaves them out: .ipynb_checkpoints/ had become a class, and macOS's ._x.png
    (not an image) stopped training as unreadable."""
    root = _png_folder(tmp_path / "flat", per_class=6)
    (root / ".ipynb_checkpoints").mkdir()
    Image.new("RGB", (12, 12)).save(root / ".ipynb_checkpoints" / "a.png")
    (root / "class0" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    splits = load_dataset("imagefolder", image_size=8, seed=0, data_dir=root)
    assert splits.classes == ("class0", "class1", "class2") and splits.skipped_images == 0
    assert len(splits.train) + len(splits.val) + len(splits.test) == 18


def test_data_that_changed_since_training_is_refused_when_a_later_stage_splits_it(tmp_path):
    """quantize and report split the folder again: a photo added moves others between the
    test and training splits, and the report had scored the model on images it trained on."""
    import dataclasses

    from stages.data.datasets import load_splits, splits_of_run

    root = _png_folder(tmp_path / "photos", per_class=12)
    config = TrainConfig(model="smallcnn", dataset="imagefolder", data_dir=str(root),
                         image_size=8)
    entries = {"amp": {"config": dataclasses.asdict(config),
                       "data": load_splits(config).identity()}}
    run = type("Run", (), {"name": "r", "artifacts": lambda self: entries,
                           "entry": lambda self, name: entries[name]})()
    assert splits_of_run(run).classes == ("class0", "class1", "class2")  # the same data: read
    Image.new("RGB", (12, 12)).save(root / "class1" / "new.png")
    with pytest.raises(PipelineError, match=r"the data in .*photos is not what this run was "
                                            r"trained on: its \w+ split held \d+ images and now "
                                            r"holds .*put the data back as it was"):
        splits_of_run(run)


def test_a_single_image_folders_test_split_stays_when_val_fraction_changes(tmp_path):
    """The test split was drawn with --val-fraction's share: runs differing in that flag alone
    were scored on different images (6 of 60 against 18), and compared side by side."""
    root = _png_folder(tmp_path / "flat", per_class=20, size=8)
    tenth, third = (load_dataset("imagefolder", image_size=8, seed=0, data_dir=root,
                                 val_fraction=share) for share in (0.1, 0.3))
    assert tenth.test.indices == third.test.indices and len(tenth.test) == 12  # 20% of 60
    assert (len(tenth.val), len(third.val)) == (5, 15)  # of the 48 left, rounded up


def test_split_folders_of_images_without_class_subfolders_are_refused(tmp_path):
    """train/*.png beside test/*.png had been read as two classes, 'test' and 'train'."""
    for split in ("train", "test"):
        for i, image in enumerate(_png_folder(tmp_path / "scratch" / split, classes=1,
                                              per_class=4, size=8).rglob("*.png")):
            (tmp_path / "flat" / split).mkdir(parents=True, exist_ok=True)
            image.rename(tmp_path / "flat" / split / f"{i}.png")
    with pytest.raises(PipelineError, match=r"flat/train holds no class subfolders; put each "
                                            "class's images in a subfolder"):
        load_dataset("imagefolder", image_size=8, seed=0, data_dir=tmp_path / "flat")


def test_a_held_out_folder_left_empty_by_skipped_images_is_refused(tmp_path):
    """Its every file unreadable and skipped, test/ was an empty test split: training recorded
    a NaN accuracy and the report failed on a division by zero."""
    _png_folder(tmp_path / "split" / "train", size=8)
    for image in _png_folder(tmp_path / "split" / "test", per_class=2, size=8).rglob("*.png"):
        image.write_bytes(b"not an image")
    with pytest.raises(PipelineError, match=r"split/test has no readable image left"):
        load_dataset("imagefolder", image_size=8, seed=0, data_dir=tmp_path / "split",
                     skip_bad_images=True)


def test_a_later_stage_reads_the_data_where_training_found_it(tmp_path, monkeypatch):
    """quantize and report read the data again from the saved config: a relative --data-dir
    named another folder (or none) when they ran from elsewhere. The run records where the data
    was found; a run copied with its data beside it reads it from the config's path."""
    from stages.data.datasets import load_splits

    _png_folder(tmp_path / "project" / "photos", per_class=4, size=8)
    monkeypatch.chdir(tmp_path / "project")
    config = TrainConfig(model="smallcnn", dataset="imagefolder", data_dir="photos", image_size=8)
    trained_on = load_splits(config).identity()
    assert config.data_dir == "photos"  # saved as given
    assert trained_on["data_dir"] == str(tmp_path / "project" / "photos")
    monkeypatch.chdir(tmp_path)  # `pipeline --artifacts-dir project/artifacts report`
    assert load_splits(config, trained_on).identity() == trained_on
    (tmp_path / "project").rename(tmp_path / "copied")
    monkeypatch.chdir(tmp_path / "copied")
    assert load_splits(config, trained_on).data_dir == str(tmp_path / "copied" / "photos")


def test_a_single_image_folder_run_split_before_the_test_share_was_fixed_splits_as_it_did(
        tmp_path):
    """A run whose recorded data has no test_fraction was split with --val-fraction's share
    for test too: it must be split so again, not refused as changed data."""
    from stages.data.datasets import load_splits

    config = TrainConfig(model="smallcnn", dataset="imagefolder", image_size=8,
                         data_dir=str(_png_folder(tmp_path / "flat", per_class=20, size=8)))
    then = load_dataset("imagefolder", image_size=8, seed=0, data_dir=config.data_dir,
                        test_fraction=None)  # the rule before 4f94e1f: 10% of 60
    older = {key: value for key, value in then.identity().items() if key != "test_fraction"}
    assert older["test"]["images"] == 6 and len(load_splits(config).test) == 12
    assert len(load_splits(config, older).test) == 6
