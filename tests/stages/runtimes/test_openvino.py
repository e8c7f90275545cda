import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Two OpenVINO variants loaded, then freed in the order they were loaded, then a signal: each
# OpenVINO Core had given the main thread an alternate signal stack of its own and put back
# the one it found when freed, so this order left it pointing at freed memory and the signal
# (Ctrl-C, torchrun's SIGTERM) ended the process with SIGSEGV instead of its handler.
SCRIPT = """
import gc, signal, sys
from stages import runtimes
from stages.run import artifacts

run = artifacts.open_run(sys.argv[1], sys.argv[2])
first = runtimes.load(run, "openvino-fp32", threads=1)
second = runtimes.load(run, "openvino-int8", threads=1)
del first
gc.collect()
del second
gc.collect()
signal.signal(signal.SIGTERM, lambda *args: sys.exit(7))
signal.raise_signal(signal.SIGTERM)
"""


def test_a_signal_after_openvino_models_are_freed_reaches_its_handler(tiny_run):
    run = tiny_run["run"]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(run.artifacts_dir), run.name],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 7, (done.returncode, done.stderr[-2000:])
