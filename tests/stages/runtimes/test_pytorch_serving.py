"""How each PyTorch variant is served, decided in one place (runtimes/pytorch.serving) for the
loader, the GPU rows and export: which file, compiled or eager, under which autocast."""
import torch

from stages import runtimes
from stages.runtimes.pytorch import Serving, serve, serving


class _Entries:
    """A run reduced to its manifest entries: all serving reads."""

    def __init__(self, entries: dict) -> None:
        self.entries = entries

    def entry(self, name: str) -> dict:
        return self.entries[name]


def test_each_variant_is_served_as_its_entry_says():
    run = _Entries({"fp32": {"training": {"precision": "fp32"}},
                    "amp": {"training": {"precision": "fp16"}},
                    "fp32-compiled": {"parent": "amp"}, "torch-static": {}, "torch-qat": {}})
    assert serving(run, "fp32") == Serving("fp32", graph=False, compiled=False, autocast=None)
    assert serving(run, "amp") == Serving("amp", graph=False, compiled=False, autocast="fp16")
    assert serving(run, "fp32-compiled") == Serving("amp", graph=False, compiled=True,
                                                     autocast=None)
    for name in ("torch-static", "torch-qat"):
        assert serving(run, name) == Serving(name, graph=True, compiled=True, autocast=None)
    # amp trained in fp32 (no bf16 or fp16 on the machine), or an entry from before the
    # training record: eager fp32, no autocast.
    for training in ({"precision": "fp32"}, None):
        assert serving(_Entries({"amp": {"training": training}}), "amp").autocast is None
    # Served in the layout it trained in; NCHW where the record does not say channels_last.
    trained = {"precision": "bf16", "memory_format": "channels_last"}
    assert serving(_Entries({"amp": {"training": trained}}), "amp").channels_last
    assert not serving(_Entries({"amp": {"training": trained | {"memory_format": "NCHW"}}}),
                       "amp").channels_last
    assert not serving(run, "amp").channels_last


def test_the_words_say_how_it_runs_on_each_device():
    amp = Serving("amp", graph=False, compiled=False, autocast="bf16")
    assert amp.words("cpu") == "eager PyTorch under bf16 autocast, as trained"
    assert amp.words("cuda") == "eager PyTorch on CUDA under bf16 autocast, as trained"
    assert Serving("fp32", False, False, None, channels_last=True).words("cpu") == \
        "eager PyTorch, fp32, channels_last"
    compiled = Serving("amp", graph=False, compiled=True, autocast=None)
    assert compiled.words("cpu") == "torch.compile (Inductor, freezing), fp32"
    assert compiled.words("cuda") == "torch.compile (Inductor) on CUDA, fp32"
    assert Serving("fp32", False, False, None).words("cuda") == "eager PyTorch on CUDA, fp32"
    assert Serving("torch-static", True, True, None).words("cpu") == \
        "PT2E int8, torch.compile (Inductor)"


def test_amp_is_served_under_autocast_in_its_training_precision(tiny_run):
    """tiny_run's amp trained in bf16: served, its layers compute in bf16, and the loader's
    logits are what the served model gives under that autocast."""
    run = tiny_run["run"]
    model, context, how = serve(run, "amp")
    assert how.autocast == "bf16"
    seen = []
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    last = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]  # channels > 1
    assert how.channels_last and last.weight.is_contiguous(memory_format=torch.channels_last)
    handle = first.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    spec = run.entry("amp")["model_spec"]
    images = torch.rand(4, spec["in_channels"], spec["image_size"], spec["image_size"])
    try:
        with torch.inference_mode(), context():
            served = model(images).float()
        loaded = runtimes.load(run, "amp", threads=1).predict(images)
    finally:
        handle.remove()
    assert seen == [torch.bfloat16]
    assert torch.equal(loaded, served)
    _, fp32_context, _ = serve(run, "fp32")
    with fp32_context():
        assert not torch.is_autocast_enabled("cpu")


def test_an_export_records_how_the_variant_is_served(tiny_run, tmp_path):
    """predict.py in an exported folder serves the model as the manifest says: amp under its
    bf16 autocast, not compiled, channels_last as it trained: as the report measured it."""
    import json

    from pipeline.config import ExportConfig
    from stages import export

    run = tiny_run["run"]
    out = export.run(ExportConfig(out_dir=str(tmp_path / "amp"), variant="amp", quiet=True), run)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["serving"] == {"runtime": "pytorch", "compile": False, "autocast": "bf16",
                                   "channels_last": True, "int8_passes": False,
                                   "made_for_vnni": False}
