"""Each bounded setting takes its lowest value and refuses one below it, naming its flag: the
property tests in tests/reliability/test_bad_input.py draw values at random and pass where a
check is missing (an accepted value ends them), so a validator deleted went unseen."""
import pytest

from pipeline import config as cfg

# (stage, field, the lowest value it takes, other fields the case needs); "above" where the
# bound itself is refused (greater than).
AT_LEAST = [
    ("train", "workers", 0, {}), ("train", "checkpoint_every", 0, {}),
    ("train", "keep_checkpoints", 1, {}), ("train", "max_skipped_steps", 1, {}),
    ("train", "epochs", 1, {}), ("train", "patience", 1, {}), ("train", "batch_size", 1, {}),
    ("train", "weight_decay", 0.0, {}), ("train", "grad_clip", 0.0, {}),
    ("train", "image_size", 8, {}),
    ("qat", "epochs", 1, {}), ("qat", "batch_size", 1, {}), ("qat", "freeze_bn_after", 0, {}),
    ("qat", "freeze_observers_after", 1, {}),
    ("quantize", "calibration_samples", 1, {}), ("quantize", "calibration_batch_size", 1, {}),
    ("quantize", "max_accuracy_drop", 0.0, {}),
    ("report", "threads", 0, {}), ("report", "warmup", 1, {}),
    ("report", "rounds", 3, {"repeats": 0}), ("report", "repeats", 0, {}),
    ("report", "target_interval", 1.0, {}), ("report", "max_accuracy_drop", 0.0, {}),
    ("report", "fail_under_speedup", 0.0, {}), ("report", "fail_under_float_speedup", 0.0, {}),
    ("predict", "top_k", 1, {"paths": (".",)}), ("predict", "batch_size", 1, {"paths": (".",)}),
    ("predict", "threads", 0, {"paths": (".",)}),
]
ABOVE = [("train", "loader_timeout"), ("qat", "lr"), ("report", "timing_budget")]


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@pytest.mark.parametrize("stage, field, lowest, others", AT_LEAST)
def test_a_bounded_setting_takes_its_lowest_value_and_refuses_below_it(stage, field, lowest,
                                                                       others):
    config_class = cfg.STAGE_CONFIGS[stage]
    assert getattr(config_class(**others | {field: lowest}), field) == lowest
    below = lowest - (1 if isinstance(lowest, int) else 0.5)
    with pytest.raises(ValueError, match=f"^{_flag(field)} must be at least {lowest}, got "):
        config_class(**others | {field: below})


@pytest.mark.parametrize("stage, field", ABOVE)
def test_a_setting_that_must_be_positive_refuses_zero(stage, field):
    config_class = cfg.STAGE_CONFIGS[stage]
    assert getattr(config_class(**{field: 0.5}), field) == 0.5
    with pytest.raises(ValueError, match=f"^{_flag(field)} must be "):
        config_class(**{field: 0})


@pytest.mark.parametrize("stage, others", [("report", {}), ("predict", {"paths": (".",)})])
def test_threads_take_at_most_the_cap_and_refuse_more(stage, others):
    """--threads 100000 went to every runtime's thread pool as it was."""
    config_class = cfg.STAGE_CONFIGS[stage]
    assert config_class(**others | {"threads": cfg.MAX_THREADS}).threads == cfg.MAX_THREADS
    with pytest.raises(ValueError, match=f"^--threads must be at most {cfg.MAX_THREADS}"):
        config_class(**others | {"threads": cfg.MAX_THREADS + 1})
