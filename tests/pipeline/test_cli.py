"""The CLI through CliRunner and as a subprocess of the installed command."""
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pipeline import config as cfg
from pipeline.cli import cli
from stages.run import artifacts
from stages.run.errors import PipelineError

TINY = ["train", "--model", "smallcnn", "--image-size", "8", "--epochs", "1",
        "--no-measure-memory"]
FAST_REPORT = ["report", "--rounds", "5", "--max-rounds", "5", "--repeats", "4", "--warmup", "1",
               "--batch-sizes", "32"]


def invoke(*args):
    return CliRunner().invoke(cli, list(args), prog_name="pipeline")


@pytest.mark.parametrize("args, needle", [
    (["train", "--model", "resnet7"], "--model 'resnet7' is not one of: mixer, smallcnn, alexnet"),
    (["quantize", "--methods", "torch-static,int4"],
     "--methods 'int4' is not one of: fp32-compiled"),
    (["quantize", "--methods", "openvino-qat"],
     "--methods 'openvino-qat' is made by quantization-aware training, not by quantize: run "
     "'pipeline qat'"),
    (["train", "--epochs", "-3"], "--epochs must be at least 1, got -3"),
    (["--run", "missing", "report"], "run 'missing' does not exist"),
    (["--device", "tpu", "train"], "'tpu' is not one of 'auto', 'cpu', 'cuda'"),
    (["report", "--batch-sizes", "1,x"], "--batch-sizes takes whole numbers"),
    (["qantize"], "No such command 'qantize'. (Did you mean one of: 'qat', 'quantize'?) "
                  "Commands: export, import, list, predict, qat, quantize, report, train."),
    (["import", "--model", "smallcnn"], "--weights is required"),
    (["import", "--model", "resnet18", "--weights", "mine.pth"],
     "--weights 'mine.pth' is not a file, nor a name of torchvision's weights such as DEFAULT; "
     "check the path"),
    (["import", "--model", "smallcnn", "--weights", "DEFAULT"],
     "--weights: torchvision publishes no weights for 'smallcnn'; use --weights FILE"),
    (["quantize", "--tuning-time", "5minutes"],
     "--tuning-time '5minutes' is not a duration; give one such as 90s, 5m or 1h"),
    (["qat", "--tuning-time", "-1m"],
     "--tuning-time '-1m' is not a duration; give one such as 90s, 5m or 1h"),
    (["quantize", "--methods", "openvino-int8,ort-dynamic", "--equalize"],
     "--equalize applies to torch-static and ort-static only, and --methods "
     "ort-dynamic,openvino-int8 has neither; add one of them or drop --equalize"),
    (["quantize", "--auto", "--ort-format", "qoperator"],
     "--auto chooses ort-static's --ort-format itself; drop it or drop --auto"),
    (["quantize", "--auto", "--ort-types", "u8s8"],  # the default's value, given: not dropped
     "--auto chooses ort-static's --ort-types itself; drop it or drop --auto"),
    (["quantize", "--auto", "--per-channel", "--calibration-method", "entropy"],
     "--auto chooses ort-static's --calibration-method, --per-channel/--per-tensor itself; drop "
     "them or drop --auto"),
    (["predict", "/nonexistent/photo.png"], "/nonexistent/photo.png does not exist"),
    (["export", "--variant", "fp32"], "Missing argument 'OUT_DIR'"),
    (["train", "--dataset", "cifar10", "--in-channels", "1"],
     "--in-channels 1: --dataset cifar10 has 3 colour channels, which are not made grey; give "
     "--in-channels 3 or leave it out"),
    (["report", "train"], "train starts a run, so it comes first in a chain (pipeline train "
                          "quantize report), not after report"),
    (["train", "--init-weights", "/nonexistent.pt"],
     "--init-weights '/nonexistent.pt' is not a file"),
    (["train", "--workers", "2", "--loader-timeout", "inf"],  # had failed in poll() once trained
     "--loader-timeout must be at most 86,400 seconds"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, needle):
    result = invoke("--artifacts-dir", str(tmp_path), *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_bare_command_prints_help():
    result = invoke()
    assert result.exit_code == 0 and "pipeline train quantize report" in result.stdout


def test_help_does_not_import_torch():
    code = ("import sys\nfrom pipeline.cli import cli\n"
            "for args in (['--help'], ['train', '--help'], ['import', '--help'], ['qat', '--help'],"
            " ['quantize', '--help'], ['report', '--help'], ['predict', '--help'],"
            " ['export', '--help']):\n"
            "    try:\n        cli.main(args, prog_name='pipeline')\n    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")


def test_config_file_fills_in_and_flags_win(tmp_path, monkeypatch):
    from stages import train

    given = []
    monkeypatch.setattr(train, "run", lambda config, run, **kwargs: given.append(config) or [])
    config = tmp_path / "pipeline.toml"
    config.write_text('[train]\nmodel = "smallcnn"\nimage_size = 8\nepochs = 3\nbaseline = false\n'
                      'measure_memory = false\nseed = 3\n')
    result = invoke("--artifacts-dir", str(tmp_path), "--config", str(config), "--quiet",
                    "train", "--epochs", "1")
    assert result.exit_code == 0, result.stderr
    [saved] = given
    assert saved.epochs == 1 and saved.model == "smallcnn" and saved.baseline is False
    assert saved.measure_memory is False and saved.image_size == 8
    assert saved.seed == 3  # the group's --seed, not given, must not hide the file's
    config.write_text("[train]\nepoch = 1\n")
    bad = invoke("--artifacts-dir", str(tmp_path), "--config", str(config), "train")
    assert bad.exit_code == 2 and "unknown key 'epoch' in [train]" in bad.stderr
    from_env = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path / "none"), "report"],
                                  env={"PIPELINE_CONFIG": str(config)})
    assert from_env.exit_code == 2 and "unknown key 'epoch' in [train]" in from_env.stderr
    config.write_text('[export]\nout_dir = "deploy"\n')  # the argument would replace it unsaid
    argument = invoke("--artifacts-dir", str(tmp_path), "--config", str(config), "report")
    assert argument.exit_code == 2 and "unknown key 'out_dir' in [export]" in argument.stderr


