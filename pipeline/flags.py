"""The command line's words for each stage config field, beside the dataclasses in config.py:
what a flag means, not its default or type. click_support.stage_options makes the options
from this table and the dataclass together, so the default and the type a flag shows are the
ones the stage runs with; a default that is computed (None in the dataclass) is described here
in `default`. tests/pipeline/test_cli.py checks that every entry names a field.
"""
from __future__ import annotations

from typing import NamedTuple

from pipeline import config as cfg


class Flag(NamedTuple):
    help: str
    metavar: str | None = None
    default: str | None = None  # the default in words, where the dataclass's is None
    choices: tuple | None = None
    path: str | None = None  # "file" or "dir": a click.Path of that kind
    flag: bool = False  # an on-only flag (--auto), not an --x/--no-x pair
    off: str | None = None  # the pair's second name where it is not --no-x
    multiple: bool = False  # may be given more than once


DATA = {
    "model": Flag("A built-in (smallcnn, mixer), any torchvision classification model, "
                  "timm:NAME, or package.module:factory for your own; `pipeline list models`."),
    "dataset": Flag("digits is built in; `pipeline list datasets`.",
                    choices=cfg.DATASET_NAMES),
    "data_dir": Flag("Where torchvision data sets or your image folder live.", path="dir"),
    "download": Flag("Let torchvision fetch the data set where the network allows."),
    "val_fraction": Flag("Share of the training split held out to choose with (the epoch kept, "
                         "--auto, the recommendation)."),
    "image_size": Flag("Side of the square input in pixels."),
    "in_channels": Flag("Input channels of the model; grey images are widened to 3 if asked.",
                        default="the data's own", choices=(1, 3)),
    "skip_bad_images": Flag("Skip unreadable files in an image folder (counted) instead of "
                            "stopping.", flag=True),
}

TRAIN = DATA | {
    "epochs": Flag("Epochs at most.", default=f"{cfg.DEFAULT_EPOCHS}; with --time, what fits it"),
    "time": Flag("Time for the stage (90s, 10m, 1h): what loading the data and --lr auto's range "
                 "test leave is shared by the models trained; after each epoch the epochs that "
                 "fit at the pace so far are planned again, the learning-rate schedule with "
                 "them.", metavar="DURATION", default="no limit"),
    "patience": Flag("Once validation accuracy has not improved for this many epochs in the "
                     "plan's second half, cut the schedule to end this many epochs later.",
                     metavar="EPOCHS"),
    "batch_size": Flag("Images a step."),
    "lr": Flag("Peak learning rate of SGD (cosine, warm-up); auto: found by a learning-rate "
               "range test (150 steps, then 450 where the loss did not fall; under --time at "
               "most a fifth of it). Where a test would outrun training or its share, the "
               "linear-scaling rule; where neither can be read, the best on validation of the "
               "rule and its quarters, 450 steps each (under --time, the rule).",
               metavar="LR|auto"),
    "weight_decay": Flag("On weights, not on BatchNorm or biases."),
    "label_smoothing": Flag("Of the cross-entropy targets."),
    "grad_clip": Flag("Max gradient norm, 0 for none (clips after unscaling)."),
    "precision": Flag("Autocast type of the amp model; auto: fp16 with GradScaler on CUDA; on a "
                      "CPU bf16 where it has bf16 instructions (AVX-512 BF16, AMX), else fp32.",
                      choices=cfg.PRECISIONS),
    "baseline": Flag("Also train the fp32 baseline."),
    "init_weights": Flag("Start from this state_dict or checkpoint (weights-only); a classifier "
                         "for another number of classes is replaced.", metavar="FILE",
                         default="none", path="file"),
    "weights": Flag("Start from torchvision's pretrained weights (DEFAULT, IMAGENET1K_V1, ...), "
                    "read from the local torch hub cache.", metavar="NAME", default="none"),
    "workers": Flag("DataLoader worker processes."),
    "loader_timeout": Flag("Give up on a DataLoader worker silent this long.",
                           metavar="SECONDS"),
    "checkpoint_every": Flag("Also checkpoint every STEPS optimizer steps; 0: at epoch ends "
                             "only.", metavar="STEPS"),
    "keep_checkpoints": Flag("Newest checkpoints kept (plus the best)."),
    "max_skipped_steps": Flag("Stop when GradScaler skips more steps than this in a row."),
    "deterministic": Flag("torch.use_deterministic_algorithms, for bit-identical resumes."),
    "measure_memory": Flag("Measure each model's training memory in a fresh process (a few "
                           "seconds each; CUDA: the allocator's peak instead)."),
}

IMPORT = DATA | {
    "weights": Flag("The weights to import: a state_dict or checkpoint file (weights-only), or "
                    "torchvision's pretrained weights by name.", metavar="FILE|NAME",
                    default="required"),
}

