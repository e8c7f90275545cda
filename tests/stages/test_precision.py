import torch

from stages.precision import Precision, grad_scaler, resolve_precision


def test_auto_precision_is_fp16_on_cuda_and_bf16_on_cpu():
    assert resolve_precision("auto", torch.device("cuda")).name == "fp16"
    assert resolve_precision("auto", torch.device("cpu")).name == "bf16"
    assert resolve_precision("fp32", torch.device("cpu")).name == "fp32"
    assert Precision("fp16").uses_scaler and not Precision("bf16").uses_scaler


def test_fp16_scaler_on_cpu_skips_a_step_with_inf_gradients_and_backs_off():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = grad_scaler(Precision("fp16"), torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    loss = model(torch.tensor([[float("inf"), 1.0, 1.0]])).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == scale * 0.5