def test_a_config_files_list_of_methods_is_read_as_the_comma_list_is():
    assert cfg.QuantizeConfig(methods=["all"]).methods == cfg.QuantizeConfig().methods
    assert cfg.QuantizeConfig(methods=["ort-static", "torch-static"]).methods == (
        cfg.QuantizeConfig(methods="ort-static,torch-static").methods)
    with pytest.raises(ValueError, match="--methods 'int4' is not one of"):
        cfg.QuantizeConfig(methods=["ort-static", "int4"])


@pytest.mark.parametrize("table, line, needle", [
    ("quantize", 'auto = "no"', "auto in [quantize] must be true or false, got 'no'"),
    ("train", 'baseline = "false"', "baseline in [train] must be true or false, got 'false'"),
    ("train", 'epochs = "3"', "epochs in [train] must be a whole number, got '3'"),
    ("report", "batch_sizes = [1, 2.5]", "batch_sizes in [report] must be a list of whole"),
])
def test_config_file_values_are_type_checked_like_flags(tmp_path, table, line, needle):
    config = tmp_path / "pipeline.toml"
    config.write_text(f"[{table}]\n{line}\n")
    result = invoke("--artifacts-dir", str(tmp_path), "--config", str(config), table)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("qat_table, seconds", [({}, 90.0), ({"tuning_time": "5m"}, 300.0)])
