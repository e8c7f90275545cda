"""A graph stored as data: what it may call, and that it comes back the same."""
import pytest
import torch

from stages.run.errors import PipelineError
from stages.runtimes import graph_file


class _Reshaping(torch.nn.Module):
    """Arithmetic on the batch size (as ViT's reshape does) and a module name that is no
    Python identifier (as RegNet's 'block1-0')."""

    def __init__(self):
        super().__init__()
        block = torch.nn.Module()
        block.add_module("proj", torch.nn.Linear(16, 4))
        self.blocks = torch.nn.ModuleDict({"block1-0": block})

    def forward(self, x):
        n = x.shape[0]
        return self.blocks["block1-0"].proj(x.reshape(n * 2, 16)).reshape(n, 8)


def _exported():
    model = _Reshaping().eval()
    program = torch.export.export(model, (torch.randn(3, 32),), strict=True, dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1)},))
    return model, program.module()


def test_a_graph_round_trips_with_symbolic_sizes_and_odd_module_names():
    model, exported = _exported()
    data = graph_file.to_data(exported)
    targets = {n["target"] for n in data["nodes"] if n["op"] == "call_function"}
    assert "operator.mul" in targets and "aten.linear.default" in targets
    assert any("block1-0" in name for name in data["tensors"])
    rebuilt = graph_file.from_data(data)
    for batch in (1, 5):
        x = torch.randn(batch, 32)
        assert torch.equal(rebuilt(x), model(x))


@pytest.mark.parametrize("target, message", [
    ("builtins.exec", "not an operator of aten, quantized_decomposed"),
    ("aten.no_such_operator.default", "which this torch does not have"),
    ("operator.attrgetter", "not an operator of"),
    # Names that resolve through torch.ops to what is not an operator: builtins' type, a dict.
    ("aten.__class__.__class__", "not an operator of"),
    ("aten.__dict__.get", "not an operator of"),
    ("aten.add.overloads", "not an operator of"),
])
def test_a_graph_that_calls_anything_else_is_refused(target, message):
    _, exported = _exported()
    data = graph_file.to_data(exported)
    next(n for n in data["nodes"] if n["op"] == "call_function")["target"] = target
    with pytest.raises(PipelineError, match=message):
        graph_file.from_data(data)


def test_a_graph_that_calls_a_python_function_cannot_be_stored():
    for function in (print, torch.sigmoid):  # a Python function; a torch function, not an op
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(function, (x,)))
        module = torch.fx.GraphModule(torch.nn.Module(), graph)
        with pytest.raises(PipelineError, match="cannot store the graph: it calls"):
            graph_file.to_data(module)


def test_aten_operators_named_with_an_underscore_load():
    """aten's own private operators are in the graphs PT2E writes (a BatchNorm not folded into
    a convolution is _native_batch_norm_legit_no_training): refusing names that start with an
    underscore refused those runs' files as if tampered with."""
    for name in ("aten._native_batch_norm_legit_no_training.default", "aten._to_copy.default"):
        assert isinstance(graph_file._target(name), torch._ops.OpOverload), name
