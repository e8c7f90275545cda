"""The one registry helper every registry uses: a duplicate name is refused where it is made."""
import pytest

from stages import runtimes
from stages.data import datasets
from stages.models import builtin
from stages.run.registry import lookup, register


def test_a_name_registered_twice_is_refused_in_every_registry(monkeypatch):
    for module, name, add in ((runtimes, "LOADERS", lambda: runtimes.loader("openvino")),
                              (datasets, "DATASETS", lambda: datasets.register_dataset("mnist")),
                              (builtin, "BUILTIN_MODELS",
                               lambda: builtin.register_model("smallcnn"))):
        monkeypatch.setattr(module, name, dict(getattr(module, name)))  # the real one stays
        with pytest.raises(RuntimeError, match="is registered twice"):
            add()(lambda *args: None)
    monkeypatch.setattr(runtimes, "VARIANTS", dict(runtimes.VARIANTS))
    with pytest.raises(RuntimeError, match="'ort-static' is registered twice"):
        runtimes.declare("ort-static", runtime="onnxruntime", source="onnx-fp32", int8=True,
                         description="a second one")


def test_lookup_names_what_is_known():
    registry = {}
    register(registry, "b")(1)
    register(registry, "a")(2)
    assert lookup(registry, "a", "thing") == 2
    with pytest.raises(ValueError, match=r"^unknown thing 'c'; known: a, b$"):
        lookup(registry, "c", "thing")