def test_auto_gives_its_tuning_time_to_the_qat_it_goes_on_to(qat_table, seconds):
    """quantize --auto --tuning-time bounds the fallback to QAT too, unless [qat] sets its own."""
    quantize = cfg.QuantizeConfig(auto=True, tuning_time="90s")
    qat = cfg.qat_config_for_auto(quantize, {"qat": qat_table}, seed=3, device="cpu", quiet=True)
    assert qat.tuning_time == seconds and (qat.seed, qat.device, qat.quiet) == (3, "cpu", True)
    assert cfg.qat_config_for_auto(cfg.QuantizeConfig(tuning_time=90), {"qat": qat_table}) is None


def test_a_bad_qat_table_stops_quantize_auto_before_anything_runs(tmp_path):
    config = tmp_path / "pipeline.toml"
    config.write_text("[qat]\nepochs = 0\n")
    result = invoke("--artifacts-dir", str(tmp_path), "--config", str(config), "quantize",
                    "--auto")
    assert result.exit_code == 2
    assert result.stderr == "pipeline: error: --epochs must be at least 1, got 0\n"


def _quantized(worst_drop_points: float):
    """A run as post_training_verdict reads it: ort-static searched, its worst drop this."""
    entries = {"ort-static": {"quantization": {"tuning": {"chosen": {
        "drop_points": 0.0, "worst_drop_points": worst_drop_points}}}}}
    recorded = {}
    return SimpleNamespace(entry=entries.__getitem__, artifacts=lambda: entries,
                           recorded_config=lambda stage: recorded.get(stage, {}),
                           record_config=recorded.__setitem__, recorded=recorded)


def test_auto_goes_on_to_qat_only_where_post_training_missed_the_budget(monkeypatch, capsys):
    from stages import qat, quantize

    given = []
    monkeypatch.setattr(qat, "run", lambda config, run: given.append(config) or ["torch-qat"])
    within = _quantized(0.4)
    assert quantize.escalate_to_qat(within, ["ort-static"], 1.0, "qat config",
                                    quiet=False) == []
    said = ("--auto: ort-static kept within 1 point(s) of the float model after post-training "
            "quantization, so no quantization-aware training is needed")
    assert capsys.readouterr() == ("", said + "\n")  # stdout holds only the paths made
    assert within.recorded["quantize"]["auto_verdict"] == said[len("--auto: "):]
    assert given == []
    missed = _quantized(1.3)
    assert quantize.escalate_to_qat(missed, ["ort-static"], 1.0, "qat config",
                                    quiet=True) == ["torch-qat"]
    assert capsys.readouterr() == ("", "")  # --quiet says nothing; config.json records it
    assert missed.recorded["quantize"]["auto_verdict"] == (
        "no post-training configuration kept within 1 point(s) of the float model on "
        "the held-out images at 95% confidence (ort-static -1.30 points at worst)")
    assert given == ["qat config"]
    # `pipeline train qat --epochs 20 quantize --auto`: the run's QAT, made with the user's
    # flags, had been replaced by a default one fine-tuned again.
    qat_done = _quantized(1.3)
    qat_done.artifacts()["torch-qat"] = {}
    assert quantize.escalate_to_qat(qat_done, ["ort-static"], 1.0, "qat config",
                                    quiet=False) == []
    assert capsys.readouterr().err.endswith(
        "; the run has its quantization-aware training already (pipeline qat)\n")
    assert given == ["qat config"]


def test_torchaos_refusal_to_prepare_or_convert_for_qat_is_not_made_not_the_stages(
        monkeypatch):
    """prepare_qat_pt2e and convert_pt2e raised torchao's own error raw: under --auto the
    stage failed though its post-training variants were made (escalate_to_qat takes NotMade)."""
    from stages.run.errors import NotMade
    from stages.runtimes import pt2e

    def refuses(*args, **kwargs):
        raise RuntimeError("Input partition has more than one output node")

    quantize_pt2e_module, _ = pt2e._pt2e()
    monkeypatch.setattr(quantize_pt2e_module, "prepare_qat_pt2e", refuses)
    monkeypatch.setattr(quantize_pt2e_module, "convert_pt2e", refuses)
    with pytest.raises(NotMade, match="torchao's PT2E QAT preparation failed: Input partition"):
        pt2e.prepare_qat(None, pt2e.pt2e_options(qat=True))
    with pytest.raises(NotMade, match="torchao's PT2E conversion failed: Input partition"):
        pt2e.convert(None)


