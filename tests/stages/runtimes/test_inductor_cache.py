"""The C++ wrapper Inductor generates is the same source in every process, so that its on-disk
cache finds the library built from it instead of running g++ again (stages/runtimes/inductor.py:
_stable_wrapper_source)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# A float convolution and an int8 one: constants (weights, packed weights, scales) and the
# extern kernels whose size checks would name Python objects by address.
COMPILE = """
import hashlib, sys, torch
from stages.runtimes import inductor, pt2e

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 3)).eval()
images = torch.randn(8, 1, 8, 8)
int8 = pt2e.quantize_pt2e(model, {'in_channels': 1, 'image_size': 8}, pt2e.pt2e_options(),
                          [images])
for module in (model, int8):
    code = inductor._generated_code(inductor.compile_module(module), images[:2])
    print(hashlib.sha256(code.encode()).hexdigest())
"""


@pytest.mark.slow
def test_the_generated_wrapper_is_the_same_source_in_a_second_process():
    # Two processes at once: each compiles on one core most of the time (Python, then g++).
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out.split())
    assert len(outputs[0]) == 2 and all(len(digest) == 64 for digest in outputs[0])
    assert outputs[0] == outputs[1]
