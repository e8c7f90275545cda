"""Predict with an exported model: python predict.py IMAGE_OR_FOLDER... [--top-k K]

Prints the most probable class of each image (the K most probable with --top-k), as `pipeline
predict` does. Needs torch, numpy and Pillow (torchao for an int8 model, and a C++ compiler
for a compiled one, as manifest.json's serving says); predict_loop.py
(the loop `pipeline predict` runs), preprocess.py and preprocessing.json beside this file say
how an image becomes the model's input. model.pt2 is torch.export's format:
loading it can run code from the file, so load only a folder whose manifest.json sha256 you
have checked, from a source you trust.
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # its neighbours, also under python -I, which leaves HERE off
try:  # numpy and Pillow first: one missing is one line naming what to install
    import predict_loop
    import preprocess
except ImportError as missing:
    if missing.name in ("predict_loop", "preprocess"):
        sys.exit(f"predict.py: {missing.name}.py is missing from {HERE}; export the variant "
                 "again")
    sys.exit(f"predict.py: this model needs {missing.name}, which cannot be imported here "
             f"({missing}): pip install "
             + " ".join(json.loads((HERE / "manifest.json").read_text())["requires"]))


def logits_of(model, autocast):
    import torch

    def run(batch):
        with torch.inference_mode(), torch.autocast("cpu", dtype=autocast,
                                                    enabled=autocast is not None):
            return model(torch.from_numpy(batch)).float().numpy()

    return run


def register_int8_passes():
    """torchao's Inductor passes, without which an int8 graph compiles to float convolutions
    between quantize and dequantize steps instead of oneDNN's int8 kernels."""
    import logging
    import warnings

    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's import notice
    # Inductor's int8 lowering copies a tensor the way it tells others not to.
    warnings.filterwarnings("ignore", message="To copy construct from a tensor",
                            category=UserWarning, module=r"torch\._inductor")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer  # noqa: F401
    except ImportError:
        print("predict.py: this int8 model needs torchao for its int8 kernels: pip install "
              "'torchao>=0.18'", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    args = predict_loop.arguments(__doc__, HERE)  # before the model loads: --help, sha256
    serving = json.loads((HERE / "manifest.json").read_text())["serving"]
    # After arguments(), which sets the environment the report timed the variant in.
    predict_loop.runtime("torch", HERE)
    import torch
    import torch._inductor.config
    import torch._inductor.lowering  # noqa: F401  registers PyTorch's quantized_decomposed ops

    if serving.get("int8_passes"):
        register_int8_passes()
    try:
        model = torch.export.load(str(HERE / "model.pt2")).module()
    except Exception as exc:  # a torch that does not read this format's version
        sys.exit(predict_loop.cannot_load("torch", "model.pt2", exc, HERE))
    if serving.get("channels_last"):  # the layout it trained and was timed in
        model = model.to(memory_format=torch.channels_last)
    if serving.get("compile"):
        import logging
        import os
        import shutil

        # Inductor builds its kernels with a C++ compiler (CXX, else g++); a slim image lacks
        # one, and Inductor's own error came as a traceback at the first batch.
        compiler = os.environ.get("CXX") or "g++"
        if not shutil.which(compiler):
            sys.exit(f"predict.py: this model runs compiled by torch.compile, which needs a C++ "
                     f"compiler, and {compiler} is not on PATH: install g++, or name one in CXX")

        # A CPU build of torch on a machine without CUDA says so at the first compile.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        torch._inductor.config.freezing = True  # weights as constants: oneDNN's int8 kernels
        # Compiled as pipeline times it (stages/runtimes/inductor.py: COMPILE_OPTIONS).
        model = torch.compile(model, dynamic=False, options={
            "cpp_wrapper": True, "cpp.enable_kernel_profile": True})
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(serving.get("autocast"))
    sys.exit(predict_loop.main(args,
                               preprocess.read_spec(HERE / "preprocessing.json"),
                               logits_of(model, autocast)))