@pytest.mark.slow
@pytest.mark.xdist_group("qat")  # conftest.py: QAT's exports once a worker
def test_a_qat_that_diverges_under_auto_leaves_the_post_training_variants_standing(
        cheap_run, monkeypatch):
    """Through the command, with a real quantize: only the verdict (a dynamic variant alone
    never misses it) and the QAT are stand-ins."""
    from stages import qat, quantize
    from stages.run.errors import Diverged

    # The QAT --auto goes on to runs in this process, where the patches reach (the
    # post-training variants are made in a child).
    def diverges(config, run):
        raise Diverged("qat: the fake-quantized model diverged at epoch 1 step 3: ...")

    monkeypatch.setattr(quantize, "post_training_verdict",
                        lambda run, names, budget: (False, "nothing kept"))
    monkeypatch.setattr(qat, "run", diverges)
    args = ("--artifacts-dir", str(cheap_run.artifacts_dir), "quantize", "--auto",
            "--methods", "ort-dynamic")
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    dynamic = cheap_run.root / cheap_run.entry("ort-dynamic")["path"]
    assert result.stdout == f"ort-dynamic: {dynamic}\n"
    assert ("--auto: nothing kept; trying quantization-aware training\n"
            "--auto: quantization-aware training made nothing: qat: the fake-quantized model "
            "diverged at epoch 1 step 3: ...\n") in result.stderr
    # Any other failure of QAT is still the command's failure.
    monkeypatch.setattr(qat, "run", lambda config, run: (_ for _ in ()).throw(
        PipelineError("quantize/torch-qat.pt: No space left on device")))
    failed = invoke(*args)
    assert failed.exit_code == 1 and "No space left on device" in failed.stderr


def test_quantize_auto_quiet_lists_only_what_it_made(cheap_run):
    """Through the command: under --quiet, the variants' paths alone; the verdict is in
    config.json."""
    result = invoke("--artifacts-dir", str(cheap_run.artifacts_dir), "--quiet", "quantize",
                    "--auto", "--methods", "ort-dynamic")
    assert result.exit_code == 0, result.stderr
    dynamic = cheap_run.root / cheap_run.entry("ort-dynamic")["path"]
    assert result.stdout == f"ort-dynamic: {dynamic}\n"
    assert result.stderr == ""
    assert cheap_run.recorded_config("quantize")["auto_verdict"] == (
        "no static int8 variant was made, so there is nothing for QAT to rescue")


def test_run_and_artifacts_dir_also_follow_the_stage(tmp_path):
    result = invoke("quantize", "--artifacts-dir", str(tmp_path), "--run", "nope")
    assert result.exit_code == 2
    assert f"run 'nope' does not exist in {tmp_path}" in result.stderr
    clash = invoke("--run", "a", "quantize", "--run", "b")
    assert clash.exit_code == 2 and "--run is given twice with different values" in clash.stderr
    # A `latest` left naming a run that is gone says so, rather than blame a --run never given.
    from stages.run import artifacts

    artifacts.create_run(tmp_path, "kept")
    (tmp_path / "latest").write_text("gone\n")
    stale = invoke("--artifacts-dir", str(tmp_path), "report")
    assert stale.exit_code == 2
    assert (f"{tmp_path / 'latest'} names run 'gone', which is not in {tmp_path}; pass --run NAME "
            "(existing runs: kept)") in stale.stderr


def test_a_compare_run_that_does_not_exist_is_refused_before_the_report_starts(tmp_path):
    from stages.run import artifacts

    run = artifacts.create_run(tmp_path, "mine")
    result = invoke("--artifacts-dir", str(tmp_path), "report", "--compare", "mine,nope")
    assert result.exit_code == 2
    assert f"--compare: no run 'nope' in {tmp_path}; existing runs: mine" in result.stderr
    assert "report" not in run.manifest().get("stages", {})  # not marked failed: it never ran


