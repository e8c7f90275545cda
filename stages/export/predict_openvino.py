"""Predict with an exported model: python predict.py IMAGE_OR_FOLDER... [--top-k K]

Prints the most probable class of each image (the K most probable with --top-k), as `pipeline
predict` does. Needs openvino, numpy and Pillow; predict_loop.py (the loop `pipeline predict`
runs), preprocess.py and preprocessing.json beside this file say how an image becomes the
model's input.
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

if __name__ == "__main__":
    args = predict_loop.arguments(__doc__, HERE)  # before the model loads: --help, sha256
    serving = json.loads((HERE / "manifest.json").read_text())["serving"]
    # After arguments(): it sets the environment the report timed.
    openvino = predict_loop.runtime("openvino", HERE)

    core = openvino.Core()
    # As the report timed it: f32 unless the variant is openvino-bf16 (on CPUs with bf16
    # units OpenVINO would otherwise run float layers in bf16).
    try:
        compiled = core.compile_model(core.read_model(str(HERE / "model.xml")), "CPU", {
            "INFERENCE_PRECISION_HINT": serving.get("precision_hint", "f32")})
    except Exception as exc:  # OpenVINO raises RuntimeError for an IR it cannot read
        sys.exit(predict_loop.cannot_load("openvino", "model.xml", exc, HERE))
    sys.exit(predict_loop.main(args,
                               preprocess.read_spec(HERE / "preprocessing.json"),
                               lambda batch: compiled(batch)[0]))
