"""What the runtimes share within one quantize stage (stages/runtimes/context.py)."""
import torch

from stages.runtimes.context import QuantContext


def test_each_float_variant_s_held_out_logits_are_computed_once_per_stage():
    """torch-dynamic, torch-static and amp-compiled are all scored against the float model's
    logits: at 224x224 each pass over the held-out images took 11 to 15 s on 2 cores."""
    ctx = QuantContext(run=None, config=None, splits=None, spec={}, folder=None, scratch=None,
                       source="amp", threads=1)
    ctx._val = (torch.randn(6, 1, 4, 4), torch.tensor([0, 1, 0, 1, 1, 0]))
    calls = []

    def logits(scale):
        def predict(images):
            calls.append(scale)
            return torch.stack([images.mean((1, 2, 3)), -images.mean((1, 2, 3))], 1) * scale
        return predict

    first = ctx.reference(logits(1.0), "amp")
    again = ctx.reference(logits(1.0), "amp")
    other = ctx.reference(logits(-1.0), "openvino-fp32")
    assert calls == [1.0, -1.0]
    assert again is first and torch.equal(other["logits"], -first["logits"])
    assert first["accuracy"] + other["accuracy"] == 1.0  # the other sign flips every prediction


def test_quantize_times_its_candidates_with_the_reports_thread_count(fresh_tiny_run,
                                                                     monkeypatch):
    """--auto ranks candidates by their timings: with torch's default count (physical cores)
    where the report runs one thread per usable CPU, it ranked them at another count."""
    from pipeline.config import QuantizeConfig
    from stages.runtimes import context as context_module

    before = torch.get_num_threads()
    monkeypatch.setattr(context_module, "inference_threads", lambda: before + 2)
    config = QuantizeConfig(methods="torch-static", calibration_samples=16, quiet=True)
    with context_module.context(fresh_tiny_run, config, "quantize") as ctx:
        assert ctx.threads == torch.get_num_threads() == before + 2
    assert torch.get_num_threads() == before