@pytest.mark.parametrize("last, needle", [
    (["export", "--variant", "fp32", "{full}"], "{full} already exists and is not an empty folder"),
    (["export", "--variant", "ort-statc", "{new}"], "--variant 'ort-statc' is not one of: "
                                                    "recommended, fp32, amp"),
    (["quantize", "report", "predict", "{empty}"], "{empty}: no files in this folder"),
    (["export", "{new}"], "export of the recommended variant needs a report after train in this "
                          "chain: pipeline train report export ..., or name a variant with "
                          "--variant"),
    (["report", "quantize", "predict", "{empty}"], "predict of the recommended variant needs a "
                                                   "report after quantize in this chain"),
    (["quantize", "report", "quantize", "predict", "{empty}"], "needs a report after quantize"),
])
def test_what_ends_a_chain_checks_its_input_before_the_chain_trains(tmp_path, monkeypatch,
                                                                     last, needle):
    """export's OUT_DIR, its --variant and predict's folders were checked when their stage
    ran, after training, quantize and report had taken their minutes; and the recommended
    variant of a chain that makes variants and has no report after them, whose run then has
    no report, or one that recommends what was made again."""
    from stages import train

    monkeypatch.setattr(train, "run", lambda *args, **kwargs: pytest.fail("training ran"))
    folders = {name: tmp_path / name for name in ("full", "new", "empty")}
    for folder in (folders["full"], folders["empty"]):
        folder.mkdir()
    (folders["full"] / "x").write_text("a user's file")
    result = invoke("--artifacts-dir", str(tmp_path / "artifacts"), *TINY,
                    *[arg.format(**folders) for arg in last])
    assert result.exit_code == 2, result.output
    assert needle.format(**folders) in result.stderr
    assert not (tmp_path / "artifacts" / "runs").exists()


def test_compare_looks_for_its_runs_beside_a_run_given_by_its_path(tmp_path):
    """The report opens compared runs beside its own; the check before the chain looked in
    --artifacts-dir instead, and refused a run that was there (or passed one that was not)."""
    from stages.run import artifacts

    mine = artifacts.create_run(tmp_path / "elsewhere", "mine")
    artifacts.create_run(tmp_path / "elsewhere", "theirs")
    result = invoke("--artifacts-dir", str(tmp_path / "default"), "--run", str(mine.root),
                    "report", "--compare", "theirs")
    assert result.exit_code == 2
    assert "--compare: run 'theirs' has no report yet" in result.stderr, result.stderr


def test_python_dash_m_pipeline_is_the_command_too():
    module = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True,
                            text=True)
    assert module.returncode == 0 and "pipeline train quantize report" in module.stdout


