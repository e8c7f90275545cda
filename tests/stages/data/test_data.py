import numpy as np
import pytest
import torch

from stages.data.datasets import load_dataset, stratified_split
from stages.data.subsets import calibration_batches
from stages.run.errors import PipelineError


def _rows(tensor):
    return {tuple(row.flatten().tolist()) for row in tensor}


def test_digits_split_is_stratified_disjoint_and_fixed():
    splits = load_dataset("digits", image_size=8, seed=0)
    sizes = [len(splits.train), len(splits.val), len(splits.test)]
    assert sum(sizes) == 1797 and sizes[2] == 360
    counts = torch.bincount(splits.test.tensors[1], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # 20% of every class of ~180
    assert not _rows(splits.train.tensors[0]) & _rows(splits.test.tensors[0])
    other_seed = load_dataset("digits", image_size=8, seed=1)
    assert torch.equal(other_seed.test.tensors[0], splits.test.tensors[0])
    assert not torch.equal(other_seed.train.tensors[1], splits.train.tensors[1])


def test_image_size_resizes_and_normalises():
    splits = load_dataset("digits", image_size=32, seed=0)
    assert splits.train.tensors[0].shape[1:] == (1, 32, 32)
    assert splits.input_shape(4) == (4, 1, 32, 32)
    assert abs(float(splits.train.tensors[0].mean())) < 0.1


def test_calibration_comes_from_the_training_split_only():
    splits = load_dataset("digits", image_size=8, seed=0)
    batches = calibration_batches(splits, num_samples=100, batch_size=32, seed=0)
    assert [len(b) for b in batches] == [32, 32, 32, 4]
    chosen = _rows(torch.cat(batches))
    assert chosen <= _rows(splits.train.tensors[0])
    assert not chosen & _rows(splits.test.tensors[0])


class _Counting(torch.utils.data.Dataset):
    """A large 'training split' that counts the images it is asked to decode."""

    def __init__(self, size):
        self.size, self.decoded = size, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.decoded += 1
        return torch.zeros(1, 8, 8), index % 10


def test_the_selection_images_are_streamed_not_decoded_whole():
    from stages.data.datasets import DataSplits
    from stages.data.subsets import tuning_images

    train, val = _Counting(50_000), _Counting(300)
    splits = DataSplits(train, val, _Counting(10), train, num_classes=10, in_channels=1,
                        image_size=8)
    images, labels = tuning_images(splits, calibration_samples=512, seed=0, limit=1024)
    assert len(images) == 1024 and val.decoded == 300 and train.decoded == 724


def test_the_report_holds_out_what_every_listed_variants_quantize_calibrated_on():
    """torch-static calibrated on 300 images, then ort-static made again on 100 with another
    seed: the report's held-out training images leave out both calibrations."""
    from types import SimpleNamespace

    from stages.data.datasets import DataSplits
    from stages.data.subsets import _seeded_order, selection_set
    from stages.report.measuring import calibrations

    def entry(samples, seed, stage="quantize"):
        return {"stage": stage, "config": {"calibration_samples": samples, "seed": seed}}

    run = SimpleNamespace(artifacts=lambda: {"amp": {"stage": "train", "config": {"seed": 0}},
                                             "torch-static": entry(300, 0),
                                             "ort-static": entry(100, 1)})
    assert calibrations(run) == {(300, 0), (100, 1)}
    splits = DataSplits(_Counting(1000), _Counting(50), _Counting(10), _Counting(1000),
                        num_classes=10, in_channels=1, image_size=8)
    selection = selection_set(splits, 100, 1, limit=1000, also_calibrated={(300, 0)})
    held_out = set(selection.datasets[1].indices)
    calibrated = set(_seeded_order(1000, 0)[:300]) | set(_seeded_order(1000, 1)[:100])
    assert not held_out & calibrated and held_out | calibrated == set(range(1000))


def test_a_class_sorted_validation_split_larger_than_the_selection_gives_every_class():
    """An image folder lists its classes in order: the selection's validation part must span
    them, and the images a fine-tuned variant is judged on must stay out of qat's half."""
    from stages.data.datasets import DataSplits
    from stages.data.subsets import selection_set, validation_halves
    from stages.report.measuring import BASELINE_WORDS, VALIDATION_WORDS, _judged_indices

    class Sorted(torch.utils.data.Dataset):  # 10 classes of 600 images, class by class
        def __len__(self):
            return 6000

        def __getitem__(self, index):
            return torch.zeros(1, 8, 8), index // 600

    val = Sorted()
    splits = DataSplits(_Counting(100), val, _Counting(10), _Counting(100), num_classes=10,
                        in_channels=1, image_size=8)
    selection = selection_set(splits, calibration_samples=10, seed=0, limit=1024)
    assert len(selection) == 1024
    labels = torch.tensor([selection[i][1] for i in range(1024)])
    assert torch.bincount(labels, minlength=10).min() >= 70  # about 102 of each
    assert _judged_indices(selection, BASELINE_WORDS) == list(range(1024))
    judged = [selection.datasets[0].indices[i]
              for i in _judged_indices(selection, VALIDATION_WORDS)]
    assert 400 < len(judged) < 624 and set(judged) <= set(validation_halves(6000)[1])


def test_the_stratified_split_shares_the_held_out_part_among_classes_in_proportion():
    labels = np.array([0] * 50 + [1] * 30 + [2] * 3 + [3] * 2)
    kept, held = stratified_split(labels, 0.2, seed=0)
    assert sorted(np.concatenate([kept, held])) == list(range(85))
    # ceil(0.2 x 85) = 17 is 10 + 6 + 0.6 + 0.4 by proportion: the larger remainder gets the
    # seventeenth, and the last class one more, since every class keeps one image and holds
    # one out however small its share.
    assert np.bincount(labels[held]).tolist() == [10, 6, 1, 1]
    assert np.bincount(labels[kept]).tolist() == [40, 24, 2, 1]
    again, other = stratified_split(labels, 0.2, seed=0), stratified_split(labels, 0.2, seed=1)
    assert np.array_equal(again[1], held) and not np.array_equal(other[1], held)
    with pytest.raises(PipelineError, match="class 9 has a single image; give every class two"):
        stratified_split(np.array([0, 0, 9]), 0.5, seed=0)


def test_calibration_holds_512_images_up_to_64x64_then_their_pixels_down_to_128():
    from stages.data.subsets import default_calibration_samples

    sizes = (8, 32, 64, 96, 128, 224, 512)
    assert [default_calibration_samples(s) for s in sizes] == [512, 512, 512, 227, 128, 128, 128]


class _Draws(torch.utils.data.Dataset):
    """What a worker's augmentation draws for each image: its random state at that read."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.rand(1), index


def test_with_workers_an_epoch_draws_the_same_augmentation_after_a_resume():
    """The loader's generator was seeded once, when the loader was made: a run resumed at
    epoch 2 gave its workers the seeds of the original's epoch 1."""
    from stages.data.loaders import EpochSampler, make_loader

    def epoch(loader, sampler, number):
        sampler.set_epoch(number)
        return torch.cat([draws for draws, _ in loader])

    sampler = EpochSampler(8, seed=3, batch_size=4)
    original = make_loader(_Draws(), 4, sampler, workers=1)
    first, second = epoch(original, sampler, 1), epoch(original, sampler, 2)
    resumed_sampler = EpochSampler(8, seed=3, batch_size=4)
    resumed = make_loader(_Draws(), 4, resumed_sampler, workers=1)
    assert torch.equal(epoch(resumed, resumed_sampler, 2), second)
    assert not torch.equal(first, second)
