"""Predict: image files, or folders of them, as one line each with the most probable classes.

The one loop behind `pipeline predict` (`run`) and an exported folder's `python predict.py
IMAGE_OR_FOLDER...` (`arguments`, `main`): `pipeline export` copies this file into the folder
as predict_loop.py, beside preprocess.py, so both print the same lines, name the same skipped
files and end with the same counts. At module level it needs numpy alone, and
stages/data/preprocess.py (numpy and Pillow) for the images; what it needs of the project is
imported inside `run`, which an exported folder never calls.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

BATCH_SIZE = 64  # an exported predict.py's --batch-size, as `pipeline predict`'s

if __package__:  # stages.predict, in the project
    from stages.data.preprocess import decode, to_input
else:  # predict_loop.py in an exported folder, beside that folder's preprocess.py
    from preprocess import decode, to_input


def run(config, run) -> None:
    """`pipeline predict`: one line per file of config.paths on stdout (a JSON object each with
    config.json), with config.variant of the run. A folder with no files is refused before the
    model loads (exit 2); a file that could not be predicted is named on stderr and, once every
    other file is done, fails the command with the counts (exit 1)."""
    import torch

    from stages import runtimes
    from stages.data.datasets import preprocessing_of_run
    from stages.measure.machine import inference_threads
    from stages.run.errors import PipelineError

    files = files_to_predict(config.paths)
    name = runtimes.resolve(run, config.variant)
    spec = preprocessing_of_run(run)
    loaded = runtimes.load(run, name, inference_threads(config.threads))
    skipped = print_predictions(files, spec,
                                lambda batch: loaded.predict(torch.from_numpy(batch)).numpy(),
                                config.batch_size, config.top_k, "pipeline",
                                name if config.json else None)
    if skipped:
        raise PipelineError(skipped_summary(skipped, len(files)))


def files_to_predict(paths) -> list[Path]:
    """image_files' files; a folder with none is refused."""
    from stages.run.errors import UsageError

    files, empty = image_files(paths)
    if empty:
        raise UsageError(f"{', '.join(map(printable, empty))}: no files in this folder")
    return files


def image_files(paths) -> tuple[list[Path], list[Path]]:
    """(files, empty folders): paths given as they are, and everything in a folder that is
    not a folder itself, whatever its name: Pillow knows an image by its content (a .gif, a
    file with no extension), and what it cannot read is named as skipped, never dropped.
    Hidden files and folders (.DS_Store, .git/) are left out of a folder, as ls leaves them.
    Links to folders are followed, each folder once; a folder that cannot be listed is
    returned among the files, so that it is named as skipped with why (read_image)."""
    files, empty = [], []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(_folder_files(path, set()))
            files += found
            if not found:
                empty.append(path)
        else:
            files.append(path)
    return files, empty


def _folder_files(folder: Path, seen: set) -> list[Path]:
    real = folder.resolve()
    if real in seen:  # a link back up the tree
        return []
    seen.add(real)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return [folder]
    found = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            folder_inside = entry.is_dir()
        except OSError:  # a folder listed but not entered: named as skipped, with why
            folder_inside = False
        found += _folder_files(entry, seen) if folder_inside else [entry]
    return found


def path_problem(path) -> str | None:
    """Why ``path`` cannot be opened (Path.exists raises where a name is too long or a folder
    cannot be entered), or None."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "no such file or folder"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def printable(text) -> str:
    """``text`` with control characters escaped: a class or file name holding a newline must
    not print a line of its own that reads as another image's result."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def result_line(path, result) -> str:
    """One image's line of text output: its path and its most probable classes."""
    return f"{printable(path)}: " + ", ".join(f"{printable(name)} ({p:.3f})"
                                              for name, p in result)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _decoded(paths, spec: dict) -> tuple[list, list, list]:
    """(paths decoded, their pixels, (path, why) of those that could not be)."""
    ready, pixels, failed = [], [], []
    for path in paths:
        try:
            pixels.append(decode(path, spec))
            ready.append(path)
        except Exception as exc:  # Pillow raises many kinds for a file it cannot read
            failed.append((path, " ".join(str(exc).split()) or type(exc).__name__))
    return ready, pixels, failed