@pytest.mark.slow
def test_compare_and_the_speedup_gate(cheap_run):
    artifacts_dir = cheap_run.artifacts_dir
    shutil.copytree(cheap_run.root, artifacts_dir / "runs" / "two")
    base = ["--artifacts-dir", str(artifacts_dir), "--quiet"]
    # A gate the run clears (exit 0) and --compare, in one report.
    compared = invoke(*base, "--run", "two", *FAST_REPORT, "--compare", "cheap",
                      "--fail-under-speedup", "0.01")
    assert compared.exit_code == 0, compared.stderr
    compare_md = artifacts_dir / "runs" / "two" / "report" / "compare.md"
    assert f"compare: {compare_md}" in compared.stdout
    text = compare_md.read_text()
    assert "| variant | `two` | `cheap` |" in text and "| `ort-static` |" in text

    missing = invoke(*base, "--run", "two", *FAST_REPORT, "--compare", "three")
    assert missing.exit_code == 2 and "--compare: no run 'three' in" in missing.stderr
    shutil.copytree(cheap_run.root, artifacts_dir / "runs" / "unreported")
    artifacts.open_run(artifacts_dir, "unreported").unregister("report/report.json")
    unreported = invoke(*base, "--run", "two", *FAST_REPORT, "--compare", "unreported")
    assert unreported.exit_code == 2 and unreported.stderr == (
        "pipeline: error: --compare: run 'unreported' has no report yet; run 'pipeline --run "
        "unreported report' first\n")
    assert json.loads((artifacts_dir / "runs" / "two" / "manifest.json").read_text())[
        "stages"]["report"]["status"] == "complete"  # the report made above stands

    gate = invoke(*base, "--run", "two", *FAST_REPORT, "--fail-under-speedup", "1000")
    assert gate.exit_code == 1
    line = gate.stderr.strip().splitlines()[-1]
    assert "under --fail-under-speedup 1000" in line and "recommended variant" in line
    # Against the fastest float variant, the report's own headline ratio: the same gate on the
    # verdict just written, without a fourth report.
    from stages.report.recommendation import check_gates

    verdict = json.loads((artifacts_dir / "runs" / "two" / "report" / "report.json").read_text())[
        "verdict"]
    with pytest.raises(PipelineError) as floor:
        check_gates(cfg.ReportConfig(fail_under_float_speedup=1000), verdict, "there")
    assert ("as fast as the fastest float variant within the accuracy budget, "
            f"{verdict['per_batch_size']['32']['best_float']}, at batch 32, under "
            "--fail-under-float-speedup 1000") in str(floor.value)


class _RunsCode:
    def __reduce__(self):
        return (print, ("ran",))


@pytest.mark.parametrize("args, line", [
    (["import", "--model", "smallcnn", "--weights", "/etc/passwd"],
     "/etc/passwd is not a PyTorch weights file (neither torch.save's zip archive nor a pickle); "
     "give a state_dict or checkpoint saved with torch.save"),
    (["train", "--model", "nonexistent.module:factory"],
     "--model nonexistent.module:factory: cannot import it (ModuleNotFoundError: No module named "
     "'nonexistent')"),
    (["import", "--model", "smallcnn", "--weights", "{code}"],
     "{code} was refused: loading it would run code from the file (it names print, not only "
     "tensors); save the weights alone (torch.save(model.state_dict(), path)) and give that "
     "file"),
    (["train", "--model", "smallcnn", "--init-weights", "{code}"],
     "{code} was refused: loading it would run code from the file (it names print"),
    (["train", "--model", "smallcnn", "--dataset", "mnist", "--data-dir", "{empty}"],
     "--dataset mnist: no usable data in {empty}/MNIST/raw (expected train-images-idx3-ubyte"),
    (["import", "--model", "smallcnn", "--weights", "{code}", "--dataset", "cifar10",
      "--data-dir", "{empty}"], "--dataset cifar10: no usable data in {empty}/cifar-10-batches-py"),
    (["train", "--model", "smallcnn", "--dataset", "imagefolder", "--data-dir", "{empty}"],
     "--dataset imagefolder: {empty} has no class subfolders"),
])
def test_input_a_new_run_cannot_use_is_refused_before_the_run_exists(tmp_path, args, line):
    """No run folder is made and `latest` stays where it was, so the next stage does not land
    on a run whose first stage failed on its input."""
    import torch

    code, empty = tmp_path / "code.pt", tmp_path / "empty"  # data missing: the run had been
    torch.save({"state_dict": _RunsCode()}, code)  # made, and 'latest' moved, to fail in train
    empty.mkdir()
    (tmp_path / "latest").write_text("before\n")
    result = invoke("--artifacts-dir", str(tmp_path),
                    *[a.format(code=code, empty=empty) for a in args])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "pipeline: error: " + line.format(code=code, empty=empty))
    assert not (tmp_path / "runs").exists()
    assert (tmp_path / "latest").read_text() == "before\n"


