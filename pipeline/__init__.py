"""How you drive the pipeline: a chained Click CLI over the stages in `stages/`, and `load` to
use what it made from Python. Importing this package imports no torch; `load` does."""


def load(run=None, variant: str = "recommended", **options):
    """A variant of a run, ready to predict: `pipeline.load("artifacts/runs/NAME")`.

    See pipeline.api for what it takes and returns."""
    from pipeline.api import load as load_variant

    return load_variant(run, variant, **options)
