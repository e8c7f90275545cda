"""Predict with an exported model: python predict.py IMAGE_OR_FOLDER... [--top-k K]

Prints the most probable class of each image (the K most probable with --top-k), as `pipeline
predict` does. Needs openvino, numpy and Pillow; predict_loop.py (the loop `pipeline predict`
runs), preprocess.py and preprocessing.json beside this file say how an image becomes the
model's input.
"""
import sys
from pathlib import Path

import openvino
import predict_loop
import preprocess

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    args = predict_loop.arguments(__doc__, HERE)  # before the model loads: --help, sha256
    core = openvino.Core()
    # f32: on CPUs with bf16 units OpenVINO would otherwise run float layers in bf16.
    compiled = core.compile_model(core.read_model(str(HERE / "model.xml")), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    sys.exit(predict_loop.main(args,
                               preprocess.read_spec(HERE / "preprocessing.json"),
                               lambda batch: compiled(batch)[0]))
