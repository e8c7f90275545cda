#!/usr/bin/env bash
# Cross-layer equalization, measured: a model trained on notMNIST (or any MNIST-layout data) at
# 32x32, then torch-static and ort-static made with --no-equalize and with --equalize, without
# the float-layer fallback, and each one's accuracy change on the held-out training images.
#
#   bash benchmarks/equalization.sh DATA_DIR [MODEL] [ARTIFACTS_DIR]     (from the project root)
#   (EPOCHS: train's epochs, 6 by default; METHODS: torch-static,ort-static by default;
#   PYTHON: the interpreter, .venv's by default)
set -euo pipefail
DATA_DIR=${1:?give the data folder, e.g. the notMNIST folder in the MNIST layout of torchvision}
MODEL=${2:-mnasnet0_5}
ARTIFACTS=${3:-artifacts-equalization}
PYTHON=${PYTHON:-.venv/bin/python}
METHODS=${METHODS:-torch-static,ort-static}
PIPELINE="$PYTHON -m pipeline"
$PIPELINE --artifacts-dir "$ARTIFACTS" --run "$MODEL" train --model "$MODEL" --dataset mnist \
  --data-dir "$DATA_DIR" --image-size 32 --epochs "${EPOCHS:-6}" --no-baseline \
  --no-measure-memory | tail -2
for choice in no-equalize equalize; do
  $PIPELINE --artifacts-dir "$ARTIFACTS" --run "$MODEL" --quiet quantize \
    --methods "$METHODS" --"$choice" --max-accuracy-drop 100 >/dev/null
  $PYTHON - "$ARTIFACTS/runs/$MODEL/manifest.json" "$choice" "$METHODS" <<'PY'
import json, sys
manifest = json.load(open(sys.argv[1]))
for name in sys.argv[3].split(","):
    info = manifest["artifacts"][name]["quantization"]
    chosen = info["tuning"]["chosen"]
    print(f"--{sys.argv[2]:12s} {name:13s} {chosen['label']:45s} "
          f"{-chosen['drop_points']:+.2f} points, logit MSE {chosen['logit_mse']:.2f} "
          f"on {info['tuning']['images']} held-out training images")
PY
done
