import torch

from stages.precision import Precision, resolve_precision


def test_auto_precision_is_fp16_on_cuda_and_bf16_on_cpu():
    assert resolve_precision("auto", torch.device("cuda")).name == "fp16"
    assert resolve_precision("auto", torch.device("cpu")).name == "bf16"
    assert resolve_precision("fp32", torch.device("cpu")).name == "fp32"
    assert Precision("fp16").uses_scaler and not Precision("bf16").uses_scaler

