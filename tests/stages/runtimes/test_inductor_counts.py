"""The kernels counted in the code Inductor generates, from its Python wrapper or its C++ one."""
from types import SimpleNamespace

from stages.runtimes import inductor

PYTHON_WRAPPER = """
buf0 = torch.ops.onednn.qconv_pointwise.tensor(arg0, x_scale, x_zp)
buf1 = torch.ops.onednn.qconv2d_pointwise.binary_tensor(buf0, x_scale, x_zp)
buf2 = torch.ops.mkldnn._convolution_pointwise.default(buf1, _frozen_param3)
buf3 = torch.ops.mkl._mkl_linear.default(buf2, _frozen_param4)
buf4 = extern_kernels.addmm(bias, buf3, weight)
"""
# The C++ wrapper calls through the C ABI; with kernel profiling, a record names each call first.
CPP_CALLS = ["aoti_torch_cpu__qconv_pointwise_tensor",
             "aoti_torch_cpu__qconv2d_pointwise_binary_tensor",
             "aoti_torch_cpu_mkldnn__convolution_pointwise", "aoti_torch_cpu__mkl_linear",
             "aoti_torch_cpu__linear_pointwise", "aoti_torch_cpu_addmm_out",
             "aoti_torch_cpu__qlinear_pointwise_tensor"]
CPP_WRAPPER = "\n".join(f'    RAIIAtenRecordFunctionHandle record_{name}_("{name}", nullptr);\n'
                        f"    AOTI_TORCH_ERROR_CODE_CHECK({name}(buf, w, &out));"
                        for name in CPP_CALLS)


def _counts(code: str) -> dict:
    compiled, batch = object(), SimpleNamespace(shape=(2, 1, 8, 8))
    inductor._CODE[(id(compiled), batch.shape)] = code
    try:
        return inductor.compiled_counts(compiled, batch)
    finally:
        del inductor._CODE[(id(compiled), batch.shape)]


def test_each_kernel_call_is_counted_once_in_either_wrapper():
    assert _counts(PYTHON_WRAPPER) == {"Conv": {"int8": 2, "float": 1},
                                       "Linear": {"int8": 0, "float": 2}}
    # The C++ wrapper's kernel-profiling records name each call again: not counted.
    assert _counts(CPP_WRAPPER) == {"Conv": {"int8": 2, "float": 1},
                                    "Linear": {"int8": 1, "float": 3}}


def test_a_compiled_model_builds_a_graph_for_each_batch_size_it_is_timed_at():
    """Past Dynamo's default of 8 graphs, a ninth batch size (--batch-sizes 1,2,...,256) ran
    eager without a word and was timed as compiled; now up to RECOMPILE_LIMIT are built, and
    beyond it a recompile fails rather than falling back."""
    import torch
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.testing import CompileCounter

    with dynamo_config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        inductor.compile_module(torch.nn.Linear(2, 2))  # compiled at its first call
        assert dynamo_config.recompile_limit == inductor.RECOMPILE_LIMIT >= 16
        assert dynamo_config.fail_on_recompile_limit_hit
        # What the settings do, in torch's terms (a renamed setting would do nothing): ten
        # batch sizes, ten graphs, where Dynamo's default stopped at eight.
        counter = CompileCounter()
        model = torch.compile(torch.nn.Linear(2, 2), backend=counter, dynamic=False)
        for batch in range(1, 11):
            model(torch.randn(batch, 2))
        assert counter.frame_count == 10
