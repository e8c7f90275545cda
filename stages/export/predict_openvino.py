"""Predict with an exported model: python predict.py IMAGE_OR_FOLDER...

Prints the most probable class of each image, as `pipeline predict` does. Needs openvino, numpy
and Pillow; preprocess.py and preprocessing.json beside this file say how an image becomes the
model's input.
"""
import sys
from pathlib import Path

import openvino
import preprocess

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    core = openvino.Core()
    # f32: on CPUs with bf16 units OpenVINO would otherwise run float layers in bf16.
    compiled = core.compile_model(core.read_model(str(HERE / "model.xml")), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    sys.exit(preprocess.main(sys.argv[1:] or sys.exit(__doc__),
                             preprocess.read_spec(HERE / "preprocessing.json"),
                             lambda batch: compiled(batch)[0]))