def predict_files(files, spec: dict, logits_of, batch_size: int = 64, top_k: int = 1):
    """For each file, batch by batch (within one, the files skipped first): (path, [(class,
    probability), ...] most probable first), or (path, why) for a file that is not a readable
    image, which is skipped. ``logits_of`` takes a batch
    (N, C, H, W) of preprocessed images and returns logits (N, classes). The next batch is
    decoded in a thread while the model runs on this one (Pillow decodes without the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    top_k = min(top_k, len(spec["classes"]))
    batches = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(_decoded, batches[0], spec) if batches else None
        for index in range(len(batches)):
            ready, pixels, failed = pending.result()
            if index + 1 < len(batches):
                pending = pool.submit(_decoded, batches[index + 1], spec)
            yield from failed
            if not pixels:
                continue
            logits = logits_of(to_input(np.stack(pixels), spec))
            probabilities = softmax(np.asarray(logits, dtype=np.float64))
            for path, row in zip(ready, probabilities):
                # Ties go to the lower class index, as argmax's (int8 outputs tie often).
                best = np.argsort(-row, kind="stable")[:top_k]
                yield path, [(spec["classes"][i], float(row[i])) for i in best]


def print_predictions(files, spec: dict, logits_of, batch_size: int, top_k: int, prog: str,
                      variant: str | None = None) -> int:
    """One line per image on stdout (a JSON object each where ``variant`` is given), each file
    that could not be predicted named on stderr with why; returns how many were skipped."""
    skipped = 0
    try:
        for path, result in predict_files(files, spec, logits_of, batch_size, top_k):
            if isinstance(result, str):
                print(f"{prog}: skipped {printable(path)}: {result}", file=sys.stderr,
                      flush=True)
                skipped += 1
            elif variant is not None:
                print(json.dumps({"path": str(path), "variant": variant, "top": [
                    {"class": name, "probability": p} for name, p in result]}), flush=True)
            else:
                print(result_line(path, result), flush=True)
    except BrokenPipeError:  # the reader left (`| head`): stop predicting, and say nothing
        # stdout onto /dev/null, so that the interpreter's last flush finds no closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return skipped


def skipped_summary(skipped: int, total: int) -> str:
    return (f"{skipped} of {total} file(s) could not be predicted and were skipped (named "
            "above)")


def arguments(doc: str, folder: Path):
    """An exported folder's command line: predict.py IMAGE_OR_FOLDER... [--top-k K]; then the
    folder's files checked against its manifest.json before the model is loaded (exit 1)."""
    import argparse

    # The whole docstring: what the script needs, and for a torch model that loading its file
    # can run code (its second paragraph), belong in --help.
    parser = argparse.ArgumentParser(prog="predict.py", description=doc.strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="IMAGE_OR_FOLDER")
    parser.add_argument("--top-k", type=int, default=1, help="classes printed per image")
    # pipeline predict's default (PredictConfig's): a bf16 model's near ties may round another
    # way in another batch, and both should print the same lines
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                        help=f"images predicted together (default: {BATCH_SIZE})")
    args = parser.parse_args()
    if args.top_k < 1 or args.batch_size < 1:
        parser.error("--top-k and --batch-size take a whole number of at least 1")
    problem = verify_folder(folder)
    if problem:
        print(f"predict.py: {problem}", file=sys.stderr)
        sys.exit(1)
    # As the report found the variant fastest (a oneDNN cap below AMX, say), unless the user
    # set it: before the runtime is imported, since oneDNN reads it once per process.
    import json
    import os

    serving = json.loads((folder / "manifest.json").read_text())["serving"]
    for name, value in serving.get("environment", {}).items():
        os.environ.setdefault(name, value)
    warning = vnni_warning(serving, _cpu_flags())
    if warning:
        print(f"predict.py: warning: {warning}", file=sys.stderr)
    return args


def runtime(module: str, folder: Path):
    """``module`` (onnxruntime, openvino, torch) imported for an exported folder's predict.py,
    or one line naming what to install and exit 1, rather than an import's traceback."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        requires = json.loads((folder / "manifest.json").read_text()).get("requires", [module])
        print(f"predict.py: this model needs {module}, which cannot be imported here "
              f"({exc}): pip install {' '.join(requires)}", file=sys.stderr)
        sys.exit(1)


def cannot_load(module: str, file: str, exc: Exception, folder: Path) -> str:
    """The line an exported predict.py ends with where its runtime cannot load the model file
    (a runtime older than the model's format, most often): this version and the one that made
    it, rather than the runtime's traceback."""
    made = json.loads((folder / "manifest.json").read_text()).get("versions", {}).get(module)
    # (the module's own: an install may lack its metadata; OpenVINO's carries a build suffix)
    here = str(getattr(sys.modules.get(module), "__version__", "(version unknown)")).split("-")[0]
    why = " ".join(str(exc).split())[:300] or type(exc).__name__
    fix = (f"it was made with {module} {made}: pip install '{module}=={made.split('+')[0]}'"
           if made else "export it again from a run made with this version")
    return f"predict.py: {module} {here} cannot load {file} ({why}); {fix}"


VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}  # as stages/measure/machine.py reads them


def vnni_warning(serving: dict, flags: set[str]) -> str | None:
    """Why a model quantized for VNNI may predict wrongly on a CPU with ``flags`` (as
    runtimes.vnni_mismatch says in the project); None where it fits, or the flags are unknown."""
    if not (serving.get("made_for_vnni") and flags) or VNNI_FLAGS & flags:
        return None
    return ("this model was quantized on a CPU with VNNI (full 8-bit weights) and this one has "
            "none, where int8 products can saturate and the predictions drift; export it from "
            "a run quantized on a CPU like this one")


def _cpu_flags() -> set[str]:
    """This CPU's flags from /proc/cpuinfo; empty where there is none to read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def verify_folder(folder: Path) -> str | None:
    """Why an exported folder's files are not those its manifest.json lists (a file changed,
    truncated or missing), or None when every sha256 matches."""
    import hashlib

    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
        for name, record in files.items():
            digest = hashlib.sha256()
            with open(folder / Path(name).name, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
            if digest.hexdigest() != record["sha256"]:
                return (f"{name} does not match its sha256 in manifest.json (changed or "
                        "truncated since export); export the variant again")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return (f"manifest.json or a file it lists cannot be read ({type(exc).__name__}: "
                f"{exc}); export the variant again")
    return None


def main(args, spec: dict, logits_of) -> int:
    """What an exported folder's `python predict.py IMAGE_OR_FOLDER...` does: `run`'s lines and
    refusals, as an exit status: 1 if any file was skipped, 2 for a path that does not exist
    or a folder with no files."""
    problems = [(path, why) for path in args.paths if (why := path_problem(path))]
    if problems:
        print("predict.py: " + "; ".join(f"{printable(path)}: {why}" for path, why in problems),
              file=sys.stderr)
        return 2
    files, empty = image_files(args.paths)
    if empty:
        print(f"predict.py: {', '.join(map(printable, empty))}: no files in this folder",
              file=sys.stderr)
        return 2
    skipped = print_predictions(files, spec, logits_of, args.batch_size, args.top_k, "predict.py")
    if skipped:
        print(f"predict.py: {skipped_summary(skipped, len(files))}", file=sys.stderr)
    return 1 if skipped else 0
