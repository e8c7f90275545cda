"""An FX graph of PyTorch operators stored as data: every node as names and numbers, every
tensor as a tensor, loadable with torch.load(weights_only=True).

Why not torch.export.save: its loader runs code from the file (sympy's parser, which
evaluates strings; an unrestricted unpickling fallback for sample inputs; plain unpickling of
opaque constants). Here loading builds the graph from an allow-list of operator namespaces
(aten, quantized_decomposed) and operator.getitem, so a file can only name operators a
model may run, never a Python function.
"""
from __future__ import annotations

import operator

from stages.run.errors import PipelineError

FORMAT = "fx-graph-1"
NAMESPACES = ("aten", "quantized_decomposed")
# Plain arithmetic on sizes (a dynamic batch dimension is a symbolic int), and tuple indexing.
PYTHON_OPERATORS = {f"operator.{name}": getattr(operator, name) for name in
                    ("getitem", "add", "sub", "mul", "floordiv", "mod", "neg", "truediv", "pow")}


def _encode(value, where: str):
    import torch
    from torch import fx

    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple":
                [_encode(v, where) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PipelineError(f"cannot store the graph: {where} has an argument of type "
                        f"{type(value).__name__}")


def _decode(value, nodes: dict):
    import torch

    if isinstance(value, dict):
        (kind, inner), = value.items()
        if kind == "node":
            return nodes[inner]
        if kind in ("list", "tuple"):
            items = [_decode(v, nodes) for v in inner]
            return items if kind == "list" else tuple(items)
        if kind in ("dtype", "memory_format", "layout"):
            found = getattr(torch, inner, None)
            if not isinstance(found, (torch.dtype, torch.memory_format, torch.layout)):
                raise PipelineError(f"unknown {kind} {inner!r} in the graph file")
            return found
        if kind == "device":
            return torch.device(inner)
        raise PipelineError(f"unknown value {kind!r} in the graph file")
    return value


def _target_name(target) -> str:
    import torch

    for name, function in PYTHON_OPERATORS.items():
        if target is function:
            return name
    if isinstance(target, torch._ops.OpOverload) and target.namespace in NAMESPACES:
        return str(target)
    raise PipelineError(f"cannot store the graph: it calls {target}, which is not an operator "
                        f"of {', '.join(NAMESPACES)}")


def _target(name: str):
    """An allow-listed operator by name; anything else in a file is refused."""
    import torch

    if name in PYTHON_OPERATORS:
        return PYTHON_OPERATORS[name]
    parts = name.split(".")
    refused = PipelineError(f"the graph file calls {name!r}, which is not an operator of "
                            f"{', '.join(NAMESPACES)}; refusing to load it")
    # Each part a plain name, none a dunder ("aten.__class__.__class__" had resolved to
    # builtins' type); aten's own start with one underscore (_native_batch_norm_legit...).
    if len(parts) != 3 or parts[0] not in NAMESPACES or any(
            not part.isidentifier() or part.startswith("__") for part in parts):
        raise refused
    try:
        found = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise PipelineError(f"the graph file calls {name!r}, which this torch does not "
                            "have") from None
    if not (isinstance(found, torch._ops.OpOverload) and found.namespace == parts[0]):
        raise refused  # an operator overload, as _target_name stored it, and nothing else
    return found


def to_data(graph_module) -> dict:
    """The graph's nodes and the tensors its get_attr nodes read. Export's own guard module
    (shape checks) is left out: it is code, and the graph runs without it."""
    nodes, tensors = [], {}
    for node in graph_module.graph.nodes:
        if node.op == "call_module":
            if node.users:
                raise PipelineError(f"cannot store the graph: it calls module {node.target}")
            continue
        record = {"op": node.op, "name": node.name}
        if node.op == "get_attr":
            record["target"] = node.target
            value = graph_module
            for part in node.target.split("."):
                value = getattr(value, part)
            tensors[node.target] = value.detach()
        elif node.op == "call_function":
            record["target"] = _target_name(node.target)
        if node.op in ("call_function", "output"):
            record["args"] = _encode(node.args, node.name)
            record["kwargs"] = {k: _encode(v, node.name) for k, v in node.kwargs.items()}
        nodes.append(record)
    return {"format": FORMAT, "nodes": nodes, "tensors": tensors}


def from_data(data: dict):
    """A GraphModule from ``to_data``'s record; checks every name before building."""
    import torch
    from torch import fx

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PipelineError("not a graph file of this version")
    # Tensors are kept under plain names of our own (t0, t1, ...): a module path such as
    # RegNet's 'block1-0' is not an attribute name.
    root, flat = torch.nn.Module(), {}
    for i, (attribute, tensor) in enumerate(data["tensors"].items()):
        if not isinstance(tensor, torch.Tensor):
            raise PipelineError(f"bad tensor {attribute!r} in the graph file")
        flat[attribute] = f"t{i}"
        root.register_buffer(flat[attribute], tensor)
    graph, built = fx.Graph(), {}
    for record in data["nodes"]:
        op = record["op"]
        if op == "placeholder":
            built[record["name"]] = graph.placeholder(record["name"])
        elif op == "get_attr":
            if record["target"] not in flat:
                raise PipelineError(f"the graph file reads {record['target']!r}, which it "
                                    "does not hold")
            built[record["name"]] = graph.get_attr(flat[record["target"]])
        elif op == "call_function":
            built[record["name"]] = graph.call_function(
                _target(record["target"]), _decode(record["args"], built),
                {k: _decode(v, built) for k, v in record["kwargs"].items()})
        elif op == "output":
            result = _decode(record["args"], built)[0]
            # export returns outputs flattened; one tensor comes back as a one-item list
            if isinstance(result, (list, tuple)) and len(result) == 1:
                result = result[0]
            graph.output(result)
        else:
            raise PipelineError(f"unknown node kind {op!r} in the graph file")
    graph.lint()
    return fx.GraphModule(root, graph)
