"""Errors a user can cause. The CLI turns them into one line on stderr and an exit code."""


class PipelineError(Exception):
    """A runtime failure the user can act on (exit code 1): corrupt file, failed export, bad
    data."""

    exit_code = 1


class UsageError(PipelineError):
    """A request that cannot be served as asked (exit code 2): unknown run, missing artifact."""

    exit_code = 2


class NotMade(PipelineError):
    """A converter that cannot take this model (torch.export, the ONNX exporter, OpenVINO's
    compiler): quantize goes on without that variant and what is made from it."""


class Diverged(PipelineError):
    """QAT's fine-tuning whose loss or weights became NaN or infinite: quantize --auto goes on
    without the QAT that diverged, since the variants it already made still stand."""
