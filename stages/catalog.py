"""What the registries hold, for `pipeline list` (as timm's list_models): the models --model
can name, the data sets --dataset can, and the variants quantize, qat and report know."""
from __future__ import annotations

REGISTRIES = ("models", "datasets", "variants")


def listing(*asked: str) -> list[str]:
    """One line per entry of each registry asked for (all of them by default), under a
    heading where there is more than one."""
    asked = list(dict.fromkeys(asked)) or list(REGISTRIES)
    lines: list[str] = []
    for name in asked:
        if len(asked) > 1:
            lines += ([""] if lines else []) + [f"{name}:"]
        lines += {"models": _models, "datasets": _datasets, "variants": _variants}[name]()
    return lines


def _models() -> list[str]:
    from stages.models.build import torchvision_models
    from stages.models.builtin import BUILTIN_MODELS

    builtin = [f"{name}  (built-in: {_first_line(entry)})" for name, entry in
               BUILTIN_MODELS.items()]
    return builtin + [f"{name}  (torchvision)" for name in torchvision_models()] + [
        "timm:NAME  (any of timm's models, where timm is installed)",
        "package.module:factory  (your own: a function that takes num_classes)"]


def _datasets() -> list[str]:
    from stages.data.datasets import DATASETS

    return [f"{name}  ({_first_line(entry)})" if entry.__doc__ else name
            for name, entry in DATASETS.items()]


def _variants() -> list[str]:
    from stages.runtimes import VARIANTS

    width = max(map(len, VARIANTS))
    made_by = {"train": "train/import", "quantize": "quantize", "qat": "qat"}
    return [f"{v.name:<{width}}  {v.runtime:<11}  {'int8' if v.int8 else 'float':<5}  "
            f"{made_by[v.stage]:<12}  {v.description}" for v in VARIANTS.values()]


def _first_line(entry) -> str:
    """The first sentence of an entry's docstring, without a parenthesis it leaves open."""
    text = " ".join((entry.__doc__ or "").split()).split(". ")[0].rstrip(".")
    opened = text.rfind("(")
    return text[:opened].rstrip() if opened > text.rfind(")") else text
