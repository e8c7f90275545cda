"""What each variant is judged against, and on which images: the reference model, and the
held-out images a variant's accuracy change is measured on, in report.json's words."""
from __future__ import annotations

from stages import runtimes
from stages.run.artifacts import Run

# What a variant's held-out accuracy was measured on, in report.json's words.
SELECTION_WORDS = "validation split and held-out training images"
VALIDATION_WORDS = "the half of the validation split qat did not choose its epoch on"
BASELINE_WORDS = "validation split"  # a model trained apart from the reference, as it was


def _fitted_model(run: Run, name: str) -> str | None:
    """The trained model whose weights ``name`` carries: itself, or the model it was made from."""
    while name is not None and not runtimes.VARIANTS[name].trained:
        name = run.entry(name).get("parent")
    return name


def _one_training(run: Run, a: str | None, b: str | None) -> bool:
    """Whether trained models ``a`` and ``b`` carry the same weights: the same model, or `amp`
    and `fp32` where `amp` trained in fp32 and `fp32` is its copy."""
    if a == b:
        return True
    fp32 = (run.entry("fp32").get("training") or {}) if {a, b} == {"fp32", "amp"} else {}
    return fp32.get("same_run_as") == "amp"


def reference_of(run: Run, names: list[str]) -> str:
    """The model every change is measured against: the trained float model the variants are
    made from, `amp`, so that a variant's change is what quantization did to it. Where `amp`
    is a copy of `fp32` the two are one model and the reference is called `fp32`; a separately
    trained fp32 baseline is a row like the others (its own training's luck would otherwise
    count against every variant: on the digits, bf16 `amp` and `fp32` trained with seed 0 to
    97.50% and 98.61% test, and with seeds 3 to 5 to within 0.3 points of each other)."""
    if "amp" in names and not ("fp32" in names and _one_training(run, "fp32", "amp")):
        return "amp"
    return "fp32" if "fp32" in names else names[0]


def judged_images(run: Run, name: str, reference: str) -> str:
    """What ``name`` is judged against the reference on, in report.json's words. Where its
    weights come from the reference's training (the same images, epochs and precision),
    training images measure what quantization changed, and serve. A model fine-tuned further
    (torch-qat, and ort-qat and openvino-qat made from it) fits them differently, so there they
    would measure memorisation: on mnasnet0_5 the float model scored 96.2% on 925 selection
    images (88.2% on its 144 validation ones) and torch-qat 2.3 points less, though level on
    validation; it is judged on the half of the validation split it did not choose its epoch
    on. So is a model trained apart (the fp32 baseline beside a bf16 `amp`), on the whole
    validation split, on which both chose their epoch alike."""
    fitted, reference_fitted = _fitted_model(run, name), _fitted_model(run, reference)
    if _one_training(run, fitted, reference_fitted):
        return SELECTION_WORDS
    return BASELINE_WORDS if fitted in ("fp32", "amp") else VALIDATION_WORDS