QAT = {
    "epochs": Flag("Epochs of fine-tuning."),
    "lr": Flag("Peak learning rate."),
    "batch_size": Flag("Images a step."),
    "freeze_bn_after": Flag("BatchNorm statistics stop updating after this many epochs.",
                            metavar="EPOCHS", default="half of --epochs"),
    "freeze_observers_after": Flag("Quantization ranges stop updating after this many epochs.",
                                   metavar="EPOCHS", default="70% of --epochs"),
    "precision": Flag("Autocast type of the fine-tuning; auto: fp32, which torchao's fake "
                      "quantizers need (bf16 or fp16 fail where an activation reaches one in "
                      "half precision).", choices=cfg.PRECISIONS),
    "tuning_time": Flag("Time the fine-tuning may take (90s, 5m, 1h): once an epoch is timed, "
                        "the epochs and the freezes are cut to what fits.", metavar="DURATION",
                        default="no limit"),
}

QUANTIZE = {
    "methods": Flag("Comma list of the variants to make, or all (`pipeline list variants`)."),
    "calibration_samples": Flag("Training images static quantization observes.",
                                default="512 up to 64x64, 128 from 128x128"),
    "calibration_batch_size": Flag("Images a calibration batch."),
    "calibration_method": Flag("ONNX Runtime static calibration.", default="minmax, or what "
                               "--auto finds", choices=cfg.CALIBRATION_METHODS),
    "per_channel": Flag("ONNX Runtime static weight scales (torch-static's are per-channel).",
                        off="per-tensor", default="per-tensor, or what --auto finds"),
    "ort_types": Flag("ORT activation/weight types.", default="u8s8, or what --auto finds",
                      choices=cfg.ORT_TYPES),
    "ort_format": Flag("ORT static graph format; QOperator only on request (not with --auto).",
                       default="qdq", choices=cfg.ORT_FORMATS),
    "equalize": Flag("Cross-layer equalization of the float model before torch-static and "
                     "ort-static (outputs unchanged; evens per-channel weight ranges).",
                     default="with per-tensor weights; --auto also tries it for torch-static"),
    "auto": Flag("Try several static configurations per backend on held-out training images; "
                 "keep the fastest within --max-accuracy-drop.", flag=True),
    "max_accuracy_drop": Flag("Held-out accuracy (points) a static model may lose against its "
                              "float source, at 95% confidence; beyond it, sensitive layers stay "
                              "float, and a model that still misses it is not kept.",
                              metavar="POINTS"),
    "tuning_time": Flag("Time each static backend's search may take (90s, 5m, 1h): what was not "
                        "reached is not tried.", metavar="DURATION", default="no limit"),
}

REPORT = {
    "batch_sizes": Flag("Comma list of batch sizes to time."),
    "threads": Flag("Threads for every runtime alike; 0: one per CPU it may use, at most 8."),
    "rounds": Flag("Rounds of timing at least; every variant is timed in each, the order "
                   "rotated."),
    "max_rounds": Flag("Rounds of timing at most."),
    "repeats": Flag("Timed calls per variant in each round; 0: as many as fill 50 ms."),
    "target_interval": Flag("Time until every speed-up against the fastest float has a 95% "
                            "interval with high/low at most this, or wholly below its "
                            "inverse (that much slower).", metavar="RATIO"),
    "timing_budget": Flag("Stop adding rounds after this long, per batch size.",
                          metavar="SECONDS"),
    "warmup": Flag("Untimed calls first."),
    "max_accuracy_drop": Flag("Held-out accuracy (points) the recommended variant may lose "
                              "against the model the variants were made from (amp; fp32 where "
                              "amp is its copy), at 95% confidence.", metavar="POINTS"),
    "fail_under_speedup": Flag("Exit 1 when the recommended variant is less than X times faster "
                               "than the model it was made from (amp; fp32 where amp is its "
                               "copy); 0: never.", metavar="X"),
    "fail_under_float_speedup": Flag("Exit 1 when the recommended variant is less than X times "
                                     "faster than the fastest float variant (the report's "
                                     "headline ratio); 0: never.", metavar="X"),
    "compare": Flag("Also put these runs' reports side by side with this one (compare.md).",
                    metavar="RUN[,RUN...]", multiple=True),
    "time_below_amx": Flag("On a CPU with AMX, also time the int8 and bf16 variants that run "
                           "oneDNN with it capped below AMX, and say where that is faster."),
}

PREDICT = {
    "variant": Flag("A variant's name, or recommended (the report's choice)."),
    "top_k": Flag("Classes printed per image."),
    "batch_size": Flag("Images decoded and predicted together."),
    "json": Flag("One JSON object per image instead of text.", flag=True),
    "threads": Flag("Threads the runtime uses; 0: one per CPU it may use, at most 8."),
}

EXPORT = {
    "variant": Flag("A variant's name, or recommended (the report's choice)."),
}

FLAGS = {"train": TRAIN, "import": IMPORT, "qat": QAT, "quantize": QUANTIZE, "report": REPORT,
         "predict": PREDICT, "export": EXPORT}
