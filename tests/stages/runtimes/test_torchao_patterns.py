"""torchao's pattern graphs are exported once per pattern and process, and each use gets a copy."""
import torch

from stages.runtimes import torchao_patterns


def _pattern(scale):
    def pattern(x, w):
        return torch.nn.functional.conv2d(x, w) * scale

    return pattern


def test_a_pattern_is_exported_once_and_each_use_gets_its_own_copy():
    exports = []

    def export(pattern, example_inputs, is_cuda=False, **kwargs):
        exports.append(pattern)
        return torch.fx.symbolic_trace(torch.nn.Identity())

    export_once = torchao_patterns.cached(export)
    inputs = (torch.randn(1, 2, 4, 4), torch.randn(3, 2, 1, 1))
    first = export_once(_pattern(2.0), inputs)
    again = export_once(_pattern(2.0), (torch.zeros(1, 2, 4, 4), torch.ones(3, 2, 1, 1)))
    assert len(exports) == 1 and first is not again  # same code, closure, shapes: one export
    export_once(_pattern(3.0), inputs)  # another value closed over
    export_once(_pattern(2.0), (torch.randn(1, 2, 5, 5), inputs[1]))  # another shape
    export_once(_pattern(2.0), inputs, is_cuda=True)
    export_once(_pattern(2.0), inputs, scale=torch.ones(3))
    assert len(exports) == 5
    unhashable = {"a": 1}
    export_once(lambda x, w: (x, unhashable), inputs)  # closes over a dict: never cached
    export_once(lambda x, w: (x, unhashable), inputs)
    assert len(exports) == 7


def test_the_cache_is_installed_where_torchao_looks_the_function_up():
    from stages.runtimes.pt2e import _pt2e

    _pt2e()
    from torchao.quantization.pt2e import qat_utils, utils

    assert utils._get_aten_graph_module_for_pattern is qat_utils._get_aten_graph_module_for_pattern
    assert hasattr(utils._get_aten_graph_module_for_pattern, "__wrapped__")
    assert hasattr(qat_utils._fuse_conv_bn_qat_helper, "__wrapped__")
    assert hasattr(qat_utils._fold_conv_bn_qat_helper, "__wrapped__")


def test_conv_bn_rewrites_run_only_for_convolutions_the_graph_has():
    rewritten = []

    def rewrite(m, conv_fn, example_inputs, is_cuda=False):
        rewritten.append(conv_fn.__name__)
        return m

    where_present = torchao_patterns.only_for_convolutions_present(rewrite)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2)).eval()
    graph = torch.export.export(model, (torch.randn(1, 1, 6, 6),)).module()
    functional = torch.nn.functional
    for conv_fn in (functional.conv1d, functional.conv2d, functional.conv_transpose1d,
                    functional.conv_transpose2d):
        assert where_present(graph, conv_fn, (), is_cuda=False) is graph
    assert rewritten == ["conv2d"]
