"""Export: a variant as a folder that runs without this project.

    model.onnx / model.xml+model.bin / model.pt2   the model, in its runtime's own format
    preprocessing.json     input size, channels, colour, mean and std, resizing, class names
    preprocess.py          how an image becomes the input (numpy and Pillow only), the same code
                           `pipeline predict` runs
    predict_loop.py        stages/predict.py: files and folders to one line each, the same loop
                           `pipeline predict` runs
    predict.py             `python predict.py IMAGE...`: the top class of each image, with the
                           runtime alone (onnxruntime, openvino, or torch)
    manifest.json          the variant, how it is served, and the sha256 of every other file

PyTorch variants are saved with torch.export (`model.pt2`), whose loader can run code from the
file: the export says so, and so does predict.py. The folder is written beside OUT_DIR and
renamed into place, so an interrupted export leaves no half folder under that name.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from stages import predict, runtimes
from stages.data import preprocess
from stages.data.datasets import preprocessing_of_run
from stages.report.recommendation import cap_that_pays
from stages.run.artifacts import Run, versions
from stages.run.errors import PipelineError, UsageError
from stages.run.files import fsync_folder, sha256_file
from stages.run.progress import say
from stages.run.trained import float_source
from stages.runtimes.openvino import precision_hint

TEMPLATES = {"onnxruntime": "predict_onnxruntime.py", "openvino": "predict_openvino.py",
             "pytorch": "predict_torch.py"}
REQUIRES = {"onnxruntime": ["onnxruntime", "numpy", "pillow"],
            "openvino": ["openvino", "numpy", "pillow"], "pytorch": ["torch", "numpy", "pillow"]}
CODE_WARNING = ("model.pt2 is torch.export's format, whose loader can run code from the file: "
                "load it only from a source you trust, after checking manifest.json's sha256")


def _copy_listed(name: str, source: Path, target: Path, record: dict | None) -> None:
    """``source`` copied to ``target``, and the copy checked against the run manifest's
    ``record`` of it: export takes no lock, and a quantize making the variant again meanwhile
    could pair a new model.bin with the old model.xml, which the exported manifest would then
    hash as one."""
    shutil.copyfile(source, target)
    if record is not None and sha256_file(target) != record["sha256"]:
        raise PipelineError(f"{name}: {source} changed while it was exported (made again by "
                            "another quantize?); export it again once that is done")


def _copy_onnx(run: Run, name: str, folder: Path) -> None:
    from stages.runtimes.onnx_export import external_data_files

    source, entry = run.verified_path(name), run.entry(name)
    _copy_listed(name, source, folder / "model.onnx", entry)
    listed = {Path(record["path"]).name: record for record in entry.get("files", [])}
    for data in external_data_files(source):  # keep the names the model refers to
        _copy_listed(name, data, folder / data.name, listed.get(data.name))


def _copy_openvino(run: Run, name: str, folder: Path) -> None:
    source, entry = run.verified_path(name), run.entry(name)
    _copy_listed(name, source, folder / "model.xml", entry)
    _copy_listed(name, source.with_suffix(".bin"), folder / "model.bin", entry["files"][0])


def _save_torch(run: Run, name: str, folder: Path) -> dict:
    """The variant as an ExportedProgram with a dynamic batch axis; what predict.py needs to
    serve it as the report measured it (compiled, or under autocast)."""
    import torch

    from stages.runtimes.pytorch import serving

    how = serving(run, name)
    spec = run.entry(float_source(run))["model_spec"]
    example = torch.zeros(2, spec["in_channels"], spec["image_size"], spec["image_size"])
    program = torch.export.export(how.load(run), (example,), strict=False, dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1)},))
    torch.export.save(program, str(folder / "model.pt2"))
    # An int8 graph compiles to oneDNN's int8 kernels only with torchao's Inductor passes
    # registered; without them the exported folder ran float convolutions between quantize and
    # dequantize steps, which is not what the report timed.
    return {"compile": how.compiled, "autocast": how.autocast,
            "channels_last": how.channels_last, "int8_passes": how.graph}


def _environment(run: Run, name: str) -> dict:
    """The oneDNN cap under which the run's report timed the variant faster than with AMX, at
    its verdict's batch size, for predict.py to set before its runtime loads (oneDNN reads it
    once per process); nothing where there is no such finding."""
    if "report/report.json" not in run.artifacts():
        return {}
    report = json.loads(run.verified_path("report/report.json").read_text())
    row = next((r for r in report["models"] if r["name"] == name), None)
    cap = row and cap_that_pays(row, str(report["verdict"]["batch_size"]))
    return {"environment": {"ONEDNN_MAX_CPU_ISA": cap}} if cap else {}


def check_out_dir(out_dir: Path) -> None:
    """Refuse an OUT_DIR that holds anything: an export never writes over a user's files. One
    that holds only what a killed export left (its hidden scratch folder) says so: `ls` shows
    nothing there."""
    if not out_dir.exists():
        return
    entries = list(out_dir.iterdir()) if out_dir.is_dir() else [out_dir]
    if entries and all(_scratch_left(entry) for entry in entries):
        raise UsageError(f"{out_dir} holds only {', '.join(e.name for e in entries)}, left by an "
                         "export that did not finish; remove it and export again")
    if entries:
        raise UsageError(f"{out_dir} already exists and is not an empty folder; give a new "
                         "OUT_DIR (export writes a folder of its own)")


def _scratch_left(entry: Path) -> bool:
    """A folder run() made (``.OUT_DIR.XXXXXXXX``, holding `export` or nothing) and could not
    remove: killed before it ended."""
    try:
        return (re.fullmatch(r"\..*\.[a-z0-9_]{8}", entry.name) is not None
                and entry.is_dir() and not entry.is_symlink()
                and {p.name for p in entry.iterdir()} <= {"export"})
    except OSError:
        return False


def _make_parents(out_dir: Path) -> list[Path]:
    """OUT_DIR's missing parent folders, made; returns those it made, the outermost first, for
    a failed export to remove."""
    missing = [p for p in reversed(out_dir.parents) if not p.exists()]
    try:
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            _remove_made(missing)  # those made before the one refused
            raise
    except (FileExistsError, NotADirectoryError) as exc:
        blocking = next((p for p in out_dir.parents if p.exists() and not p.is_dir()),
                        exc.filename)
        raise UsageError(f"cannot create {out_dir}: {blocking} is a file, not a folder; give "
                         "another OUT_DIR") from None
    except OSError as exc:
        raise UsageError(f"cannot create {out_dir}: {exc.filename} ({exc.strerror}); give an "
                         "OUT_DIR whose parent folders you can make") from None
    return missing


def _remove_made(folders: list[Path]) -> None:
    for folder in reversed(folders):  # the innermost first, each only while it is empty
        try:
            folder.rmdir()
        except FileNotFoundError:  # never made: mkdir stopped before it
            continue
        except OSError:
            return


def _manifest(folder: Path, name: str, run_name: str, serving: dict) -> dict:
    """The exported folder's manifest.json: what it serves, what it needs, every file's sha256,
    and the versions that made it (a model.pt2 loads only in a torch that reads its format)."""
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(folder.iterdir())}
    requires = REQUIRES[serving["runtime"]] + (["torchao"] if serving.get("int8_passes") else [])
    return {"variant": name, "run": run_name, "serving": serving, "requires": requires,
            "files": files,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {k: v for k, v in versions().items()
                         if k in ("pipeline", "python", *requires)}}


def _move_into_place(folder: Path, out_dir: Path, in_place: bool) -> None:
    """The finished ``folder`` on disk, then at ``out_dir``: renamed there whole, or its files
    moved into the empty folder given, manifest.json last (predict.py refuses a folder without
    it)."""
    fsync_folder(folder)
    if in_place:
        for path in sorted(folder.iterdir(), key=lambda p: p.name == "manifest.json"):
            os.replace(path, out_dir / path.name)
        fsync_folder(out_dir, files=False)
    else:
        folder.rename(out_dir)
        fsync_folder(out_dir.parent, files=False)


def run(config, run: Run) -> Path:
    """Write the folder for config.variant (a name or "recommended") at config.out_dir."""
    out_dir = Path(config.out_dir).expanduser()
    check_out_dir(out_dir)
    if out_dir.is_symlink():  # a link to an empty folder: the folder is written where it points
        try:
            out_dir = out_dir.resolve()
        except (OSError, RuntimeError):  # a loop of links
            raise UsageError(f"{out_dir} is a link that leads nowhere (a loop); give another "
                             "OUT_DIR") from None
    name = runtimes.resolve(run, config.variant)
    runtime = runtimes.VARIANTS[name].runtime
    spec = preprocessing_of_run(run)
    made = _make_parents(out_dir)
    try:
        _write(run, name, runtime, spec, out_dir)
    except BaseException:
        _remove_made(made)  # `export new/a/out` that failed had left new/a behind
        raise
    say(f"export: {name} ({runtime}) -> {out_dir}: python {out_dir / 'predict.py'} IMAGE...",
        quiet=config.quiet)
    return out_dir


def _write(run: Run, name: str, runtime: str, spec: dict, out_dir: Path) -> None:
    """The folder for ``name``, made in a scratch folder beside (or in) ``out_dir``, then moved
    into place."""
    # An empty folder given (".", a container's mount point) is filled in place: removing it
    # to rename a new one there failed for both, after the whole export. A new one is renamed
    # into place whole.
    in_place = out_dir.is_dir()  # and empty: check_out_dir
    base = out_dir if in_place else out_dir.parent
    try:
        scratch_dir = tempfile.TemporaryDirectory(dir=base, prefix=f".{out_dir.name}.")
    except OSError as exc:
        raise UsageError(f"cannot write in {base} ({exc.strerror}); give an OUT_DIR in a folder "
                         "you can write to") from None
    with scratch_dir as scratch:
        folder = Path(scratch) / "export"
        folder.mkdir()
        serving = {"runtime": runtime}
        if runtime == "onnxruntime":
            _copy_onnx(run, name, folder)
        elif runtime == "openvino":
            _copy_openvino(run, name, folder)
            serving["precision_hint"] = precision_hint(name)  # as the report timed it
        else:
            serving |= _save_torch(run, name, folder)
            say(f"export: {CODE_WARNING}", quiet=False)
        serving |= _environment(run, name) | {"made_for_vnni": runtimes.made_for_vnni(run, name)}
        (folder / "preprocessing.json").write_text(json.dumps(spec, indent=2) + "\n")
        shutil.copyfile(preprocess.__file__, folder / "preprocess.py")
        shutil.copyfile(predict.__file__, folder / "predict_loop.py")
        shutil.copyfile(Path(__file__).with_name(TEMPLATES[runtime]), folder / "predict.py")
        manifest = _manifest(folder, name, run.name, serving)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        _move_into_place(folder, out_dir, in_place)