def test_list_prints_what_each_registry_holds_and_touches_no_run(tmp_path):
    from stages import runtimes

    result = invoke("--artifacts-dir", str(tmp_path), "list", "variants")
    assert result.exit_code == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[0] for row in rows] == list(runtimes.VARIANTS)  # registry order, one a line
    assert rows[list(runtimes.VARIANTS).index("ort-static")][1:4] == [
        "onnxruntime", "int8", "quantize"]
    everything = invoke("--artifacts-dir", str(tmp_path), "list")
    assert everything.exit_code == 0, everything.stderr
    lines = everything.stdout.splitlines()
    assert [line for line in lines if line.endswith(":")] == ["models:", "datasets:",
                                                              "variants:"]
    assert "smallcnn  (built-in: A three-conv net" in everything.stdout
    assert "resnet18  (torchvision)" in lines and "imagefolder" in everything.stdout
    assert not any(tmp_path.iterdir())  # no run made, no latest pointer
    chained = invoke("--artifacts-dir", str(tmp_path), "train", "list")
    assert chained.exit_code == 2 and chained.stdout == ""
    assert "list works alone" in chained.stderr and not any(tmp_path.iterdir())


# Config fields with no flag of their stage: the group's (--seed, --device, --quiet) and the
# commands' arguments (predict's PATHS, export's OUT_DIR).
NOT_FLAGS = {"seed", "device", "quiet", "paths", "out_dir"}


def test_every_flag_is_a_field_and_shows_the_default_the_stage_runs_with():
    """One source: each option comes from pipeline/flags.py and its config's dataclass. A
    table entry names a real field; a default in words is given only where the dataclass's
    is None (computed); the shown default is the dataclass's; every other field has a flag."""
    import dataclasses

    from pipeline import config as cfg
    from pipeline.cli import cli
    from pipeline.click_support import _shown
    from pipeline.flags import FLAGS

    for stage, table in FLAGS.items():
        fields = {f.name: f.default for f in dataclasses.fields(cfg.STAGE_CONFIGS[stage])}
        assert set(table) <= set(fields), stage
        assert set(fields) - set(table) <= NOT_FLAGS, (stage, set(fields) - set(table))
        options = {p.name: p for p in cli.commands[stage].params}
        for name, flag in table.items():
            default = fields[name]
            assert flag.default is None or default in (None, ""), (stage, name)  # "": required
            option = options[name]
            assert option.default is None  # a --config file's value stands where not given
            if flag.default is None and not flag.flag:  # the dataclass's, in its words
                shown = _shown(default, "--" + name.replace("_", "-"))
                assert option.help.endswith(f"[default: {shown}]"), (stage, name, option.help)
    # A few as a user reads them, written out here rather than through _shown:
    helps = {(stage, p.name): p.help for stage in FLAGS for p in cli.commands[stage].params}
    for (stage, name), shown in {("train", "batch_size"): "64", ("train", "lr"): "auto",
                                 ("train", "baseline"): "baseline",
                                 ("quantize", "max_accuracy_drop"): "1",
                                 ("report", "batch_sizes"): "1,32"}.items():
        assert helps[stage, name].endswith(f"[default: {shown}]"), (stage, name)


def test_a_report_table_in_a_config_file_is_not_hidden_by_the_groups_defaults(tmp_path,
                                                                              monkeypatch):
    """[report] device and quiet hold unless --device or --quiet is given (both were taken
    from the group's defaults whether given or not)."""
    from stages import report as report_stage

    artifacts.create_run(tmp_path, "r")
    config = tmp_path / "pipeline.toml"
    config.write_text('[report]\ndevice = "cpu"\nquiet = true\n')
    seen = []

    def stop(config, run):
        seen.append((config.device, config.quiet))
        raise PipelineError("stop")

    monkeypatch.setattr(report_stage, "run", stop)
    base = ["--artifacts-dir", str(tmp_path), "--run", "r", "--config", str(config)]
    invoke(*base, "report")
    invoke(*base, "--device", "auto", "report")
    assert seen == [("cpu", True), ("auto", True)]
