"""torch.compile for inference on the CPU (Inductor with freezing, so that oneDNN's int8 kernels
run), each model compiled once per process, and the count of convolution and linear kernels,
int8 or float, read from the code Inductor generates: what really runs.
"""
from __future__ import annotations

import re
import warnings

from stages.measure.evaluate import predict

# What Inductor emits for each kind of kernel (torch 2.14, torchao 0.18): a call from its Python
# wrapper, or the same through the C ABI (aoti_torch_cpu_*) from its C++ wrapper.
KERNELS = {
    ("Conv", "int8"): r"(?:torch\.ops\.onednn\.|aoti_torch_cpu__)qconv(?:2d)?_pointwise[\w.]*\(",
    ("Linear", "int8"): r"(?:torch\.ops\.onednn\.|aoti_torch_cpu__)qlinear_pointwise[\w.]*\(",
    ("Conv", "float"): r"(?:mkldnn(?:\._|__)convolution_pointwise[\w.]*\(|"
                       r"extern_kernels\.convolution\(|aten\.convolution[\w.]*\(|"
                       r"aoti_torch_cpu_convolution\w*\()",
    ("Linear", "float"): r"(?:(?:mkldnn\.|aoti_torch_cpu_)_linear_pointwise[\w.]*\(|"
                         r"(?:mkl\._|aoti_torch_cpu__)mkl_linear[\w.]*\(|"
                         r"(?:extern_kernels\.|aoti_torch_cpu_)(?:mm|addmm|bmm|baddbmm)(?:_out)?\()",
}
COMPILED_BATCH = 32  # compiled models predict in batches of this size: one graph to build
RECOMPILE_LIMIT = 64  # graphs a compiled model may build, one per input shape


# Inductor's C++ wrapper calls the kernels from C++ rather than from generated Python: on
# mnasnet0_5 at 32x32 (AMD EPYC, AVX2) fp32-compiled took 2.82 against 4.39 ms at batch 1 and
# torch-static 5.57 against 7.17 ms at batch 32, the Python wrapper's cost per kernel call
# (docs/measurements.md), for about 3 s more per compile. Its
# kernel calls and Inductor's own kernels reach torch.profiler only with kernel profiling on
# (a record per call; the timings above were taken with it on).
# Size asserts are off because their messages name Python objects by address (see
# _stable_wrapper_source).
COMPILE_OPTIONS = {"cpp_wrapper": True, "cpp.enable_kernel_profile": True,
                   "size_asserts": False}


def _stable_wrapper_source() -> None:
    """Make the C++ wrapper's source the same in every process, so that the library compiled
    from it is found in Inductor's on-disk cache instead of built again: g++ took 7 of the 10 s
    torch-static's compile took in the report's child on the default run (2.7 s with the cache;
    Inductor's FX graph cache skips frozen graphs whose weights oneDNN packed). Torch writes
    each constant's memory address into a comment at the source's top (torch 2.14's
    CppWrapperCpu.write_constant), so that different constants get different files; the
    library does not hold them (the generated Python module passes them in on every call, and
    is loaded afresh with its own), so the address is left out."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:  # another torch: it compiles as before, only without the cache
        return
    written = getattr(CppWrapperCpu, "write_constant", None)
    if written is None or getattr(written, "without_address", False):
        return

    def write_constant(self, name, hashed):
        written(self, name, hashed.rsplit(" ", 1)[0])

    write_constant.without_address = True
    CppWrapperCpu.write_constant = write_constant


def compile_module(module):
    """torch.compile for inference: Inductor with freezing (weights become constants, so
    oneDNN can pre-pack them and fuse int8 patterns) and its C++ wrapper, one graph per batch
    size (compiling with dynamic shapes failed on the second batch size in the int8
    convolution)."""
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    graph_per_shape()
    _stable_wrapper_source()
    # Inductor's own int8 lowering copies a tensor the way it tells others not to.
    warnings.filterwarnings("ignore", message="To copy construct from a tensor",
                            category=UserWarning, module=r"torch\._inductor")
    return torch.compile(module, dynamic=False, options=COMPILE_OPTIONS)


def graph_per_shape() -> None:
    """Let a compiled model build a graph for each batch size it meets: past Dynamo's limit of
    8 a new size had run eager without a word (9 --batch-sizes, or the GPU rows' scoring sizes
    beside theirs) and been timed as compiled; past ours it fails instead."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.fail_on_recompile_limit_hit = True


# Compiled models kept for the life of the process, keyed by the sha256 of the file they came
# from, what was compiled and the thread count Inductor generated their kernels for: in a
# chain, quantize has already compiled what report then loads, and each compile takes 3 to 15 s
# on the 2-core development machine (Inductor's FX graph cache skips graphs with frozen
# weights; only the C++ library is found on disk).
_COMPILED: dict[tuple[str, str, int], object] = {}


def compiled_once(sha256: str, kind: str, build):
    """``compile_module(build())``, or the module compiled for the same file before in this
    process."""
    import torch

    key = (sha256, kind, torch.get_num_threads())
    if key not in _COMPILED:
        _COMPILED[key] = compile_module(build())
    return _COMPILED[key]


def predict_compiled(compiled, images):
    """Logits of a compiled model in batches of one size, the last one padded with zeros, so
    that scoring a data set builds no graph beyond the one timed at that size."""
    import torch

    outputs = []
    for start in range(0, len(images), COMPILED_BATCH):
        batch = images[start:start + COMPILED_BATCH]
        padded = torch.cat([batch, batch.new_zeros(COMPILED_BATCH - len(batch),
                                                   *batch.shape[1:])])
        outputs.append(predict(compiled, padded)[:len(batch)])
    return torch.cat(outputs) if outputs else torch.empty(0)


def _generated_code(compiled, batch) -> str:
    """The code Inductor generates when ``compiled`` first runs on ``batch``'s shape. Captured
    as it is written rather than with run_and_get_code, which resets Dynamo and so throws away
    every other compiled model of the process."""
    import torch
    from torch._inductor.graph import GraphLowering

    code: list[str] = []
    real = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(code.append)
    try:
        with torch.inference_mode():
            compiled(batch)
    finally:
        GraphLowering.save_output_code = real
    return "\n".join(code)


_CODE: dict[tuple[int, tuple[int, ...]], str] = {}  # (id of a compiled model, input shape)


def compiled_counts(compiled, batch) -> dict[str, dict[str, int]]:
    """Count the convolution and linear kernels, by kind, in the code Inductor generated for
    ``compiled`` at ``batch``'s shape (compiling it there if it was not yet)."""
    key = (id(compiled), tuple(batch.shape))
    if key not in _CODE:
        _CODE[key] = _generated_code(compiled, batch)
    if not _CODE[key]:  # compiled before this process kept its code: compile it afresh
        import torch
        from torch._inductor.utils import run_and_get_code

        with torch.inference_mode():
            _CODE[key] = "\n".join(run_and_get_code(compiled, batch)[1])
    # Kernel profiling names each call once more, in a record made before it.
    code = re.sub(r"^.*RAIIAtenRecordFunctionHandle.*$", "", _CODE[key], flags=re.MULTILINE)
    counts: dict[str, dict[str, int]] = {}
    for (kind, precision), pattern in KERNELS.items():
        found = len(re.findall(pattern, code))
        if found:
            counts.setdefault(kind, {"int8": 0, "float": 0})[precision] += found
    return counts
