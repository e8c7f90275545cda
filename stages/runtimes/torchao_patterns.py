"""One torch.export per pattern and process, not one per use, for torchao's PT2E rewrites.

torchao rewrites exported graphs by matching small patterns (conv + BatchNorm for QAT, dropout
and BatchNorm for train/eval switches) and exports each pattern with a strict torch.export
every time it rewrites: 126 exports of 114 distinct patterns, about 60 s on the 2-core
development machine, in a two-epoch QAT of a three-layer model whose fine-tuning took seconds.
A pattern's graph depends only on its function, the values the function closes over, and the
shapes and dtypes of its example inputs, so the first export of each is kept and later uses get
a copy (a rewrite may edit the graphs it is given). A second QAT or --auto fallback in one
process then skips them all.

Most of those patterns are for convolutions the model does not have: torchao rewrites conv +
BatchNorm for conv1d, conv2d, conv_transpose1d and conv_transpose2d in turn, 27 exports each,
whatever the graph holds. A rewrite for a convolution the graph has no node of cannot match,
so it is skipped: a model with conv2d alone gets 33 exports, not 114, and the tiny test model's
first QAT in a process took 24.3 s instead of 45.5 on the AMD EPYC, its int8 file byte for byte
the same. torchao-0.18's private names are looked up, and nothing is changed where they are
missing.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

_GRAPHS: dict[tuple, Any] = {}
_INSTALLED = False


def _describe(value: Any) -> Any:
    """A hashable stand-in: a tensor by its shape, dtype and device, anything else as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    return value


def pattern_key(pattern: Any, example_inputs: tuple, is_cuda: bool, kwargs: dict):
    """What a pattern's exported graph depends on, or None where that cannot be told (a
    pattern that is not a plain function, or closes over something unhashable)."""
    function = getattr(pattern, "fn", pattern)  # torchao wraps functions in a WrapperModule
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    closed_over = tuple(_describe(cell.cell_contents) for cell in function.__closure__ or ())
    key = (code, closed_over, function.__defaults__,
           tuple(_describe(x) for x in example_inputs), is_cuda,
           tuple(sorted((k, _describe(v)) for k, v in kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def cached(export_pattern: Callable) -> Callable:
    def export_once(pattern, example_inputs, is_cuda=False, **kwargs):
        key = pattern_key(pattern, example_inputs, is_cuda, kwargs)
        if key is None:
            return export_pattern(pattern, example_inputs, is_cuda, **kwargs)
        if key not in _GRAPHS:
            _GRAPHS[key] = export_pattern(pattern, example_inputs, is_cuda, **kwargs)
        return copy.deepcopy(_GRAPHS[key])

    export_once.__wrapped__ = export_pattern
    return export_once


def only_for_convolutions_present(rewrite: Callable) -> Callable:
    """``rewrite(m, conv_fn, example_inputs, is_cuda)`` (torchao's conv + BatchNorm fuse and
    fold helpers), run only where ``m`` calls the aten op ``conv_fn`` traces to (F.conv2d to
    aten.conv2d, named alike): a pattern of another convolution matches nothing there."""
    def rewrite_where_present(m, conv_fn, example_inputs, is_cuda=False, **kwargs):
        name = getattr(conv_fn, "__name__", None)
        present = {getattr(getattr(node.target, "overloadpacket", None), "__name__", None)
                   for node in m.graph.nodes if node.op == "call_function"}
        if name is not None and name.startswith("conv") and name not in present:
            return m
        return rewrite(m, conv_fn, example_inputs, is_cuda=is_cuda, **kwargs)

    rewrite_where_present.__wrapped__ = rewrite
    return rewrite_where_present


def install() -> None:
    """Route torchao's pattern exports through the cache (its utils module, and qat_utils,
    which imported the function by name)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from torchao.quantization.pt2e import qat_utils, utils

    name = "_get_aten_graph_module_for_pattern"
    if not (hasattr(utils, name) and hasattr(qat_utils, name)):
        return
    export_once = cached(utils._get_aten_graph_module_for_pattern)
    utils._get_aten_graph_module_for_pattern = export_once
    qat_utils._get_aten_graph_module_for_pattern = export_once
    for helper in ("_fuse_conv_bn_qat_helper", "_fold_conv_bn_qat_helper"):
        if hasattr(qat_utils, helper):  # looked up by name by _fuse/_fold_conv_bn_qat
            setattr(qat_utils, helper, only_for_convolutions_present(getattr(qat_utils, helper)))
